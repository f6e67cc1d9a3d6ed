"""Render a :class:`parity.suite.SuiteResult` as Markdown, JSON and a terminal summary."""

from __future__ import annotations

import json
import os
from collections import defaultdict

from .backends import BITWISE_PAIRS
from .runners import QUANTITIES
from .suite import SuiteResult

__all__ = ["write_report", "summary_text", "markdown"]


def _fmt(err: float | None) -> str:
    return "—" if err is None else f"{err:.2e}"


def _case_key(case: dict) -> tuple:
    return (case["layout"], case["family"], case["dtype"], tuple(case["heads"]))


def _heads(case: dict) -> str:
    return f"{case['heads'][0]}:{case['heads'][1]}"


def _cell_text(status: str, err: float | None) -> str:
    if status in ("pass", "fail"):
        return _fmt(err) + (" **FAIL**" if status == "fail" else "")
    return {"unavailable": "n/a", "skipped": "skipped", "error": "**ERROR**"}[status]


def _worst(values: list[tuple[str, float | None]]) -> tuple[str, float | None]:
    """Worst (status, error) of a group of cells: fail/error beat pass; pass beats n/a."""
    rank = {"error": 4, "fail": 3, "pass": 2, "skipped": 1, "unavailable": 0}
    best = ("unavailable", None)
    for status, err in values:
        if rank[status] > rank[best[0]] or (
            status == best[0] and err is not None and (best[1] is None or err > best[1])
        ):
            best = (status, err)
    return best


def _cross_by_backend(result: SuiteResult) -> dict[tuple, tuple[str, float, str]]:
    """(case key, backend) -> (status, worst cross error, the other backend of that error)."""
    groups: dict[tuple, list] = defaultdict(list)
    for c in result.cross:
        groups[(_case_key(c.case), c.first)].append((c.error, c.status, c.second))
        groups[(_case_key(c.case), c.second)].append((c.error, c.status, c.first))
    worst = {}
    for key, items in groups.items():
        err, _, other = max(items, key=lambda item: item[0])
        status = "fail" if any(s == "fail" for _, s, _ in items) else "pass"
        worst[key] = (status, err, other)
    return worst


def _summary_rows(result: SuiteResult) -> list[list[str]]:
    """One row per (backend, dtype): worst error per quantity over all cases."""
    groups: dict[tuple[str, str], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    cases_run: dict[tuple[str, str], set] = defaultdict(set)
    for c in result.cells:
        key = (c.backend, c.case["dtype"])
        groups[key][c.quantity].append((c.status, c.error))
        if c.status in ("pass", "fail", "error"):
            cases_run[key].add(_case_key(c.case))
    cross = _cross_by_backend(result)
    cross_groups: dict[tuple[str, str], list] = defaultdict(list)
    for (case_key, backend), (status, err, _) in cross.items():
        cross_groups[(backend, case_key[2])].append((status, err))
    rows = []
    order = {name: i for i, name in enumerate(result.backends)}
    for key in sorted(groups, key=lambda k: (order.get(k[0], 99), k[1])):
        cells = [_cell_text(*_worst(groups[key][q])) for q in QUANTITIES]
        cross_cell = _cell_text(*_worst(cross_groups.get(key, [])))
        statuses = [s for q in QUANTITIES for s, _ in groups[key][q]]
        statuses += [s for s, _ in cross_groups.get(key, [])]
        verdict = ("FAIL" if any(s in ("fail", "error") for s in statuses)
                   else "pass" if "pass" in statuses else "n/a")
        total = len({_case_key(c.case) for c in result.cells if (c.backend, c.case["dtype"]) == key})
        rows.append([key[0], key[1], f"{len(cases_run[key])}/{total}", *cells, cross_cell, verdict])
    return rows


def _unavailable_rows(result: SuiteResult) -> list[list[str]]:
    groups: dict[tuple[str, str], dict] = {}
    for c in result.cells:
        if c.status not in ("unavailable", "skipped"):
            continue
        g = groups.setdefault((c.backend, c.reason), {"quantities": set(), "cases": set()})
        g["quantities"].add(c.quantity)
        g["cases"].add(_case_key(c.case))
    rows = []
    for (backend, reason), g in groups.items():
        qs = ", ".join(q for q in QUANTITIES if q in g["quantities"])
        rows.append([backend, qs, str(len(g["cases"])), reason.replace("|", "/").replace("\n", " ")])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _plain_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))]
                     + [fmt.format(*r) for r in rows])


_SUMMARY_HEADER = ["backend", "dtype", "cases", *QUANTITIES, "cross", "result"]


def _verdict(result: SuiteResult) -> str:
    measured = sum(c.status in ("pass", "fail", "error") for c in result.cells)
    skipped = sum(c.status == "skipped" for c in result.cells)
    text = (f"FAIL: {result.failures} failing cells" if result.failures
            else f"PASS: all {measured} measured cells and {len(result.cross)} cross-checks pass")
    if skipped:
        text += f" ({skipped} cells not run)"
    if not result.complete:
        text += " (run incomplete)"
    return text


def markdown(result: SuiteResult, command: str = "") -> str:
    c = result.config
    env = result.environment
    oracles = sorted(set(result.oracles.values()))
    oracle_text = {
        "dense": "the float64 dense oracle (`qsa_common.oracle`)",
    }
    described = [oracle_text.get(o, f"`{o}`: the torch reference computed in float64 "
                                 "(the dense oracle is O(S^2) and too large here)") for o in oracles]
    heads = ", ".join(f"({h}, {k})" for h, k in c.heads)
    parts = [
        "# QSA parity report",
        "",
        f"**{_verdict(result)}**",
        "",
        (f"Command: `{command}`  " if command else "")
        + f"seed {result.seed}, {result.elapsed:.0f} s.",
        "",
        f"- Shapes: S = {c.seq_len} (CP: {c.world_size} ranks, last rank's {c.seq_len // c.world_size} "
        f"query rows against all {c.seq_len} K/V rows; padded: batch {c.batch}), heads (Hq, Hkv) {heads}, "
        f"D = {c.head_dim}, route width {4 * c.top_k + 4} (top_k {c.top_k}).",
        f"- Layouts {', '.join(c.layouts)}; route families {', '.join(c.families)}; "
        f"dtypes {', '.join(c.dtypes)}.",
        f"- Oracle: {'; '.join(described) or 'none run'}. Error = ||x - oracle|| / ||oracle|| "
        "(Frobenius, float64). Tolerances (the contract's): "
        + ", ".join(f"{k} {v:g}" for k, v in sorted(result.to_json()['tolerance'].items())
                    if k in c.dtypes) + ".",
        "- Cross = worst error between this backend and any other backend on the same inputs "
        "(same tolerance).",
        f"- Environment: torch device `{env.torch_device or 'none'}`"
        + (f" (SM{env.capability[0]}{env.capability[1]})" if env.capability else "")
        + f", JAX platform `{env.jax_platform or 'none'}`, TRITON_INTERPRET={int(env.triton_interpret)}.",
        "",
        "## Worst error per backend and dtype",
        "",
        _table(_SUMMARY_HEADER, _summary_rows(result)),
        "",
        "## Backends",
        "",
        _table(["backend", "framework", "status", "what"],
               [[n, b["framework"], _backend_status(result, n), b["description"]]
                for n, b in result.backends.items()]),
        "",
    ]
    parts += _bitwise_section(result)
    unavailable = _unavailable_rows(result)
    if unavailable:
        parts += ["## Not measured (unavailable or not run), and why", "",
                  _table(["backend", "quantities", "cases", "reason"], unavailable), ""]
    failing = [cell for cell in result.cells if cell.status in ("fail", "error")]
    failing_cross = [x for x in result.cross if x.status == "fail"]
    if failing or failing_cross or any(b.status != "pass" for b in result.bitwise):
        parts += ["## Failures", ""]
        for cell in failing:
            what = _fmt(cell.error) if cell.status == "fail" else cell.reason
            parts.append(f"- {_key_text(cell.case)} **{cell.backend}** {cell.quantity}: {what}")
        for x in failing_cross:
            parts.append(f"- {_key_text(x.case)} {x.first} vs {x.second} {x.quantity}: {_fmt(x.error)}")
        for b in result.bitwise:
            if b.status != "pass":
                parts.append(f"- {_key_text(b.case)} {b.first} vs {b.second} forward not bitwise equal: "
                             f"out {_fmt(b.out)}, LSE {_fmt(b.lse)} {b.reason}".rstrip())
        parts.append("")
    parts += ["## Every cell", "", _all_cells_table(result), ""]
    seconds: dict[str, float] = defaultdict(float)
    for key, value in result.timings.items():
        seconds[key.rsplit("/", 1)[-1]] += value
    if seconds:
        parts += ["## Seconds spent (compilation included)", "",
                  _table(["backend", "seconds"], [[k, f"{v:.1f}"] for k, v in seconds.items()]), ""]
    if result.notes:
        parts += ["## Notes", ""]
        for note in result.notes:
            parts += ["```", note[-1500:], "```"]
        parts.append("")
    return "\n".join(parts)


_BITWISE_TEXT = (
    "`{first}` (torch) and `{second}` (JAX) launch the same `qsa_triton` kernels, with launches built "
    "by one function from one plan (tiles, unions, grids, warps, stages, constexprs, and the fp32 "
    "scalars rounded once on the host): on the same inputs and GPU their forward output and LSE "
    "must be equal bit for bit, max |diff| = 0 (anything else fails the run). The backward is not "
    "judged here: dK and dV are sums of fp32 atomic adds by many programs, which the GPU orders "
    "anew on every run (a framework against itself differs the same way), so dk and dv differ in "
    "their last bits, while dq, summed in registers in a fixed order, follows the forward; all three "
    "are held to the oracle's tolerance in the tables above. max |diff| of the values (16-bit outputs "
    "compared exactly through fp32); equal infinities (the LSE of rows without routes) count as 0.")


def _bitwise_section(result: SuiteResult) -> list[str]:
    """The bitwise comparison of :data:`BITWISE_PAIRS`, or why it was not measured."""
    parts = []
    for first, second in BITWISE_PAIRS:
        if first not in result.backends or second not in result.backends:
            continue
        parts += [f"## Bitwise: {first} vs {second} (the same kernels from two frameworks)", "",
                  _BITWISE_TEXT.format(first=first, second=second), ""]
        cells = [b for b in result.bitwise if (b.first, b.second) == (first, second)]
        if not cells:
            why = [f"`{name}`: {_backend_status(result, name)}" for name in (first, second)
                   if not _backend_status(result, name).startswith("ran")]
            parts += ["Not measured: the two never ran on the same case"
                      + (f" ({'; '.join(why)})." if why else "."), ""]
            continue
        rows = [[b.case["layout"], b.case["family"], b.case["dtype"], _heads(b.case), _diff(b.out), _diff(b.lse),
                 *(_diff(b.backward.get(q)) for q in QUANTITIES[1:]),
                 "pass" if b.status == "pass" else f"**{b.status.upper()}** {b.reason}".rstrip()]
                for b in cells]
        parts += [_table(["layout", "family", "dtype", "heads", "out max|diff|", "LSE max|diff|", "dq", "dk", "dv",
                          "forward bitwise"], rows), ""]
    return parts


def _diff(value: float | None) -> str:
    if value is None or value != value:
        return "—"
    return "0" if value == 0 else f"{value:.2e}"


def _backend_status(result: SuiteResult, name: str) -> str:
    """"ran in N cases", or "unavailable: <the distinct reasons>"."""
    ran = {_case_key(c.case) for c in result.cells
           if c.backend == name and c.status in ("pass", "fail", "error")}
    if ran:
        return f"ran in {len(ran)} cases"
    reasons = dict.fromkeys(c.reason for c in result.cells if c.backend == name)
    reasons.pop("", None)
    return "not run: " + "; ".join(reasons) if reasons else "not run"


def _key_text(case: dict) -> str:
    return f"{case['layout']}/{case['family']}/{case['dtype']}/{_heads(case)}"


def _all_cells_table(result: SuiteResult) -> str:
    by_row: dict[tuple, dict[str, tuple[str, float | None]]] = defaultdict(dict)
    for c in result.cells:
        by_row[(_case_key(c.case), c.backend)][c.quantity] = (c.status, c.error)
    cross = _cross_by_backend(result)
    rows = []
    for (case_key, backend), cells in by_row.items():
        if all(s == "unavailable" for s, _ in cells.values()):
            continue
        layout, family, dtype, heads = case_key
        row = [layout, family, dtype, f"{heads[0]}:{heads[1]}", backend]
        row += [_cell_text(*cells.get(q, ("unavailable", None))) for q in QUANTITIES]
        x = cross.get((case_key, backend))
        row.append("—" if x is None else f"{_cell_text(x[0], x[1])} ({x[2]})")
        statuses = [s for s, _ in cells.values()] + ([x[0]] if x else [])
        row.append("FAIL" if any(s in ("fail", "error") for s in statuses)
                   else "pass" if "pass" in statuses else "skipped")
        rows.append(row)
    header = ["layout", "family", "dtype", "heads", "backend", *QUANTITIES, "cross (worst vs)", "result"]
    return _table(header, rows)


def summary_text(result: SuiteResult) -> str:
    """The terminal summary: worst errors per backend and dtype, reasons, verdict."""
    lines = [_plain_table(_SUMMARY_HEADER, _summary_rows(result)), ""]
    unavailable = _unavailable_rows(result)
    if unavailable:
        lines.append("not measured:")
        lines += [f"  {b} [{q}] x{n}: {r}" for b, q, n, r in unavailable]
        lines.append("")
    for cell in result.cells:
        if cell.status in ("fail", "error"):
            what = _fmt(cell.error) if cell.status == "fail" else cell.reason[:200]
            lines.append(f"FAIL {_key_text(cell.case)} {cell.backend} {cell.quantity}: {what}")
    for x in result.cross:
        if x.status == "fail":
            lines.append(f"FAIL {_key_text(x.case)} {x.first} vs {x.second} {x.quantity}: {_fmt(x.error)}")
    for b in result.bitwise:
        if b.status != "pass":
            lines.append(f"FAIL {_key_text(b.case)} {b.first} vs {b.second} forward bitwise: out {_fmt(b.out)}, "
                         f"LSE {_fmt(b.lse)} {b.reason[:200]}".rstrip())
    if result.bitwise:
        good = sum(b.status == "pass" for b in result.bitwise)
        lines.append(f"bitwise forward (out, LSE) of {', '.join(f'{a} vs {b}' for a, b in BITWISE_PAIRS)}: "
                     f"{good}/{len(result.bitwise)} cases equal bit for bit")
    lines.append(_verdict(result))
    return "\n".join(lines)


def write_report(result: SuiteResult, out_dir: str, command: str = "") -> tuple[str, str]:
    """Write ``parity.md`` and ``parity.json`` into ``out_dir``; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    md_path = os.path.join(out_dir, "parity.md")
    json_path = os.path.join(out_dir, "parity.json")
    data = result.to_json()
    data["command"] = command
    for path, text in ((json_path, json.dumps(data, indent=1, default=str)),
                       (md_path, markdown(result, command))):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return md_path, json_path
