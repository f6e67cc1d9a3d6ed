#!/usr/bin/env python3
"""The FA4 QSA backend (``qsa_torch.fa4_qsa``) on the H200: correctness and a forward timing breakdown.

Run from the repository root, after ``source /tmp/qsa-site/env.sh`` (flash-attn-4, CuTe DSL):

    python3 scripts/gpu/check_fa4.py --out $OUT

1. Warm-up on a small problem: FA4 forward/backward JIT and the torch.compile of the
   preprocessing (timed: that is the first-call cost).
2. Correctness at S = 8192, D = 256, bf16, (24,2) and (12,1): out/dq/dk/dv against the
   gather-based torch reference run in fp32 on the same bf16 values, ||x-ref||/||ref|| < 1e-2;
   exact zeros for rows without routes (out, dq) and for keys no row routes to (dk, dv).
   Layouts: padded (B=2), packed, CP (S_q = 4096 local rows of S_kv = 8192), QSA routes
   (top_k = 512, K = 2052); adversarial routes (empty rows, duplicates, huge int64 IDs);
   duplicated route slots; strided q/k/v with non-contiguous int32 routes.
3. Timing at S = 8192, (24,2), packed QSA routes: the public forward and forward+backward,
   dense causal SDPA for scale.
4. (if time allows) S = 49152, (12,1), forward: the membership table passes 2**31 bytes,
   so the backend splits the call; the first, middle and last rows are checked.

Every step is wrapped so a failure is recorded and the rest runs. Writes fa4_check.json and
fa4_check.md under --out and prints a summary last. Budget: about 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from gpu_common import cuda_ms  # noqa: E402  (puts the repository root on sys.path)
from gpu_common import relative_error as rel

SEQ = 8192
LONG = 49152  # B * S_q_pad * S_kv_pad > 2**31: the backend splits the call
TOP_K = 512
HEAD_DIM = 256
SCALE = 1.0 / 16
TOL = 1e-2
HEADS = ((24, 2), (12, 1))
DEVICE = "cuda"

# name -> (layout, family, seed, seq_len, make_problem kwargs); built in worker processes
PROBLEMS = {
    "padded/qsa": ("padded", "qsa", 11, SEQ, {"top_k": TOP_K, "batch": 2}),
    "packed/qsa": ("packed", "qsa", 12, SEQ, {"top_k": TOP_K}),
    "cp/qsa": ("cp", "qsa", 13, SEQ, {"top_k": TOP_K, "world_size": 2, "rank": 1}),
    "packed/adversarial": ("packed", "adversarial", 14, SEQ, {"width": 4 * TOP_K + 4}),
    "long packed/qsa": ("packed", "qsa", 15, LONG, {"top_k": 64}),
}

# (case name, problem, heads, options)
CASES = [
    *((f"{p} {h[0]}:{h[1]}", p, h, {}) for p in ("padded/qsa", "packed/qsa", "cp/qsa") for h in HEADS),
    *((f"packed/adversarial {h[0]}:{h[1]}", "packed/adversarial", h, {}) for h in HEADS),
    ("packed/qsa duplicated slots 12:1", "packed/qsa", (12, 1), {"duplicate": True}),
    ("cp/qsa strided, int32 routes 24:2", "cp/qsa", (24, 2), {"strided": True, "int32": True}),
]


def build_problem(name: str):
    """Routes [B, S_q, K] int64 and S_kv of one problem (runs in a worker process)."""
    from qsa_common.layouts import make_problem

    layout, family, seed, seq_len, kwargs = PROBLEMS[name]
    problem = make_problem(layout, family, seed=seed, seq_len=seq_len, **kwargs)
    return problem.routes, problem.kv_length


# ------------------------------------------------------------------ helpers
def first(result):
    """FA4's output tensor, whether ``flash_attn_func`` returned ``out`` or ``(out, lse)``."""
    return result[0] if isinstance(result, (tuple, list)) else result


def bench(fn) -> dict:
    return {"median_ms": round(cuda_ms(fn), 4)}


def poison() -> None:
    """Leave NaN in the caching allocator's free blocks: unwritten kernel outputs show up."""
    import torch

    junk = torch.full((1 << 28,), float("nan"), device=DEVICE)
    del junk


def inputs(routes, kv_length, heads, seed):
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    b, s_q, _ = routes.shape
    hq, hkv = heads
    opts = dict(device=DEVICE, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(b, s_q, hq, HEAD_DIM, **opts)
    k = torch.randn(b, kv_length, hkv, HEAD_DIM, **opts)
    v = torch.randn(b, kv_length, hkv, HEAD_DIM, **opts)
    do = torch.randn(b, s_q, hq, HEAD_DIM, **opts)
    return q, k, v, do


# ------------------------------------------------------------------- steps
def warmup() -> dict:
    """First calls on a small problem: FA4 JIT (forward, backward) and torch.compile."""
    import torch

    from qsa_common.layouts import make_problem
    from qsa_torch.fa4_qsa import fa4_sparse_gqa_attention

    problem = make_problem("packed", "qsa", seed=5, seq_len=512, top_k=16)
    routes = torch.from_numpy(problem.routes).to(DEVICE)
    q, k, v, do = inputs(routes, problem.kv_length, (12, 1), 5)
    q.requires_grad_(True)
    t0 = time.perf_counter()
    out = fa4_sparse_gqa_attention(q, k, v, routes, SCALE)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out.backward(do)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"first_forward_s": round(t1 - t0, 2), "first_backward_s": round(t2 - t1, 2)}


def check_case(routes_np, kv_length, heads, *, duplicate=False, strided=False, int32=False, seed=0) -> dict:
    import torch

    from qsa_torch import fa4_qsa
    from qsa_torch.reference import reference_sparse_gqa_attention
    from qsa_torch.routes import membership_table

    routes = torch.from_numpy(routes_np).to(DEVICE)
    if duplicate:  # every ID of the first half of the slots once more, reversed
        routes = torch.cat([routes, routes[..., : routes.shape[-1] // 2].flip(-1)], dim=-1)
    if int32:
        info = torch.iinfo(torch.int32)
        routes = torch.where((routes < info.min) | (routes > info.max), -1, routes).to(torch.int32)
    q, k, v, do = inputs(routes, kv_length, heads, seed)
    if strided:  # [B,S,H,D] views of [B,H,S,D] storage, K with last stride 2, routes [B,K,S]^T
        wide = torch.zeros(*k.shape[:-1], 2 * HEAD_DIM, device=DEVICE, dtype=k.dtype)
        wide[..., ::2] = k
        bases = [q.transpose(1, 2).contiguous(), wide, v.transpose(1, 2).contiguous()]
        for t in bases:
            t.requires_grad_(True)
        args = (bases[0].transpose(1, 2), bases[1][..., ::2], bases[2].transpose(1, 2))
        routes_arg = routes.transpose(1, 2).contiguous().transpose(1, 2)
        assert not any(t.is_contiguous() for t in (*args, routes_arg))
    else:
        args = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
        routes_arg = routes
    poison()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fa4_qsa.fa4_sparse_gqa_attention(*args, routes_arg, SCALE)
    grads = torch.autograd.grad(out, args, do)
    torch.cuda.synchronize()
    fa4_s = time.perf_counter() - t0
    ref_args = tuple(t.float().requires_grad_(True) for t in (q, k, v))
    ref = reference_sparse_gqa_attention(*ref_args, routes, SCALE)
    ref_grads = torch.autograd.grad(ref, ref_args, do.float())
    errors = {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    member = membership_table(routes, kv_length)
    empty, unrouted = ~member.any(-1), ~member.any(1)
    dq, dk, dv = grads
    exact = {
        "out_empty_rows_zero": bool((out[empty] == 0).all()),
        "dq_empty_rows_zero": bool((dq[empty] == 0).all()),
        "dkdv_unrouted_keys_zero": bool((dk[unrouted] == 0).all() and (dv[unrouted] == 0).all()),
        "bf16_out": out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(q.shape),
    }
    return {
        "heads": list(heads),
        "shape": {"B": routes.shape[0], "S_q": routes.shape[1], "S_kv": kv_length, "K": routes.shape[2]},
        "empty_rows": int(empty.sum()),
        "unrouted_keys": int(unrouted.sum()),
        "valid_routes": int(member.sum()),
        "rel_err": {n: float(f"{e:.3e}") for n, e in errors.items()},
        "exact": exact,
        "fa4_fwd_bwd_s": round(fa4_s, 3),
        "pass": all(e < TOL for e in errors.values()) and all(exact.values()),
    }


def long_check(routes_np, kv_length) -> dict:
    """Forward at S = 49152, (12,1): a table past 2**31 bytes, so several FA4 calls.

    Checks the first, middle and last rows against the reference (fp32) on just those rows.
    """
    import torch

    from qsa_torch import fa4_qsa
    from qsa_torch.reference import reference_sparse_gqa_attention

    routes = torch.from_numpy(routes_np).to(DEVICE)
    s_q = routes.shape[1]
    q, k, v, _ = inputs(routes, kv_length, (12, 1), 7)
    poison()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fa4_qsa.fa4_sparse_gqa_attention(q, k, v, routes, SCALE)
    torch.cuda.synchronize()
    fwd_s = time.perf_counter() - t0
    picks = {"first 256": slice(0, 256), "middle 256": slice(s_q // 2 - 128, s_q // 2 + 128),
             "last 256": slice(s_q - 256, s_q)}
    errors = {}
    kf, vf = k.float(), v.float()
    for name, rows in picks.items():
        ref = reference_sparse_gqa_attention(q[:, rows].float(), kf, vf, routes[:, rows], SCALE)
        errors[name] = rel(out[:, rows], ref)
    return {
        "S": s_q, "K": routes.shape[-1], "first_call_fwd_s": round(fwd_s, 2),
        "rel_err_out": {n: float(f"{e:.3e}") for n, e in errors.items()},
        "pass": all(e < TOL for e in errors.values()),
    }


def timing(routes_np, kv_length, results: dict) -> None:
    """Fill results['timing'] (S = 8192, (24,2), packed QSA) through the public API."""
    import torch
    import torch.nn.functional as F

    from qsa_torch import fa4_qsa
    from qsa_torch.routes import membership_table

    routes = torch.from_numpy(routes_np).to(DEVICE)
    heads = (24, 2)
    q, k, v, do = inputs(routes, kv_length, heads, 99)
    valid = int(membership_table(routes, kv_length).sum())
    flops_fwd = 4.0 * valid * heads[0] * HEAD_DIM
    timing = results["timing"]
    timing["problem"] = {"B": 1, "S": kv_length, "heads": list(heads), "K": routes.shape[-1],
                         "valid_routes": valid, "mean_routes_per_row": round(valid / routes.shape[1], 1)}

    def record(name, fn, factor=1.0):
        try:
            t = bench(fn)
            timing[name] = {**t, "useful_tflops": round(factor * flops_fwd / (t["median_ms"] * 1e-3) / 1e12, 1)}
        except Exception as exc:  # noqa: BLE001 - record and go on
            timing[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}

    with torch.no_grad():
        record("public_forward", lambda: fa4_qsa.fa4_sparse_gqa_attention(q, k, v, routes, SCALE))
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    record("public_forward_backward",
           lambda: torch.autograd.grad(fa4_qsa.fa4_sparse_gqa_attention(*leaves, routes, SCALE), leaves, do),
           factor=3.5)
    # dense causal SDPA with the KV heads expanded, for scale (no sparsity, all causal tiles)
    group = heads[0] // heads[1]
    qt = q.transpose(1, 2)
    kt, vt = (t.transpose(1, 2).repeat_interleave(group, 1) for t in (k, v))
    with torch.no_grad():
        record("sdpa_dense_causal_forward",
               lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=SCALE))


# ------------------------------------------------------------------ report
def markdown(results: dict) -> str:
    passed = sum(bool(c.get("pass")) for c in results["cases"].values())
    lines = [f"# FA4 QSA check ({results.get('device', '?')}, {json.dumps(results.get('versions'))})",
             "", f"cases passed: {passed}/{len(results['cases'])}", "",
             "| case | heads | S_q/S_kv | K | out | dq | dk | dv | empty rows | exact zeros | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, case in results["cases"].items():
        if "error" in case:
            lines.append(f"| {name} | | | | ERROR: {case['error'].splitlines()[-1][:120]} | | | | | | no |")
            continue
        e, s = case["rel_err"], case["shape"]
        lines.append(
            f"| {name} | {case['heads'][0]}:{case['heads'][1]} | {s['S_q']}/{s['S_kv']} | {s['K']} "
            f"| {e['out']:.2e} | {e['dq']:.2e} | {e['dk']:.2e} | {e['dv']:.2e} | {case['empty_rows']} "
            f"| {all(case['exact'].values())} | {'yes' if case['pass'] else 'NO'} |")
    lines += ["", "| timing (S=8192, 24:2, packed QSA) | median ms | useful TFLOP/s |", "|---|---|---|"]
    for name, t in results["timing"].items():
        if not isinstance(t, dict) or name == "problem":
            continue
        if "median_ms" in t:
            lines.append(f"| {name} | {t['median_ms']} | {t['useful_tflops']} |")
        else:
            lines.append(f"| {name} | {t.get('skipped') or t.get('error', '')[:120]} | |")
    for key in ("problem",):
        if key in results["timing"]:
            lines.append(f"\n{key}: {json.dumps(results['timing'][key])}")
    lines.append(f"\nlong (S={LONG}, forward, several FA4 calls): {json.dumps(results.get('long'))[:600]}")
    lines.append(f"\nwarm-up (compiles): {json.dumps(results.get('warmup'))}; "
                 f"total {results.get('elapsed_s')} s")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for fa4_check.json / fa4_check.md")
    parser.add_argument("--budget-s", type=float, default=225.0,
                        help="skip the long check past this many seconds")
    parser.add_argument("--timing-only", action="store_true", help="only steps 1 and 3 (warm-up and timing)")
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"cases": {}, "timing": {}, "errors": {}}

    # route generation is numpy-bound: overlap it with the JIT warm-up
    pool = ProcessPoolExecutor(max_workers=len(PROBLEMS), mp_context=multiprocessing.get_context("spawn"))
    wanted = ["packed/qsa"] if args.timing_only else list(PROBLEMS)
    futures = {name: pool.submit(build_problem, name) for name in wanted}

    def step(label, fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except Exception:  # noqa: BLE001 - record, keep going
            results["errors"][label] = traceback.format_exc()[-4000:]
            return None

    import torch

    results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    results["versions"] = {"torch": torch.__version__}
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            from importlib.metadata import version

            results["versions"][dist] = version(dist)
        except Exception:  # noqa: BLE001
            results["versions"][dist] = None
    results["warmup"] = step("warmup", warmup)

    problems = {}
    for name, fut in futures.items():
        got = step(f"build {name}", fut.result)
        if got is not None:
            problems[name] = got
    pool.shutdown()
    results["route_generation_done_s"] = round(time.perf_counter() - start, 1)

    for i, (name, problem, heads, options) in enumerate(() if args.timing_only else CASES):
        if problem not in problems:
            results["cases"][name] = {"error": f"problem {problem} was not built"}
            continue
        try:
            results["cases"][name] = check_case(*problems[problem], heads, seed=100 + i, **options)
        except Exception:  # noqa: BLE001
            results["cases"][name] = {"error": traceback.format_exc()[-4000:]}
        torch.cuda.empty_cache()

    if "packed/qsa" in problems:
        step("timing", timing, *problems["packed/qsa"], results)
    if args.timing_only:
        results["long"] = {"skipped": "--timing-only"}
    elif "long packed/qsa" not in problems:
        results["long"] = {"error": "problem not built"}
    elif time.perf_counter() > deadline - 60:
        results["long"] = {"skipped": "time budget"}
    else:
        try:
            results["long"] = long_check(*problems["long packed/qsa"])
        except Exception:  # noqa: BLE001
            results["long"] = {"error": traceback.format_exc()[-4000:]}
        torch.cuda.empty_cache()
    results["elapsed_s"] = round(time.perf_counter() - start, 1)

    (out_dir / "fa4_check.json").write_text(json.dumps(results, indent=2, default=str))
    report = markdown(results)
    (out_dir / "fa4_check.md").write_text(report)
    for label, tb in results["errors"].items():
        print(f"--- error in {label}:\n{tb}")
    print(report)


if __name__ == "__main__":
    main()
