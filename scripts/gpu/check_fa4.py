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
   duplicated route slots; strided q/k/v with non-contiguous int32 routes; the split into
   several FA4 calls (table limit lowered).
3. Timing at S = 8192, (24,2), packed QSA routes: preprocessing alone, the FA4 call alone,
   the public forward and forward+backward, dense causal SDPA for scale; forward variants:
   every tile through the mask callback, no callback at all (all listed tiles full: the
   floor), a bit-packed table, pack_gqa off, FA4 dense causal.
4. (before the variants, if time allows) S = 49152, (12,1), forward: the membership table
   passes 2**31 bytes, so the backend splits the call; rows around the split are checked.

Every step is wrapped so a failure is recorded and the rest runs. Writes fa4_check.json and
fa4_check.md under --out and prints a summary last. Budget: about 4 minutes (variants that
need a new FA4 compile are skipped when the --budget-s is nearly spent).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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
    ("packed/qsa 4 FA4 calls 12:1", "packed/qsa", (12, 1), {"table_limit": 2048 * SEQ}),
]

# CuTe modules for the bit-packed variant's callback (bound in main once FA4 loads)
cutlass = None
fa_utils = None


def build_problem(name: str):
    """Routes [B, S_q, K] int64 and S_kv of one problem (runs in a worker process)."""
    from qsa_common.layouts import make_problem

    layout, family, seed, seq_len, kwargs = PROBLEMS[name]
    problem = make_problem(layout, family, seed=seed, seq_len=seq_len, **kwargs)
    return problem.routes, problem.kv_length


def bit_mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Variant callback: membership bit (kv % 32) of uint32 word kv // 32 of the row."""
    words = aux_tensors[0]
    word = words[batch[0], q_idx[0], kv_idx[0] // cutlass.Int32(32)]
    bit = fa_utils.shr_u32(word, cutlass.Uint32(kv_idx[0] % cutlass.Int32(32))) & cutlass.Uint32(1)
    return fa_utils.scalar_to_ssa(bit.to(cutlass.Int32), cutlass.Int32) != fa_utils.scalar_to_ssa(
        cutlass.Int32(0), cutlass.Int32
    )


# ------------------------------------------------------------------ helpers
def first(result):
    """FA4's output tensor, whether ``flash_attn_func`` returned ``out`` or ``(out, lse)``."""
    return result[0] if isinstance(result, (tuple, list)) else result


def rel(actual, expected) -> float:
    """||a - e|| / ||e|| in float64; inf when ``actual`` is not finite."""
    a, e = actual.detach().double(), expected.detach().double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def bench(fn, warmup: int = 2, iters: int = 10) -> dict:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4)}


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


def check_case(routes_np, kv_length, heads, *, duplicate=False, strided=False, int32=False,
               table_limit=None, seed=0) -> dict:
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
    saved_limit = fa4_qsa._TABLE_LIMIT
    if table_limit is not None:
        fa4_qsa._TABLE_LIMIT = table_limit
    try:
        poison()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fa4_qsa.fa4_sparse_gqa_attention(*args, routes_arg, SCALE)
        grads = torch.autograd.grad(out, args, do)
        torch.cuda.synchronize()
        fa4_s = time.perf_counter() - t0
    finally:
        fa4_qsa._TABLE_LIMIT = saved_limit
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

    Checks the first rows, the rows around the first split and the last rows
    against the reference (fp32) on just those rows.
    """
    import torch

    from qsa_torch import fa4_qsa
    from qsa_torch.reference import reference_sparse_gqa_attention

    routes = torch.from_numpy(routes_np).to(DEVICE)
    s_q = routes.shape[1]
    q, k, v, _ = inputs(routes, kv_length, (12, 1), 7)
    calls = fa4_qsa._chunks(1, s_q, kv_length)
    poison()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fa4_qsa.fa4_sparse_gqa_attention(q, k, v, routes, SCALE)
    torch.cuda.synchronize()
    fwd_s = time.perf_counter() - t0
    split = calls[1][1].start if len(calls) > 1 else s_q // 2
    picks = {"first 256": slice(0, 256), "around split": slice(split - 128, split + 128),
             "last 256": slice(s_q - 256, s_q)}
    errors = {}
    kf, vf = k.float(), v.float()
    for name, rows in picks.items():
        ref = reference_sparse_gqa_attention(q[:, rows].float(), kf, vf, routes[:, rows], SCALE)
        errors[name] = rel(out[:, rows], ref)
    return {
        "S": s_q, "K": routes.shape[-1], "fa4_calls": len(calls), "split_row": split,
        "first_call_fwd_s": round(fwd_s, 2),
        "rel_err_out": {n: float(f"{e:.3e}") for n, e in errors.items()},
        "pass": len(calls) > 1 and all(e < TOL for e in errors.values()),
    }


def timing_breakdown(routes_np, kv_length, results: dict) -> dict:
    """Fill results['timing'] (S = 8192, (24,2), packed QSA); return the state for the variants."""
    import torch
    import torch.nn.functional as F

    from qsa_torch import fa4_qsa

    fa4 = fa4_qsa._load_fa4()
    flash_attn_func = fa4[0]
    preprocess = fa4_qsa._compiled_preprocess()
    routes = torch.from_numpy(routes_np).to(DEVICE)
    heads = (24, 2)
    q, k, v, do = inputs(routes, kv_length, heads, 99)
    plan = preprocess(routes, kv_length)
    table = plan[0]
    kwargs = fa4_qsa._fa4_kwargs(plan, fa4)
    valid = int(table.sum())
    flops_fwd = 4.0 * valid * heads[0] * HEAD_DIM
    rows, cols = table.shape[1] // fa4_qsa.QUERY_BLOCK, table.shape[2] // fa4_qsa.KEY_BLOCK
    partial, full = int(plan[2].sum()), int(plan[4].sum())
    timing = results["timing"]
    timing["problem"] = {"B": 1, "S": kv_length, "heads": list(heads), "K": routes.shape[-1],
                         "valid_routes": valid, "mean_routes_per_row": round(valid / routes.shape[1], 1)}
    timing["tiles_128x64"] = {"total": rows * cols, "partial": partial, "full": full,
                              "absent": rows * cols - partial - full}

    def tflops(ms, factor=1.0):
        return round(factor * flops_fwd / (ms * 1e-3) / 1e12, 1)

    def record(name, fn, factor=1.0, **extra):
        try:
            t = bench(fn)
            timing[name] = {**t, "useful_tflops": tflops(t["median_ms"], factor), **extra}
        except Exception as exc:  # noqa: BLE001 - record and go on
            timing[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}

    def fa4_forward(**over):
        args = {**kwargs, **over}
        with torch.no_grad():
            return first(flash_attn_func(q, k, v, softmax_scale=SCALE, **args))

    record("preprocess", lambda: preprocess(routes, kv_length))
    record("fa4_forward_only", fa4_forward)
    with torch.no_grad():
        record("public_forward", lambda: fa4_qsa.fa4_sparse_gqa_attention(q, k, v, routes, SCALE))
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    record("public_forward_backward",
           lambda: torch.autograd.grad(fa4_qsa.fa4_sparse_gqa_attention(*leaves, routes, SCALE), leaves, do),
           factor=3.5)
    record("fa4_forward_backward_only",
           lambda: torch.autograd.grad(
               first(flash_attn_func(*leaves, softmax_scale=SCALE, **kwargs)), leaves, do),
           factor=3.5)
    # dense causal SDPA with the KV heads expanded, for scale (no sparsity, all causal tiles)
    group = heads[0] // heads[1]
    qt = q.transpose(1, 2)
    kt, vt = (t.transpose(1, 2).repeat_interleave(group, 1) for t in (k, v))
    with torch.no_grad():
        record("sdpa_dense_causal_forward",
               lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=SCALE))
    return {"fa4": fa4, "table": table, "fa4_forward": fa4_forward, "tflops": tflops}


def timing_variants(state: dict, results: dict, deadline: float) -> None:
    """Forward variants of the FA4 call alone, on the inputs of :func:`timing_breakdown`."""
    import torch

    from qsa_torch import fa4_qsa

    fa4, table, fa4_forward, tflops = (state[k] for k in ("fa4", "table", "fa4_forward", "tflops"))
    variants = results["variants"]
    baseline = fa4_forward()
    kinds = fa4_qsa._block_kinds(table, fa4_qsa.KEY_BLOCK)
    names = ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx")
    tiles = (fa4_qsa.QUERY_BLOCK, fa4_qsa.KEY_BLOCK)

    def lists(kind_map):
        return fa4[1](**dict(zip(names, fa4_qsa._compact_blocks(kind_map))), block_size=tiles)

    def variant(name, needs_compile, make, compare=True):
        if needs_compile and time.perf_counter() > deadline - 45:
            variants[name] = {"skipped": "time budget"}
            return
        try:
            t0 = time.perf_counter()
            over = make()
            out = fa4_forward(**over)
            torch.cuda.synchronize()
            entry = {"first_call_s": round(time.perf_counter() - t0, 2)}
            if compare:
                entry["rel_diff_vs_baseline"] = float(f"{rel(out, baseline):.3e}")
            t = bench(lambda: fa4_forward(**over))
            variants[name] = {**entry, **t, "useful_tflops": tflops(t["median_ms"])}
        except Exception as exc:  # noqa: BLE001
            variants[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}

    variant("callback_on_every_tile (full lists empty)", False,
            lambda: {"block_sparse_tensors": lists(kinds.clamp(max=1))})
    variant("no_callback_all_listed_tiles_full (floor, wrong numerics)", True,
            lambda: {"block_sparse_tensors": lists(kinds.clamp(max=1) * 2), "mask_mod": None,
                     "aux_tensors": None}, compare=False)

    def bitpacked():
        import cutlass as cutlass_module
        import cutlass.cute as cute
        from flash_attn.cute import utils

        global cutlass, fa_utils
        cutlass, fa_utils = cutlass_module, utils
        b, s_q, s_kv = table.shape
        shifts = torch.arange(32, device=DEVICE, dtype=torch.int64)
        words = (table.view(b, s_q, s_kv // 32, 32).to(torch.int64) << shifts).sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.uint32)
        words.__leading_dim__ = 2
        return {"mask_mod": cute.jit(bit_mask_mod), "aux_tensors": [words]}

    variant("bit-packed table (uint32 words)", True, bitpacked)
    variant("pack_gqa=False", True, lambda: {"pack_gqa": False})
    variant("fa4_dense_causal (no sparsity, no callback)", True,
            lambda: {"mask_mod": None, "aux_tensors": None, "block_sparse_tensors": None,
                     "block_sparse_tensors_bwd": None, "causal": True}, compare=False)


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
    lines += ["", "| timing (S=8192, 24:2, packed QSA) | median ms | min ms | useful TFLOP/s |",
              "|---|---|---|---|"]
    for section in ("timing", "variants"):
        for name, t in results[section].items():
            if not isinstance(t, dict) or name in ("problem", "tiles_128x64"):
                continue
            if "median_ms" in t:
                lines.append(f"| {name} | {t['median_ms']} | {t['min_ms']} | {t['useful_tflops']} |")
            else:
                lines.append(f"| {name} | {t.get('skipped') or t.get('error', '')[:120]} | | |")
    for key in ("problem", "tiles_128x64"):
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
                        help="skip compile-heavy timing variants past this many seconds")
    parser.add_argument("--timing-only", action="store_true",
                        help="only steps 1 and 3 (warm-up, timing breakdown and variants)")
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"cases": {}, "timing": {}, "variants": {}, "errors": {}}

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

    state = None
    if "packed/qsa" in problems:
        state = step("timing", timing_breakdown, *problems["packed/qsa"], results)
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
    if state is not None:
        step("variants", timing_variants, state, results, deadline)
    results["elapsed_s"] = round(time.perf_counter() - start, 1)

    (out_dir / "fa4_check.json").write_text(json.dumps(results, indent=2, default=str))
    report = markdown(results)
    (out_dir / "fa4_check.md").write_text(report)
    for label, tb in results["errors"].items():
        print(f"--- error in {label}:\n{tb}")
    print(report)


if __name__ == "__main__":
    main()
