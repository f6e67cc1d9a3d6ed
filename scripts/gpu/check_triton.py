"""GPU check of the token-gather Triton backend (qsa_torch.triton_qsa) on one H200.

    python3 scripts/gpu/check_triton.py --out $OUT        # ~3 minutes

1. Correctness: bf16 out/dq/dk/dv against the torch reference (computed in fp32
   from the same bf16 inputs) on padded (B=2), packed and context-parallel
   (4096 local rows vs 8192 K/V) layouts at S=8192, heads (24,2) and (12,1),
   D=256, QSA routes (top_k=512, int32) and adversarial routes (int64, with
   duplicates, huge IDs and empty rows, whose outputs and dq must be exact zeros).
2. A small autotune at S=8192 and S=32768, B=1, (24,2), QSA routes: per block
   configuration the time of preprocessing, forward kernel, backward kernel,
   forward (end to end) and forward+backward, medians of CUDA-event timings.
3. compute-sanitizer memcheck on a tiny run of both kernels (if on PATH), in a
   subprocess running this file with --sanitizer-probe.

Writes check_triton.json and check_triton.md under --out; prints a summary last.
Every sub-check is wrapped so that one failure does not lose the others.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from gpu_common import cuda_ms, relative_error  # noqa: E402  (puts the repository root on sys.path)

ROOT = Path(__file__).resolve().parents[2]

import numpy as np  # noqa: E402

from qsa_common.layouts import make_problem  # noqa: E402

BUDGET_S = 225.0  # stop starting new autotune configurations past this
START = time.time()
DEVICE = "cuda"  # "cpu" (with Triton's interpreter) only for --smoke

CORRECTNESS_PROBLEMS = {
    ("padded", "qsa"): dict(layout="padded", route_family="qsa", seed=11, seq_len=8192, top_k=512, batch=2),
    ("packed", "qsa"): dict(layout="packed", route_family="qsa", seed=12, seq_len=8192, top_k=512),
    ("cp", "qsa"): dict(layout="cp", route_family="qsa", seed=13, seq_len=8192, top_k=512, world_size=2, rank=1),
    ("padded", "adversarial"): dict(layout="padded", route_family="adversarial", seed=14, seq_len=8192,
                                    top_k=512, batch=2),
    ("packed", "adversarial"): dict(layout="packed", route_family="adversarial", seed=15, seq_len=8192,
                                    top_k=512),
    ("cp", "adversarial"): dict(layout="cp", route_family="adversarial", seed=16, seq_len=8192, top_k=512,
                                world_size=2, rank=1),
}
BENCH_PROBLEMS = {
    8192: dict(layout="padded", route_family="qsa", seed=21, seq_len=8192, top_k=512, batch=1),
    32768: dict(layout="padded", route_family="qsa", seed=22, seq_len=32768, top_k=512, batch=1),
}
# (block_m, block_k, num_warps, num_stages) of the forward
FWD_CONFIGS = [(128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (128, 16, 8, 2), (64, 64, 4, 2),
               (64, 32, 4, 3)]
# (forward block_m = tile height, backward_block_m, backward_block_k, warps, stages);
# (128,32,8,1) needs more shared memory than an H200 block may take
# flat programs at D=256 need 64-ID backward chunks (qsa_triton.plan.min_backward_block_k)
BWD_CONFIGS = [(128, 64, 64, 8, 1), (64, 64, 64, 8, 1), (128, 64, 64, 8, 2)]

def _elapsed() -> float:
    return time.time() - START


def _make(kwargs):
    problem = make_problem(**kwargs)
    return problem.routes, problem.kv_length


def _record(results: dict, key: str, fn, *args, **kwargs):
    """Run one sub-check; keep its result or its error."""
    t0 = time.time()
    try:
        value = fn(*args, **kwargs)
        entry = {"ok": True, "result": value}
    except Exception as exc:  # keep going
        entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    entry["seconds"] = round(time.time() - t0, 2)
    results[key] = entry
    return entry


# ---------------------------------------------------------------- correctness
def check_correctness(routes_np, kv_length, heads, route_dtype):
    import torch

    from qsa_torch import reference_sparse_gqa_attention
    from qsa_torch.triton_qsa import triton_sparse_gqa_attention

    torch.manual_seed(0)
    dev = DEVICE
    bsz, s_q, _ = routes_np.shape
    hq, hkv = heads
    d = 256 if DEVICE == "cuda" else 16
    info = np.iinfo(np.int32)
    if route_dtype == torch.int32:
        routes_np = np.where((routes_np < info.min) | (routes_np > info.max), -1, routes_np)
    routes = torch.from_numpy(np.ascontiguousarray(routes_np)).to(dev, route_dtype)
    q = torch.randn(bsz, s_q, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(bsz, kv_length, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(bsz, kv_length, hkv, d, device=dev, dtype=torch.bfloat16)
    do = torch.randn(bsz, s_q, hq, d, device=dev, dtype=torch.bfloat16)
    scale = 1.0 / 16

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = triton_sparse_gqa_attention(*leaves, routes, scale)
    out.backward(do)
    got = [out.detach()] + [t.grad for t in leaves]

    ref_leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    ref_out = reference_sparse_gqa_attention(*ref_leaves, routes, scale)
    ref_out.backward(do.float())
    want = [ref_out.detach()] + [t.grad for t in ref_leaves]
    errors = {name: relative_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}

    valid = (routes >= 0) & (routes < kv_length)
    empty = ~valid.any(-1)
    n_empty = int(empty.sum())
    empty_exact = bool((got[0][empty] == 0).all() and (got[1][empty] == 0).all()) if n_empty else None
    ok = all(e < 1e-2 for e in errors.values()) and empty_exact is not False
    return {"errors": errors, "empty_rows": n_empty, "empty_rows_exact_zero": empty_exact, "pass": ok,
            "shape": {"B": bsz, "S_q": s_q, "S_kv": kv_length, "K": routes_np.shape[-1]}}


def check_no_host_sync(routes_np, kv_length):
    """One forward+backward with torch's sync debug mode set to raise on a host sync."""
    import torch

    from qsa_torch.triton_qsa import triton_sparse_gqa_attention

    routes = torch.from_numpy(routes_np.astype(np.int32)).to("cuda")
    bsz, s_q, _ = routes_np.shape
    leaves = [torch.randn(bsz, n, h, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for n, h in ((s_q, 24), (kv_length, 2), (kv_length, 2))]
    do = torch.randn_like(leaves[0])
    triton_sparse_gqa_attention(*leaves, routes).backward(do)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_sparse_gqa_attention(*leaves, routes).backward(do)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return "no synchronising call in forward+backward"


# -------------------------------------------------------------------- timing
def _time_ms(fn, reps: int, warmup: int = 2) -> float:
    if DEVICE == "cuda":
        return cuda_ms(fn, reps, warmup)
    for _ in range(warmup):  # the CPU smoke run: one wall-clock call
        fn()
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


class Bench:
    """Inputs of one benchmark problem: B=1, (24,2), D=256, bf16, QSA routes."""

    def __init__(self, routes_np, kv_length):
        import torch

        from qsa_torch.routes import normalize_routes

        torch.manual_seed(0)
        dev = DEVICE
        d = 256 if DEVICE == "cuda" else 16
        bsz, s_q, _ = routes_np.shape
        self.routes = torch.from_numpy(routes_np.astype(np.int32)).to(dev)
        self.kv_length = kv_length
        self.head_dim = d
        self.q = torch.randn(bsz, s_q, 24, d, device=dev, dtype=torch.bfloat16)
        self.k = torch.randn(bsz, kv_length, 2, d, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn(bsz, kv_length, 2, d, device=dev, dtype=torch.bfloat16)
        self.do = torch.randn_like(self.q)
        self.scale = 1.0 / 16
        canonical = normalize_routes(self.routes, kv_length)
        self.sum_routes = int((canonical >= 0).sum())
        self.reps = 10 if s_q <= 8192 else 5

    def measure(self, blocks):
        import torch

        from qsa_torch import triton_qsa as tq
        from qsa_triton import make_plan

        plan = make_plan(12, self.head_dim, blocks)
        top_k = self.routes.shape[2]

        def preprocess():  # what triton_sparse_gqa_attention does before its kernels
            return tq.route_unions(self.q, self.k, self.routes, block_sizes=blocks)

        unions = preprocess()
        out, lse = tq.forward_from_unions(self.q, self.k, self.v, *unions, self.scale, top_k, block_sizes=blocks)
        leaves = [t.detach().clone().requires_grad_(True) for t in (self.q, self.k, self.v)]

        def fwd():
            return tq.triton_sparse_gqa_attention(*leaves, self.routes, self.scale, block_sizes=blocks)

        def fwd_bwd():
            for t in leaves:
                t.grad = None
            fwd().backward(self.do)

        row = {
            "preprocess_ms": _time_ms(preprocess, self.reps),
            "forward_kernel_ms": _time_ms(
                lambda: tq.forward_from_unions(self.q, self.k, self.v, *unions, self.scale, top_k,
                                               block_sizes=blocks), self.reps),
            "backward_kernel_ms": _time_ms(
                lambda: tq.backward_from_residuals(self.do, self.q, self.k, self.v, out, lse, *unions, self.scale,
                                                   top_k, block_sizes=blocks),
                self.reps),
        }
        with torch.no_grad():
            row["fwd_ms"] = _time_ms(fwd, self.reps)
        row["fwd_bwd_ms"] = _time_ms(fwd_bwd, self.reps)
        flops = 4.0 * self.sum_routes * 24 * self.head_dim
        row["fwd_tflops_useful"] = flops / (row["forward_kernel_ms"] * 1e9)
        row["bwd_tflops_useful"] = 2.5 * flops / (row["backward_kernel_ms"] * 1e9)
        count = unions[1].double()
        row["rows_per_tile"] = plan.rows_per_tile
        row["mean_union_per_tile"] = float(count.mean())
        # matrix work done (union x matrix rows of a program) over useful work (routes x heads)
        matrix_rows = plan.fwd_heads if plan.flat else plan.rows_per_tile * 16
        row["work_amplification"] = float(count.sum()) * matrix_rows / (self.sum_routes * 12)
        return row


def _blocks(fwd, bwd=None):
    from qsa_torch.triton_qsa import DEFAULT_BLOCK_SIZES, BlockSizes

    block_m, block_k, warps, stages = fwd
    kwargs = dict(block_m=block_m, block_k=block_k, num_warps=warps, num_stages=stages)
    if bwd is None:
        bwd = (block_m, DEFAULT_BLOCK_SIZES.backward_block_m, DEFAULT_BLOCK_SIZES.backward_block_k,
               DEFAULT_BLOCK_SIZES.backward_num_warps, DEFAULT_BLOCK_SIZES.backward_num_stages)
    _, bm, bk, bw, bs = bwd
    return BlockSizes(backward_block_m=bm, backward_block_k=bk, backward_num_warps=bw,
                      backward_num_stages=bs, flatten_heads=DEFAULT_BLOCK_SIZES.flatten_heads, **kwargs)


def autotune(bench: Bench, fwd_configs, bwd_configs, results: dict, label: str):
    rows = []
    for fwd in fwd_configs:
        if _elapsed() > BUDGET_S:
            rows.append({"config": f"fwd {fwd}", "skipped": "time budget"})
            continue
        entry = _record({}, "x", bench.measure, _blocks(fwd))
        rows.append({"config": f"fwd {fwd}", "fwd": fwd, "blocks": str(_blocks(fwd)), **(
            entry["result"] if entry["ok"] else {"error": entry["error"]})})
    for bwd in bwd_configs:
        if _elapsed() > BUDGET_S:
            rows.append({"config": f"bwd {bwd}", "skipped": "time budget"})
            continue
        fwd = next((c for c in fwd_configs if c[0] == bwd[0]), (bwd[0], 64, 8, 2))
        entry = _record({}, "x", bench.measure, _blocks(fwd, bwd))
        rows.append({"config": f"bwd {bwd}", "bwd": bwd, "blocks": str(_blocks(fwd, bwd)), **(
            entry["result"] if entry["ok"] else {"error": entry["error"]})})
    results[label] = rows
    return rows


def _best(rows, key, prefix):
    ok = [r for r in rows if r["config"].startswith(prefix) and key in r]
    return sorted(ok, key=lambda r: r[key])


# ----------------------------------------------------------------- sanitizer
def sanitizer_probe() -> int:
    """Tiny forward+backward runs of both kernels, checked against the float64 oracle."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from contract_base import random_inputs
    from runners import run_torch

    from qsa_common.oracle import oracle_forward_backward
    from qsa_torch.triton_qsa import DEFAULT_BLOCK_SIZES, SAFE_BLOCK_SIZES, triton_sparse_gqa_attention

    rng = np.random.default_rng(0)
    cases = [
        (make_problem("packed", "qsa", seed=1, seq_len=96, top_k=6), (12, 1), 256, "bfloat16", None, 1e-2),
        (make_problem("padded", "adversarial", seed=2, seq_len=40, width=10), (4, 2), 64, "float32",
         SAFE_BLOCK_SIZES, 1e-5),
        (make_problem("cp", "random", seed=3, seq_len=64, width=12), (24, 2), 256, "bfloat16", None, 1e-2),
        # G = 6: no tile of <= 32 rows holds whole 128-pair programs, so the union kernels
        # take each program's rows (flat PAIRS mode) instead of cutting tile unions
        (make_problem("padded", "qsa", seed=4, seq_len=80, top_k=5), (6, 1), 256, "bfloat16",
         DEFAULT_BLOCK_SIZES, 1e-2),
    ]
    worst = 0.0
    for problem, heads, d, dtype, blocks, tol in cases:
        q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, heads, d, dtype)
        fn = lambda *a, b=blocks: triton_sparse_gqa_attention(*a, block_sizes=b)  # noqa: E731
        got = run_torch(fn, q, k, v, problem.routes, d ** -0.5, do, dtype, device=DEVICE)
        want = oracle_forward_backward(q, k, v, problem.routes, d ** -0.5, do)
        errs = [relative_error(g, w) for g, w in zip(got, want)]
        print("probe", problem.layout, heads, dtype, blocks, [f"{e:.2e}" for e in errs], flush=True)
        worst = max(worst, max(e / tol for e in errs))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print("PROBE_OK" if worst < 1 else "PROBE_NUMERICS_FAIL", flush=True)
    return 0 if worst < 1 else 2


def start_sanitizer(out_dir: Path):
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return None
    log = open(out_dir / "sanitizer.log", "w")
    cmd = [tool, "--tool", "memcheck", "--print-limit", "30", "--error-exitcode", "3",
           sys.executable, str(Path(__file__).resolve()), "--sanitizer-probe"]
    # without the caching allocator every tensor is its own allocation, so memcheck sees
    # an access past a tensor's end even where the cache would have memory behind it
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env), log, cmd


def finish_sanitizer(handle, out_dir: Path, timeout: float):
    if handle is None:
        return {"ran": False, "reason": "compute-sanitizer not on PATH"}
    proc, log, cmd = handle
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    log.close()
    text = (out_dir / "sanitizer.log").read_text(errors="replace")
    summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line]
    return {"ran": True, "returncode": rc, "error_summary": summary[-1] if summary else None,
            "probe_ok": "PROBE_OK" in text, "command": " ".join(cmd), "tail": text[-3000:]}


# ---------------------------------------------------------------------- main
def _summary(entry) -> str:
    if not entry:
        return "not run"
    return str(entry["result"]) if entry["ok"] else f"FAILED {entry['error'][:300]}"


def _markdown(report) -> str:
    lines = ["# Triton token-gather backend on the GPU", "",
             f"{report['env']}", "", "## Correctness (bf16 vs fp32 torch reference, ||x-ref||/||ref||)", "",
             "| layout | routes | heads | out | dq | dk | dv | empty rows exact | pass |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, entry in report["correctness"].items():
        if entry["ok"]:
            r = entry["result"]
            e = r["errors"]
            lines.append(f"| {key} | {e['out']:.2e} | {e['dq']:.2e} | {e['dk']:.2e} | {e['dv']:.2e} | "
                         f"{r['empty_rows_exact_zero']} ({r['empty_rows']}) | {r['pass']} |")
        else:
            lines.append(f"| {key} | error: {entry['error'][:120]} | | | | | | FAIL |")
    for label, rows in report["autotune"].items():
        lines += ["", f"## Autotune {label} (ms, median)", "",
                  "| config | preprocess | fwd kernel | bwd kernel | fwd | fwd+bwd | fwd TFLOP/s | bwd TFLOP/s |"
                  " union/tile | work x |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows if isinstance(rows, list) else []:
            if "fwd_bwd_ms" in r:
                lines.append(
                    f"| {r['config']} | {r['preprocess_ms']:.2f} | {r['forward_kernel_ms']:.2f} | "
                    f"{r['backward_kernel_ms']:.2f} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                    f"{r['fwd_tflops_useful']:.0f} | {r['bwd_tflops_useful']:.0f} | "
                    f"{r['mean_union_per_tile']:.0f} | {r['work_amplification']:.2f} |")
            else:
                lines.append(f"| {r['config']} | {r.get('error', r.get('skipped', ''))[:150]} |||||||||")
    s = report["sanitizer"]
    lines += ["", "## compute-sanitizer memcheck", "", f"{s.get('error_summary') or s.get('reason')}; "
              f"rc={s.get('returncode')}; probe numerics ok={s.get('probe_ok')}", "",
              f"no host sync: {_summary(report.get('no_host_sync'))}", "",
              f"total {report['seconds']:.0f} s"]
    return "\n".join(lines) + "\n"


def _smoke_setup() -> None:
    global DEVICE
    DEVICE = "cpu"
    os.environ["TRITON_INTERPRET"] = "1"
    for kw in list(CORRECTNESS_PROBLEMS.values()) + list(BENCH_PROBLEMS.values()):
        kw.update(seq_len=32, top_k=2)
    BENCH_PROBLEMS.pop(32768)
    BENCH_PROBLEMS[64] = dict(layout="padded", route_family="qsa", seed=23, seq_len=64, top_k=2, batch=1)
    del FWD_CONFIGS[2:], BWD_CONFIGS[1:-1]


def _run_phases(args, report, futures, sanitizer, save):
    """Correctness, sanitizer, then the block-size sweep; ``save()`` after each phase."""
    import torch

    for (_, layout, fam), fut in [(k, f) for k, f in futures.items() if k[0] == "c"]:
        got = _record({}, "gen", fut.result)
        if not got["ok"]:
            report["correctness"][f"{layout} | {fam} | -"] = got
            continue
        routes_np, kv_length = got["result"]
        route_dtype = torch.int32 if fam == "qsa" else torch.int64
        for heads in ((24, 2), (12, 1)):
            _record(report["correctness"], f"{layout} | {fam} | {heads}", check_correctness,
                    routes_np, kv_length, heads, route_dtype)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    if DEVICE == "cuda":
        gen = _record({}, "gen", futures[("c", "packed", "qsa")].result)
        if gen["ok"]:
            _record(report, "no_host_sync", check_no_host_sync, *gen["result"])
    report["seconds_correctness"] = round(_elapsed(), 1)
    save()

    # the sanitizer shares the GPU: let it finish before anything is timed
    if DEVICE == "cuda":
        report["sanitizer"] = finish_sanitizer(sanitizer, args.out, timeout=200 - _elapsed())
    else:
        report["sanitizer"] = {"reason": "smoke run", "returncode": sanitizer_probe()}
    save()

    for i, seq in enumerate(BENCH_PROBLEMS):
        got = _record({}, "gen", futures[("b", seq)].result)
        if not got["ok"]:
            report["autotune"][f"S={seq}"] = [{"config": "-", "error": got["error"]}]
            continue
        bench = Bench(*got["result"])
        if i == 0:
            autotune(bench, FWD_CONFIGS, BWD_CONFIGS, report["autotune"], f"S={seq}")
        else:
            # the default plus the two best forward and backward configurations at S=8192
            prev = report["autotune"].get(f"S={next(iter(BENCH_PROBLEMS))}", [])
            best_f = [r["fwd"] for r in _best(prev, "forward_kernel_ms", "fwd")[:2]]
            best_b = [r["bwd"] for r in _best(prev, "backward_kernel_ms", "bwd")[:2]]
            fwd = list(dict.fromkeys([FWD_CONFIGS[0]] + best_f))
            bwd = list(dict.fromkeys([BWD_CONFIGS[0]] + best_b))
            autotune(bench, fwd, bwd, report["autotune"], f"S={seq}")
        del bench
        save()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--sanitizer-probe", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU plumbing test: Triton interpreter, tiny shapes, no sanitizer")
    args = parser.parse_args()
    if args.sanitizer_probe:
        return sanitizer_probe()
    if args.smoke:
        _smoke_setup()
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, whatever the shell had
    args.out.mkdir(parents=True, exist_ok=True)

    # route generation is numpy-bound: fork workers before CUDA is initialised
    pool = ProcessPoolExecutor(max_workers=min(8, os.cpu_count() or 1), mp_context=mp.get_context("fork"))
    futures = {("c",) + key: pool.submit(_make, kw) for key, kw in CORRECTNESS_PROBLEMS.items()}
    futures.update({("b", s): pool.submit(_make, kw) for s, kw in BENCH_PROBLEMS.items()})

    import torch
    import triton

    gpu = (f"{torch.cuda.get_device_name()} sm{''.join(map(str, torch.cuda.get_device_capability()))}"
           if DEVICE == "cuda" else "CPU smoke run (interpreter)")
    report = {"env": f"torch {torch.__version__}, triton {triton.__version__}, {gpu}",
              "correctness": {}, "autotune": {}, "sanitizer": {}}
    sanitizer = start_sanitizer(args.out) if DEVICE == "cuda" else None

    def save() -> None:
        # written after every phase so that a run killed by its time limit keeps what it measured
        (args.out / "check_triton.json").write_text(json.dumps(report, indent=1, default=str))

    try:
        _run_phases(args, report, futures, sanitizer, save)
    finally:
        save()
    pool.shutdown(cancel_futures=True)
    report["seconds"] = _elapsed()
    (args.out / "check_triton.json").write_text(json.dumps(report, indent=1, default=str))
    md = _markdown(report)
    (args.out / "check_triton.md").write_text(md)

    # short summary last
    print("\n=== check_triton summary ===")
    n_ok = sum(1 for e in report["correctness"].values() if e["ok"] and e["result"]["pass"])
    print(f"correctness: {n_ok}/{len(report['correctness'])} pass")
    for key, e in report["correctness"].items():
        if e["ok"]:
            errs = e["result"]["errors"]
            print(f"  {key}: max err {max(errs.values()):.2e} pass={e['result']['pass']}")
        else:
            print(f"  {key}: ERROR {e['error'][:200]}")
    for label, rows in report["autotune"].items():
        print(f"autotune {label}:")
        for r in rows:
            if "fwd_bwd_ms" in r:
                print(f"  {r['config']:<28} pre {r['preprocess_ms']:6.2f}  fwdk {r['forward_kernel_ms']:7.2f}  "
                      f"bwdk {r['backward_kernel_ms']:7.2f}  fwd {r['fwd_ms']:7.2f}  fwd+bwd {r['fwd_bwd_ms']:7.2f} ms")
            else:
                print(f"  {r['config']:<28} {r.get('error', r.get('skipped', ''))[:160]}")
    s = report["sanitizer"]
    print(f"sanitizer: {s.get('error_summary') or s.get('reason')} rc={s.get('returncode')} "
          f"probe_ok={s.get('probe_ok')}")
    print(f"no host sync: {_summary(report.get('no_host_sync'))}")
    print(f"total {report['seconds']:.0f} s; details in {args.out}/check_triton.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
