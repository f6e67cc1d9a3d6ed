"""GPU correctness check of the FlexAttention backend (run on the H200 host).

    python3 scripts/gpu/check_flex.py --out $OUT [--budget-s 170] [--only TEXT ...] [--seed N]

``--only`` runs the checks whose names contain any of the given texts (e.g.
``--only long adversarial``).

Checks, in this order (each in its own try/except; a check that would start
after the time budget is recorded as skipped):

1. ``padded/qsa/(24,2)``: bf16 out, dq, dk, dv of ``flex_sparse_gqa_attention``
   against the torch reference run in fp32 on the same bf16 inputs, S=8192,
   D=256, QSA routes (top_k 512) with planted duplicates, empty rows (all -1,
   all huge int64, one whole empty 128-row tile) and right-padding rows.
2. ``padded/adversarial/(24,2)``: the same shape with adversarial routes.
3. The remaining layouts: packed and CP (rank 1 of 2, S_q=4096 of S_kv=8192)
   for (24,2), then padded, packed and CP for (12,1).
4. ``long-49152``: B=1, S_q=S_kv=49152 (table past 2**31 entries), (12,1),
   forward only; the last 256 query rows, the rows whose table offsets cross
   2**31, and the first 256 rows against the reference on just those rows.
   It runs in a child process started first and working alongside the others,
   so that a CUDA fault there (what an int32 offset wrap would cause) cannot
   take the other checks down; it is given until the budget plus 5 s.

Timing is not measured here (the shared benchmark does it); ``wall_s`` is only
each check's wall time, compilation included. Writes ``check_flex.json`` and
``check_flex.md`` under --out and prints a summary table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import torch  # noqa: E402
from gpu_common import relative_error as rel  # noqa: E402  (puts the repository root on sys.path)

# The environment overrides exist only for a dry run of the plumbing on CPU.
DEVICE = os.environ.get("QSA_CHECK_DEVICE", "cuda")
TOL = 1e-2  # the contract's bf16 tolerance on ||x - ref|| / ||ref||
D = int(os.environ.get("QSA_CHECK_HEAD_DIM", 256))
SEQ = 8192
LONG = int(os.environ.get("QSA_CHECK_LONG", 49152))
START = time.time()


def log(*args):
    print(f"[{time.time() - START:6.1f}s]", *args, flush=True)


def plant(routes, gen, kv_length):
    """QSA routes plus duplicates and empty rows; returns (routes, info)."""
    from qsa_torch.routes import normalize_routes

    bsz, rows, width = routes.shape
    valid = routes >= 0
    cand = routes.gather(-1, torch.randint(0, width, routes.shape, generator=gen))
    draw = torch.rand(routes.shape, generator=gen)
    dup = (cand >= 0) & ((~valid & (draw < 0.5)) | (draw < 0.01))
    routes = torch.where(dup, cand, routes)
    routes[torch.rand(bsz, rows, generator=gen) < 0.02] = -1
    routes[torch.rand(bsz, rows, generator=gen) < 0.01] = 2**40
    if rows >= 1152:
        routes[0, 1024:1152] = -1  # a whole empty 128-row query tile
    in_range = (routes >= 0) & (routes < kv_length)
    unique = normalize_routes(routes, kv_length) >= 0
    info = {
        "duplicate_ids": int(in_range.sum() - unique.sum()),
        "empty_rows": int((~in_range.any(-1)).sum()),
        "rows": bsz * rows,
        "mean_routes_per_row": float(unique.sum() / (bsz * rows)),
    }
    return routes, info


def make_routes(layout, family, seed, gen):
    """Routes of one layout at S=8192 (CP: rank 1 of 2) as an int64 CPU tensor."""
    from qsa_torch.routes import generate_problem

    kw = {"top_k": 512}
    if layout == "cp":
        kw.update(world_size=2, rank=1)
    routes, problem = generate_problem(layout, family, seed=seed, seq_len=SEQ, **kw)
    info = {"layout": layout, "family": family, "shape": list(routes.shape),
            "kv_length": problem.kv_length}
    if family == "qsa":
        routes, planted = plant(routes, gen, problem.kv_length)
        info.update(planted)
    else:
        in_range = (routes >= 0) & (routes < problem.kv_length)
        info["empty_rows"] = int((~in_range.any(-1)).sum())
    return routes, problem.kv_length, info


def inputs(bsz, s_q, s_kv, heads, gen):
    hq, hkv = heads
    dev, bf = DEVICE, torch.bfloat16
    q = torch.randn(bsz, s_q, hq, D, device=dev, dtype=bf, generator=gen)
    k = torch.randn(bsz, s_kv, hkv, D, device=dev, dtype=bf, generator=gen)
    v = torch.randn(bsz, s_kv, hkv, D, device=dev, dtype=bf, generator=gen)
    do = torch.randn(bsz, s_q, hq, D, device=dev, dtype=bf, generator=gen)
    return q, k, v, do


def zero_stats(t, rows):
    """Max |x| and NaN count of ``t`` on the boolean [B, S] ``rows``."""
    sel = t.detach()[rows]
    return {"max_abs": float(sel.float().abs().nan_to_num(float("inf")).max()) if sel.numel() else 0.0,
            "nan": int(torch.isnan(sel).sum()), "exact_zero": bool((sel == 0).all())}


def check_layout(routes_cpu, kv_length, heads, gen):
    """flex vs fp32 reference: out, dq, dk, dv; exact zeros on empty rows."""
    from qsa_torch.flex_qsa import flex_sparse_gqa_attention
    from qsa_torch.reference import reference_sparse_gqa_attention

    routes = routes_cpu.to(DEVICE)
    bsz, s_q, _ = routes.shape
    q, k, v, do = inputs(bsz, s_q, kv_length, heads, gen)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flex_sparse_gqa_attention(*leaves, routes)
    out.backward(do)
    got = [out.detach(), *(t.grad for t in leaves)]
    ref_leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    ref = reference_sparse_gqa_attention(*ref_leaves, routes)
    ref.backward(do.float())
    want = [ref.detach(), *(t.grad for t in ref_leaves)]
    errors = {n: rel(g, w) for n, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    empty = ~((routes >= 0) & (routes < kv_length)).any(-1)
    zeros = {"out": zero_stats(got[0], empty), "dq": zero_stats(got[1], empty)}
    ok = all(e < TOL for e in errors.values()) and all(z["exact_zero"] for z in zeros.values())
    return {"errors": errors, "empty_row_zeros": zeros, "pass": bool(ok)}


def check_long(seed, gen):
    """B=1, S=49152, (12,1): rows past the int32 table offset vs the reference."""
    from qsa_torch.flex_qsa import flex_sparse_gqa_attention
    from qsa_torch.reference import reference_sparse_gqa_attention
    from qsa_torch.routes import generate_problem

    routes, _ = generate_problem("padded", "qsa", seed=seed, seq_len=LONG, batch=1, top_k=512)
    routes = routes.to(DEVICE)
    q, k, v, _ = inputs(1, LONG, LONG, (12, 1), gen)
    with torch.no_grad():
        out = flex_sparse_gqa_attention(q, k, v, routes)
        cross = min(2**31 // LONG, LONG - 64)  # first row whose offsets pass 2**31
        windows = {"last_256_rows": (LONG - 256, LONG),
                   "rows_crossing_2**31": (cross - 64, cross + 64),
                   "first_256_rows": (0, 256)}
        errors = {}
        for name, (lo, hi) in windows.items():
            ref = reference_sparse_gqa_attention(
                q[:, lo:hi].float(), k.float(), v.float(), routes[:, lo:hi])
            errors[name] = rel(out[:, lo:hi], ref)
    return {"errors": errors, "table_entries": LONG * LONG,
            "max_flat_offset": LONG * LONG - 1, "int32_max": 2**31 - 1,
            "pass": all(e < TOL for e in errors.values())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="start no new check after this many seconds (minus its margin)")
    parser.add_argument("--only", nargs="*", default=[],
                        help="run only checks whose names contain one of these texts")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--long-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.long_child:
        gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
        result = check_long(args.seed, gen)
        with open(args.long_child, "w") as f:
            json.dump(result, f)
        return 0

    # one compilation per distinct shape; this run sees about eight
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") % 2**31
    report = {"seed": seed, "checks": []}
    try:
        import triton

        triton_version = triton.__version__
    except Exception as err:  # noqa: BLE001
        triton_version = f"unavailable: {err}"
    report["env"] = {
        "torch": torch.__version__, "triton": triton_version,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
    }
    log("env", report["env"], "seed", seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    gpu_gen = torch.Generator(device=DEVICE).manual_seed(seed)
    only = list(args.only)
    child = None
    if not only or any(text in "long-49152" for text in only):
        child_json = os.path.join(args.out, "long_child.json")
        child_log = open(os.path.join(args.out, "long_child.log"), "w")
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--out", args.out, "--seed", str(seed),
             "--long-child", child_json], stdout=child_log, stderr=subprocess.STDOUT)
        child_start = time.time()
        log("started long-49152 in child process", child.pid)
    routes_cache = {}

    def routes_for(layout, family):
        if (layout, family) not in routes_cache:
            routes_cache[(layout, family)] = make_routes(layout, family, seed, cpu_gen)
        return routes_cache[(layout, family)]

    def layout_check(layout, family, heads):
        def run():
            routes, kv_length, info = routes_for(layout, family)
            return {"problem": info, **check_layout(routes, kv_length, heads, gpu_gen)}
        return run

    # (name, function, seconds of budget it needs to be started)
    plan = [("padded/qsa/(24,2)", layout_check("padded", "qsa", (24, 2)), 40),
            ("padded/adversarial/(24,2)", layout_check("padded", "adversarial", (24, 2)), 15)]
    for heads in ((24, 2), (12, 1)):
        for layout in ("packed", "cp") if heads == (24, 2) else ("padded", "packed", "cp"):
            plan.append((f"{layout}/qsa/({heads[0]},{heads[1]})",
                         layout_check(layout, "qsa", heads), 40))

    for name, fn, margin in plan:
        if only and not any(text in name for text in only):
            continue
        entry = {"name": name}
        elapsed = time.time() - START
        if elapsed > args.budget_s - margin:
            entry.update(status="skipped", reason=f"time budget ({elapsed:.0f}s elapsed)")
            log("skip", name)
            report["checks"].append(entry)
            continue
        log("start", name)
        t0 = time.time()
        try:
            result = fn()
            entry.update(result)
            entry["status"] = "pass" if result.get("pass") else "FAIL"
        except Exception as err:  # noqa: BLE001
            entry.update(status="error", error=f"{type(err).__name__}: {err}",
                         traceback=traceback.format_exc())
        try:
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001
            entry.setdefault("error", f"after the check: {type(err).__name__}: {err}")
            entry["status"] = "error"
        entry["wall_s"] = round(time.time() - t0, 1)
        log("done", name, entry["status"], entry.get("errors", entry.get("error", "")))
        report["checks"].append(entry)
        if DEVICE == "cuda":
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    if child is not None:
        report["checks"].append(wait_long_child(child, child_json, child_start, args.budget_s))
        child_log.close()

    with open(os.path.join(args.out, "check_flex.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    table = markdown(report)
    with open(os.path.join(args.out, "check_flex.md"), "w") as f:
        f.write(table)
    print()
    print(table, flush=True)
    return 0 if all(c["status"] in ("pass", "info", "skipped") for c in report["checks"]) else 1


def wait_long_child(child, path, started, budget_s):
    """The long check's entry, from its child process (killed past budget + 5 s)."""
    entry = {"name": "long-49152"}
    try:
        child.wait(timeout=max(1.0, budget_s + 5 - (time.time() - START)))
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        entry.update(status="skipped", reason="time budget: the child process was stopped")
    if "status" not in entry:
        if child.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                entry.update(json.load(f))
            entry["status"] = "pass" if entry.get("pass") else "FAIL"
        else:
            log_path = os.path.join(os.path.dirname(path), "long_child.log")
            tail = open(log_path).read()[-2000:] if os.path.exists(log_path) else ""
            entry.update(status="error", error=f"child exit code {child.returncode}: {tail[-300:]}",
                         traceback=tail)
    entry["wall_s"] = round(time.time() - started, 1)
    log("done long-49152", entry["status"], entry.get("errors", entry.get("error", "")))
    return entry


def fmt(x):
    return f"{x:.2e}" if isinstance(x, float) else str(x)


def markdown(report) -> str:
    env = report["env"]
    lines = [f"FlexAttention QSA check: torch {env['torch']}, triton {env['triton']}, "
             f"{env['device']}, seed {report['seed']}; bf16, D={D}, tolerance {TOL:g} "
             "(relative L2 vs the fp32 torch reference on the same bf16 inputs)", "",
             "| check | status | out | dq | dk | dv | empty rows: out, dq exact 0 | notes | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in report["checks"]:
        errs = c.get("errors", {})
        cols = [fmt(errs[n]) if n in errs else "" for n in ("out", "dq", "dk", "dv")]
        zeros = c.get("empty_row_zeros")
        zero_col = (f"{zeros['out']['exact_zero']}, {zeros['dq']['exact_zero']}" if zeros else "")
        notes = ""
        if "problem" in c:
            p = c["problem"]
            notes = (f"{p['shape']} S_kv={p['kv_length']}, empty rows {p.get('empty_rows')}, "
                     f"duplicates {p.get('duplicate_ids', '-')}")
        elif c["name"] == "raw-empty-rows" and "raw_out_on_empty_rows" in c:
            o, g = c["raw_out_on_empty_rows"], c["raw_dq_on_empty_rows"]
            notes = (f"flex alone on empty rows: out max abs {fmt(o['max_abs'])}, NaN {o['nan']}, "
                     f"exact 0 {o['exact_zero']}; dq max abs {fmt(g['max_abs'])}, NaN {g['nan']}, "
                     f"exact 0 {g['exact_zero']}; vs fixed: other rows' out "
                     f"{fmt(c['raw_vs_fixed_out_on_other_rows'])}, dk {fmt(c['raw_vs_fixed_dk'])}, "
                     f"dv {fmt(c['raw_vs_fixed_dv'])}")
        elif c["name"] == "long-49152" and errs:
            notes = "; ".join(f"{k} {fmt(v)}" for k, v in errs.items())
            cols = [fmt(max(errs.values())), "", "", ""]
        elif c["status"] in ("error", "skipped"):
            notes = c.get("error", c.get("reason", ""))[:160].replace("|", "/")
        lines.append(f"| {c['name']} | {c['status']} | " + " | ".join(cols)
                     + f" | {zero_col} | {notes} | {c.get('wall_s', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
