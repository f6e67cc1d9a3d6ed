"""Tables and plots of ``python -m parity.bench``: bench.json, bench.md, bench.png,
bench-overlap.png and the console summary, from the workers' ``results.jsonl``.

Definitions (also printed in bench.md):

* useful TFLOP/s: forward ``4 * sum|R| * Hq * D / time``; the backward counts 2.5x the
  forward's flops, forward+backward 3.5x (dense causal attention: its causal work
  ``4 * S(S+1)/2 * Hq * D``). The per-piece figures use the same counts: the forward
  kernel 1x, the backward kernel 2.5x.
* ÷dense: time over the same framework's dense causal attention at the same S and
  heads (the other framework's where that one is missing). ÷triton: a JAX backend's
  time over torch Triton's on the same shape and routes.
* TB/s of the pieces (torch Triton): bytes moved per union ID over the kernel's time. The
  forward kernel gathers one K and one V row per ID of each program's union, per KV head
  (``gather_bytes``); a flat plan's backward gathers the same and adds a [2, D] fp32 dK/dV
  block per ID (``+ bwd_add_bytes``). Both kernels' times follow this traffic, not their
  tensor-core work (docs/design-token-gather.md).
* J: mean adjacent-row Jaccard of the route sets (token level; for QSA-format routes
  over the rows past the identity region); inflation: union entries x matrix rows over
  useful entries for the kernels' default tiling, flat programs of 128 (row, head)
  pairs (:func:`qsa_common.route_stats.union_inflation`; other tilings in bench.json).
"""

from __future__ import annotations

import json
import os
import re

__all__ = ["PRIORITY", "DENSE", "enrich", "write_outputs", "console_summary"]

# Run order (most important first; each backend gets a fair share of what is left) and
# the order of rows and colours in the report.
PRIORITY = ("torch-dense-sdpa", "jax-dense-cudnn", "jax-pallas", "triton", "jax-triton", "flex", "fa4",
            "cudnn", "torch-reference", "jax-xla")
DENSE = {"torch-dense-sdpa": "torch", "jax-dense-cudnn": "jax"}
TRITON = "triton"  # the torch kernel JAX backends are compared with
DEFAULT_TILING = "flat128"


def _flops(record: dict, head_dim: int) -> float | None:
    hq = record["heads"][0]
    if record.get("sum_routes"):
        return 4.0 * record["sum_routes"] * hq * head_dim
    if record["backend"] in DENSE:
        s = record["seq_len"]
        return 4.0 * s * (s + 1) / 2 * hq * head_dim
    return None


def enrich(records: list[dict]) -> list[dict]:
    """Add TFLOP/s (whole op and per piece), the ratio to the same framework's dense
    baseline (else the other's) and, for JAX route-sparse backends, to torch Triton."""
    dense, triton = {}, {}
    for r in records:
        if r.get("status") != "ok":
            continue
        if r["backend"] in DENSE:
            dense[(r["framework"], r["seq_len"], tuple(r["heads"]))] = r
        elif r["backend"] == TRITON:
            triton[r["shape"]] = r
    rows = []
    for r in records:
        r = dict(r)
        flops = _flops(r, r["head_dim"])
        if r.get("status") == "ok" and flops:
            for key, factor in (("fwd", 1.0), ("fwdbwd", 3.5), ("piece_fwd", 1.0), ("piece_bwd", 2.5)):
                if r.get(f"{key}_ms"):
                    r[f"{key}_tflops"] = factor * flops / (r[f"{key}_ms"] * 1e-3) / 1e12
        other = "jax" if r["framework"] == "torch" else "torch"
        base = (dense.get((r["framework"], r["seq_len"], tuple(r["heads"])))
                or dense.get((other, r["seq_len"], tuple(r["heads"]))))
        if base is not None and r.get("status") == "ok":
            r["dense_baseline"] = base["backend"]
            for key in ("fwd_ms", "fwdbwd_ms"):
                if r.get(key) and base.get(key):
                    r[f"{key[:-3]}_vs_dense"] = r[key] / base[key]
        torch_kernel = triton.get(r["shape"])
        if (torch_kernel is not None and r["framework"] == "jax" and r["backend"] not in DENSE
                and r.get("status") == "ok"):
            for key in ("fwd_ms", "fwdbwd_ms"):
                if r.get(key) and torch_kernel.get(key):
                    r[f"{key[:-3]}_vs_triton"] = r[key] / torch_kernel[key]
        if r.get("status") == "ok" and r.get("gather_bytes"):
            if r.get("piece_fwd_ms"):
                r["piece_fwd_tbs"] = r["gather_bytes"] / (r["piece_fwd_ms"] * 1e-3) / 1e12
            if r.get("piece_bwd_ms") and r.get("bwd_add_bytes"):
                r["piece_bwd_tbs"] = (r["gather_bytes"] + r["bwd_add_bytes"]) / (r["piece_bwd_ms"] * 1e-3) / 1e12
        rows.append(r)
    return rows


def _cell(value, fmt="{:.2f}") -> str:
    return "—" if value is None else fmt.format(value)


def _inflation(r: dict, tiling: str = DEFAULT_TILING) -> float | None:
    return (r.get("inflation") or {}).get(tiling)


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cells) + " |" for cells in body] + [""])


def _section(title: str, text: str, header: list[str], body: list[list[str]]) -> list[str]:
    return [f"## {title}", "", text, ""] + _table(header, body)


_SHAPE = ["S", "heads", "routes", "backend"]


def _shape_cells(r: dict) -> list[str]:
    family = "dense causal" if r["backend"] in DENSE else r["family"]
    return [str(r["seq_len"]), f"{r['heads'][0]}:{r['heads'][1]}", family, r["backend"]]


_RANK = {name: i for i, name in enumerate(PRIORITY)}


def _order(r: dict) -> tuple:
    return (r["heads"][0], r["seq_len"], _RANK.get(r["backend"], 99))


def _shape_order(r: dict) -> tuple:
    """Per shape: its dense rows (family "-") first, then each route set's rows."""
    return (r["heads"][0], r["seq_len"], r["family"] != "-", r["family"], _RANK.get(r["backend"], 99))


def _tiling_key(label: str) -> tuple:
    """flat programs first, then row tiles; larger first within a kind."""
    kind, size = re.fullmatch(r"([a-z]+)(\d+)", label).groups()
    return (kind != "flat", -int(size))


def _note(r: dict) -> str:
    note = r.get("note", "") if r.get("status") == "ok" else f"{r.get('status')}: {r.get('reason', '')}"
    if r.get("fwdbwd_reason"):
        note = r["fwdbwd_reason"]
    return note.replace("|", "/")[:200]


def _main_table(rows: list[dict]) -> list[str]:
    header = _SHAPE + ["fwd ms", "fwd TFLOP/s", "fwd ÷dense", "fwd+bwd ms", "fwd+bwd TFLOP/s",
                       "fwd+bwd ÷dense", "peak GiB", "J", "infl.", "note"]
    body = []
    for r in sorted(rows, key=_shape_order):
        peak = r.get("fwdbwd_peak_bytes") or r.get("fwd_peak_bytes")
        body.append(_shape_cells(r) + [
            _cell(r.get("fwd_ms")), _cell(r.get("fwd_tflops"), "{:.3g}"),
            _cell(r.get("fwd_vs_dense")), _cell(r.get("fwdbwd_ms")),
            _cell(r.get("fwdbwd_tflops"), "{:.3g}"), _cell(r.get("fwdbwd_vs_dense")),
            _cell(peak / 2**30 if peak else None), _cell(r.get("jaccard"), "{:.3f}"),
            _cell(_inflation(r)), _note(r),
        ])
    return _table(header, body)


def _route_table(rows: list[dict]) -> list[str]:
    sets = {}
    for r in rows:
        if r["backend"] not in DENSE and r.get("jaccard_all") is not None:
            sets.setdefault((r["seq_len"], r["family"], r["heads"][0] // r["heads"][1]), r)
    if not sets:
        return []
    tilings = sorted({t for r in sets.values() for t in (r.get("inflation") or {})}, key=_tiling_key)
    header = ["S", "routes", "G", "target J", "J", "J all rows", "valid routes"] + [f"infl. {t}" for t in tilings]
    body = [[str(s), family, str(g), _cell(r.get("overlap_target"), "{:g}"), _cell(r.get("jaccard"), "{:.3f}"),
             _cell(r.get("jaccard_all"), "{:.3f}"), str(r.get("sum_routes", "—"))]
            + [_cell(_inflation(r, t)) for t in tilings]
            for (s, family, g), r in sorted(sets.items())]
    return _section("Route sets", "J: mean adjacent-row Jaccard (token level; QSA-format routes: rows past "
                    "the identity region). infl.: union entries x matrix rows / useful entries per tiling: "
                    "flatP = programs of P consecutive (row, head) pairs, tileT = T rows x G heads.",
                    header, body)


def _piece_table(rows: list[dict]) -> list[str]:
    measured = [r for r in rows if r.get("piece_bwd_ms") or r.get("pieces_reason")]
    if not measured:
        return []
    header = _SHAPE + ["J", "infl.", "unions ms", "fwd kernel ms", "fwd TFLOP/s", "fwd TB/s", "unions+fwd ms",
                       "bwd kernel ms", "bwd TFLOP/s", "bwd TB/s", "fwd+bwd ms", "note"]
    body = []
    for r in sorted(measured, key=lambda r: (r["family"], *_order(r))):
        fwd = _cell(r.get("piece_fwd_ms")) + (" (diff.)" if r.get("piece_fwd_by_difference") else "")
        body.append(_shape_cells(r) + [
            _cell(r.get("jaccard"), "{:.3f}"), _cell(_inflation(r)), _cell(r.get("piece_unions_ms")), fwd,
            _cell(r.get("piece_fwd_tflops"), "{:.3g}"), _cell(r.get("piece_fwd_tbs")),
            _cell(r.get("piece_unions_fwd_ms")), _cell(r.get("piece_bwd_ms")),
            _cell(r.get("piece_bwd_tflops"), "{:.3g}"), _cell(r.get("piece_bwd_tbs")), _cell(r.get("fwdbwd_ms")),
            (r.get("pieces_reason") or r.get("pieces_note") or "")[:160]])
    return _section("Per piece", "Each piece timed on its own (median, L2 flushed): route unions, forward "
                    "kernel (\"diff.\": unions+forward minus unions), backward kernel from the forward's "
                    "residuals. fwd+bwd: the whole autograd step, as in the first table. TB/s: union-ID "
                    "traffic (gathered K/V rows; the backward adds its fp32 dK/dV blocks) over the kernel's "
                    "time.", header, body)


def _versus_triton_table(rows: list[dict]) -> list[str]:
    paired = [r for r in rows if r.get("fwd_vs_triton") or r.get("fwdbwd_vs_triton")]
    if not paired:
        return []
    header = _SHAPE + ["fwd ms", "fwd ÷triton", "fwd+bwd ms", "fwd+bwd ÷triton"]
    body = [_shape_cells(r) + [_cell(r.get("fwd_ms")), _cell(r.get("fwd_vs_triton"), "{:.3f}"),
                               _cell(r.get("fwdbwd_ms")), _cell(r.get("fwdbwd_vs_triton"), "{:.3f}")]
            for r in sorted(paired, key=lambda r: (r["family"], *_order(r)))]
    return _section("JAX vs torch Triton", "Time of each JAX route-sparse backend over torch Triton's on the "
                    "same shape and routes (1.05 = 5% slower).", header, body)


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# QSA benchmark",
        "",
        f"Command: `{meta.get('command', '')}`  ",
        f"Device: {meta.get('device', '?')}; {meta.get('date', '')}; B=1, D={meta.get('head_dim')}, "
        f"{meta.get('dtype')}, route width {4 * meta.get('top_k', 512) + 4} (top_k {meta.get('top_k')}), "
        "one document per row.",
        "",
        "Median milliseconds (L2 flushed before each repetition). Useful TFLOP/s: forward "
        "4·Σ|R|·Hq·D / time, forward+backward 3.5x that (dense: its causal work). "
        "÷dense: time over the same framework's dense causal attention at the same S and heads. "
        "Peak: device memory high-water mark during forward+backward (JAX: process high-water mark). "
        "J: mean adjacent-row Jaccard of the routes; infl.: their tile-union inflation for flat "
        "programs of 128 (row, head) pairs (see Route sets).",
        "",
    ]
    lines += _main_table(rows)
    for section in (_piece_table(rows), _versus_triton_table(rows), _route_table(rows)):
        lines += section
    return "\n".join(lines).rstrip("\n") + "\n"


def _color(name: str) -> str:
    """The same colour for a backend in every panel."""
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf"]
    index = PRIORITY.index(name) if name in PRIORITY else len(PRIORITY) + sum(map(ord, name))
    return palette[index % len(palette)]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish_axes(ax, title: str) -> None:
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_scaling(rows: list[dict], path: str) -> str | None:
    """PNG of time vs S per backend (log-log): one row of panels per (routes, heads);
    route sets measured at a single S appear only in the overlap plot (if any set has two)."""
    try:
        plt = _pyplot()
    except ImportError as err:
        return f"no plot: {err} (rerun `python -m parity.bench --replot DIR` where matplotlib is installed)"
    ok = [r for r in rows if r.get("status") == "ok"]
    groups = sorted({(r["family"], tuple(r["heads"])) for r in ok if r["family"] != "-"})
    spread = [g for g in groups if len({r["seq_len"] for r in ok if (r["family"], tuple(r["heads"])) == g}) > 1]
    groups = spread or groups
    if not groups:
        groups = sorted({("-", tuple(r["heads"])) for r in ok})
    if not groups:
        return "no plot: nothing was measured"
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4.2 * len(groups)), squeeze=False)
    for row, (family, heads) in enumerate(groups):
        for col, (key, title) in enumerate((("fwd_ms", "forward"), ("fwdbwd_ms", "forward+backward"))):
            ax = axes[row][col]
            members = [r for r in ok if tuple(r["heads"]) == heads and r["family"] in (family, "-")]
            for name in dict.fromkeys(r["backend"] for r in members):
                pts = sorted((r["seq_len"], r[key]) for r in members if r["backend"] == name and r.get(key))
                if pts:
                    style = "--" if name in DENSE else "-"
                    ax.plot(*zip(*pts), style, marker="o", label=name, color=_color(name))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("S (tokens)")
            ax.set_ylabel("median ms")
            label = "dense only" if family == "-" else f"{family} routes"
            _finish_axes(ax, f"{title}, {label}, (Hq,Hkv)=({heads[0]},{heads[1]})")
    _save(plt, fig, path)
    return None


def _plot_overlap(rows: list[dict], path: str) -> str | None:
    """PNG of forward+backward time vs the measured Jaccard, per backend, one panel per
    (S, heads) with at least two overlap route sets; dense baselines as horizontal lines.
    Nothing is written (None) when no (S, heads) has two."""
    ok = [r for r in rows if r.get("status") == "ok"]
    swept: dict[tuple, set] = {}
    for r in ok:
        if "@" in r["family"]:
            swept.setdefault((r["seq_len"], tuple(r["heads"])), set()).add(r["family"])
    panels = sorted(p for p, labels in swept.items() if len(labels) > 1)
    if not panels:
        return None
    try:
        plt = _pyplot()
    except ImportError as err:
        return f"no overlap plot: {err}"
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, (s, heads) in zip(axes[0], panels):
        members = [r for r in ok if r["seq_len"] == s and tuple(r["heads"]) == heads]
        for r in members:
            if r["backend"] in DENSE and r.get("fwdbwd_ms"):
                ax.axhline(r["fwdbwd_ms"], ls="--", color=_color(r["backend"]), label=r["backend"])
        for name in dict.fromkeys(r["backend"] for r in members if r["backend"] not in DENSE):
            pts = sorted((r["jaccard"], r["fwdbwd_ms"]) for r in members
                         if r["backend"] == name and "@" in r["family"] and r.get("fwdbwd_ms")
                         and r.get("jaccard") is not None)
            if pts:
                ax.plot(*zip(*pts), "-", marker="o", label=name, color=_color(name))
        ax.set_yscale("log")
        ax.set_xlabel("measured adjacent-row Jaccard")
        ax.set_ylabel("forward+backward median ms")
        _finish_axes(ax, f"S={s}, (Hq,Hkv)=({heads[0]},{heads[1]})")
    _save(plt, fig, path)
    return None


def write_outputs(out_dir: str, meta: dict) -> dict:
    """Rebuild bench.json, bench.md, bench.png (and bench-overlap.png) from
    ``out_dir/results.jsonl``; returns ``{"rows", "meta"}``."""
    records = []
    results = os.path.join(out_dir, "results.jsonl")
    if os.path.exists(results):
        with open(results) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by a kill
    rows = enrich(records)
    meta = dict(meta)
    for key, plot in (("plot", _plot_scaling(rows, os.path.join(out_dir, "bench.png"))),
                      ("overlap_plot", _plot_overlap(rows, os.path.join(out_dir, "bench-overlap.png")))):
        if plot:
            meta[key] = plot
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(_markdown(rows, meta))
    return {"rows": rows, "meta": meta}


def console_summary(rows: list[dict]) -> str:
    header = ["shape", "backend", "status", "J", "infl.", "fwd ms", "fwd+bwd ms", "fwd+bwd ÷dense",
              "TFLOP/s fwd", "note"]
    table = [[r["shape"], r["backend"], r.get("status", "?"), _cell(r.get("jaccard"), "{:.3f}"),
              _cell(_inflation(r)), _cell(r.get("fwd_ms")), _cell(r.get("fwdbwd_ms")), _cell(r.get("fwdbwd_vs_dense")),
              _cell(r.get("fwd_tflops"), "{:.3g}"), (r.get("reason") or r.get("fwdbwd_reason") or "")[:70]]
             for r in rows if r.get("status") != "unavailable"]
    hidden = sum(r.get("status") == "unavailable" for r in rows)
    if not table:
        return f"(nothing measured; {hidden} unavailable)"
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header)] + [fmt.format(*r) for r in table]
    if hidden:
        lines.append(f"({hidden} unavailable shape/backend pairs not shown; see bench.md)")
    return "\n".join(lines)
