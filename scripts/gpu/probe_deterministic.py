"""The deterministic KV-owning dK/dV backward on one H200 (issue 18), against the default one.

    python3 scripts/gpu/probe_deterministic.py --out $OUT               # < 2 minutes
    python3 scripts/gpu/probe_deterministic.py --out $OUT --sanitizer   # memcheck, ~1-2 minutes
    python3 scripts/gpu/probe_deterministic.py --out DIR --smoke        # CPU, Triton's interpreter

B=1, (Hq, Hkv) = (24, 2), D=256, bf16, QSA-format routes (qsa_common generators, top_k 512,
int32) at S=32768 (``--seq-len``). Measures (medians of ``triton.testing.do_bench``):

* the default path: ``triton_sparse_gqa_attention`` forward, forward+backward, and their
  difference (the default backward with its fp32 atomics);
* per block configuration of ``qsa_torch._triton_deterministic`` (up to four): the
  inverse-index build, the dK/dV kernel alone (index prebuilt), their sum; the index's
  size (routing (block, row) pairs, longest and mean block union) and work inflation
  (pairs * block_n / valid routes); bitwise equality of dk/dv over 3 runs (each
  rebuilding the index); errors of dk/dv against the torch reference (fp32 from the
  same bf16 inputs) and against the default backward; that the index build makes no
  synchronising call (``torch.cuda.set_sync_debug_mode("error")``).

Writes probe_deterministic.json (after every step) and probe_deterministic.md under
--out and prints the best configuration last. Configurations are skipped once the time
budget is spent; each step's failure is recorded and the others still run.

``--sanitizer`` instead runs compute-sanitizer memcheck over tiny problems (S <= 96, D =
256, bf16, (12,1), (24,2), (6,1), three tilings, QSA / adversarial int64 / random routes)
in a subprocess (``--sanitizer-probe``), whose dk/dv must match the float64 oracle and
repeat bitwise; writes sanitizer.log and probe_deterministic_sanitizer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

BUDGET_S = 80.0  # no new configuration starts past this (compiles take ~10-20 s each)
START = time.time()
RESULTS: dict = {}
OUT = "."
DEVICE = "cuda"


def log(*args):
    print(*args, flush=True)


def save():
    with open(os.path.join(OUT, "probe_deterministic.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)


def record(section, name, fn):
    t0 = time.time()
    try:
        value = fn()
    except Exception as err:  # keep going: one failure must not lose the rest
        value = dict(error=repr(err), trace=traceback.format_exc()[-2000:])
    RESULTS.setdefault(section, {})[name] = value
    shown = value["error"] if isinstance(value, dict) and "error" in value else value
    log(f"[{time.time() - START:6.1f}s +{time.time() - t0:5.1f}s] {section}/{name}: {shown}")
    save()
    return value


def time_ms(fn) -> float:
    """Median milliseconds of ``fn`` (``triton.testing.do_bench``; one wall-clock run in
    the CPU smoke run)."""
    if DEVICE != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median"))


def relative(actual, expected) -> float:
    a, e = actual.double(), expected.double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def sanitizer_probe() -> int:
    """Tiny runs of the index and dK/dV kernels against the float64 oracle (the forward's
    LSE from the Triton forward), each twice for bitwise equality."""
    import numpy as np
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from contract_base import random_inputs

    from qsa_common.layouts import make_problem
    from qsa_common.oracle import oracle_forward_backward, relative_error
    from qsa_torch import _triton_deterministic as det
    from qsa_torch import triton_qsa

    d = 256 if DEVICE == "cuda" else 32
    cases = [
        (make_problem("packed", "qsa", seed=1, seq_len=96, top_k=6), (12, 1), np.int32, det.DEFAULT_KV_BLOCK_SIZES),
        (make_problem("padded", "adversarial", seed=2, seq_len=80, width=10), (24, 2), np.int64,
         det.KVBlockSizes(block_n=64, block_m=64, num_warps=8)),
        (make_problem("cp", "random", seed=3, seq_len=96, width=12), (6, 1), np.int64,
         det.KVBlockSizes(block_n=16, block_m=128, num_warps=8)),
    ]
    rng = np.random.default_rng(0)
    ok = True
    for problem, heads, route_dtype, blocks in cases:
        routes_np = problem.routes if route_dtype == np.int64 else np.where(
            np.abs(problem.routes) < 2**31, problem.routes, -1).astype(np.int32)
        q, k, v, do = random_inputs(rng, routes_np, problem.kv_length, heads, d, "bfloat16")
        t = lambda x: torch.tensor(x, dtype=torch.bfloat16, device=DEVICE)  # noqa: E731
        routes = torch.from_numpy(routes_np).to(DEVICE)
        out, lse, *_ = triton_qsa.forward_with_residuals(t(q), t(k), t(v), routes, d ** -0.5)
        delta = det.attention_delta(out, t(do))
        runs = [det.deterministic_dk_dv(t(q), t(k), t(v), t(do), lse, delta, routes, d ** -0.5, block_sizes=blocks)
                for _ in range(2)]
        _, _, dk, dv = oracle_forward_backward(q, k, v, routes_np, d ** -0.5, do)
        errs = [relative_error(g.double().cpu().numpy(), w) for g, w in zip(runs[0], (dk, dv))]
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*runs))
        print("probe", problem.layout, heads, blocks, ["%.2e" % e for e in errs], "bitwise", same, flush=True)
        ok = ok and same and max(errs) < 1e-2
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print("PROBE_OK" if ok else "PROBE_FAIL", flush=True)
    return 0 if ok else 2


def run_sanitizer(timeout: float) -> int:
    """compute-sanitizer memcheck over :func:`sanitizer_probe` in a subprocess."""
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    result: dict = {"ran": False, "reason": "compute-sanitizer not found"}
    if tool is not None:
        cmd = [tool, "--tool", "memcheck", "--print-limit", "30", "--error-exitcode", "3",
               sys.executable, os.path.abspath(__file__), "--out", OUT, "--sanitizer-probe"]
        # without the caching allocator every tensor is its own allocation, so memcheck sees
        # an access past a tensor's end even where the cache would have memory behind it
        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
        env.pop("TRITON_INTERPRET", None)
        with open(os.path.join(OUT, "sanitizer.log"), "w") as sink:
            try:
                rc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = open(os.path.join(OUT, "sanitizer.log"), errors="replace").read()
        summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line]
        result = {"ran": True, "returncode": rc, "error_summary": summary[-1] if summary else None,
                  "probe_ok": "PROBE_OK" in text, "command": " ".join(cmd), "tail": text[-3000:]}
    with open(os.path.join(OUT, "probe_deterministic_sanitizer.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    log(f"sanitizer: {result.get('error_summary') or result.get('reason')} rc={result.get('returncode')} "
        f"probe_ok={result.get('probe_ok')}")
    return 0 if result.get("probe_ok") and result.get("returncode") == 0 else 1


def main() -> int:
    global OUT, DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run in Triton's interpreter")
    parser.add_argument("--sanitizer", action="store_true", help="compute-sanitizer memcheck of tiny runs only")
    parser.add_argument("--sanitizer-timeout", type=float, default=240.0)
    parser.add_argument("--sanitizer-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    if args.sanitizer_probe:
        return sanitizer_probe()
    if args.sanitizer:
        return run_sanitizer(args.sanitizer_timeout)

    import numpy as np
    import torch

    from qsa_common.layouts import make_problem
    from qsa_torch import _triton_deterministic as det
    from qsa_torch import reference_sparse_gqa_attention, triton_qsa

    if args.smoke:
        s, hq, hkv, d, top_k = 128, 6, 2, 32, 8
        configs = [det.KVBlockSizes(block_n=16, block_m=16, num_warps=1), det.KVBlockSizes(block_n=64, block_m=32)]
    else:
        s, hq, hkv, d, top_k = args.seq_len, 24, 2, 256, 512
        configs = [det.DEFAULT_KV_BLOCK_SIZES,  # 32 keys x 128 pairs
                   det.KVBlockSizes(block_n=64, block_m=64, num_warps=8, num_stages=1),
                   det.KVBlockSizes(block_n=16, block_m=128, num_warps=8, num_stages=1),
                   det.KVBlockSizes(block_n=64, block_m=32, num_warps=8, num_stages=1)]
    RESULTS["setup"] = dict(seq_len=s, heads=[hq, hkv], head_dim=d, top_k=top_k, dtype="bfloat16",
                            device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)",
                            torch=torch.__version__)
    t0 = time.time()
    problem = make_problem("padded", "qsa", seed=22, seq_len=s, top_k=top_k, batch=1)
    routes = torch.from_numpy(problem.routes.astype(np.int32)).to(DEVICE)
    n_routes = int(((problem.routes >= 0) & (problem.routes < s)).sum())
    RESULTS["setup"].update(valid_routes=n_routes, routes_s=round(time.time() - t0, 1))
    log("setup", RESULTS["setup"])

    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, do = (torch.randn(1, s, h, d, device=DEVICE, generator=g).to(torch.bfloat16)
                   for h in (hq, hkv, hkv, hq))
    scale = d ** -0.5
    state: dict = {}

    def default_path():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def fwd():
            with torch.no_grad():
                triton_qsa.triton_sparse_gqa_attention(q, k, v, routes, scale)

        def fwd_bwd():
            for x in leaves:
                x.grad = None
            triton_qsa.triton_sparse_gqa_attention(*leaves, routes, scale).backward(do)

        fwd_ms, both_ms = time_ms(fwd), time_ms(fwd_bwd)
        state["atomic"] = (leaves[1].grad, leaves[2].grad)
        return dict(forward_ms=fwd_ms, forward_backward_ms=both_ms, backward_ms=both_ms - fwd_ms)

    def residuals():
        out, lse, *_ = triton_qsa.forward_with_residuals(q, k, v, routes, scale)
        state["lse"], state["delta"] = lse, det.attention_delta(out, do)
        return dict(delta_ms=time_ms(lambda: det.attention_delta(out, do)))

    def reference():
        leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
        t1 = time.time()
        reference_sparse_gqa_attention(*leaves, routes, scale).backward(do.float())
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        state["reference"] = (leaves[1].grad, leaves[2].grad)
        atomic = state.get("atomic")
        errors = {} if atomic is None else dict(
            atomic_dk_vs_reference=relative(atomic[0], leaves[1].grad),
            atomic_dv_vs_reference=relative(atomic[1], leaves[2].grad))
        return dict(seconds=round(time.time() - t1, 1), **errors)

    record("default", "triton_qsa", default_path)
    record("default", "residuals", residuals)
    record("default", "reference_fp32", reference)

    def probe(blocks):
        index = det.build_inverse_index(routes, s, blocks.block_n)
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                det.build_inverse_index(routes, s, blocks.block_n)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts = (index.start[1:] - index.start[:-1]).double()
        pairs = int(index.start[-1])
        call = lambda idx: det.deterministic_dk_dv(  # noqa: E731
            q, k, v, do, state["lse"], state["delta"], routes, scale, block_sizes=blocks, index=idx)
        index_ms = time_ms(lambda: det.build_inverse_index(routes, s, blocks.block_n))
        kernel_ms = time_ms(lambda: call(index))
        runs = [det.deterministic_dk_dv(q, k, v, do, state["lse"], state["delta"], routes, scale,
                                        block_sizes=blocks) for _ in range(3)]
        bitwise = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                      for run in runs[1:] for a, b in zip(run, runs[0]))
        dk, dv = runs[0]
        result = dict(index_ms=index_ms, kernel_ms=kernel_ms, total_ms=index_ms + kernel_ms,
                      bitwise_equal_3_runs=bitwise, pairs=pairs,
                      union_rows_max=int(counts.max()), union_rows_mean=float(counts.mean()),
                      inflation=pairs * blocks.block_n / n_routes,
                      kernel_useful_tflops=4.0 * n_routes * hq * d / (kernel_ms * 1e9))
        for name, ref in (("reference", state.get("reference")), ("atomic", state.get("atomic"))):
            if ref is not None:
                result[f"dk_vs_{name}"] = relative(dk, ref[0])
                result[f"dv_vs_{name}"] = relative(dv, ref[1])
        default = RESULTS["default"].get("triton_qsa", {})
        if isinstance(default, dict) and "backward_ms" in default:
            result["total_over_default_backward"] = result["total_ms"] / default["backward_ms"]
        return result

    for blocks in configs:
        name = f"n{blocks.block_n}_m{blocks.block_m}_w{blocks.num_warps}_s{blocks.num_stages}"
        if time.time() - START > BUDGET_S:
            RESULTS.setdefault("deterministic", {})[name] = "skipped: time budget"
            save()
            continue
        record("deterministic", name, lambda: probe(blocks))

    done = {n: r for n, r in RESULTS.get("deterministic", {}).items() if isinstance(r, dict) and "total_ms" in r}
    best = min(done, key=lambda n: done[n]["total_ms"]) if done else None
    RESULTS["best"] = best
    save()
    write_markdown(best)
    log("best:", best, done.get(best))
    return 0


def write_markdown(best):
    lines = ["# Deterministic dK/dV probe", "", f"setup: `{json.dumps(RESULTS['setup'])}`", ""]
    default = RESULTS.get("default", {}).get("triton_qsa", {})
    if isinstance(default, dict) and "backward_ms" in default:
        lines += [f"default path: forward {default['forward_ms']:.2f} ms, forward+backward "
                  f"{default['forward_backward_ms']:.2f} ms, backward {default['backward_ms']:.2f} ms", ""]
    lines += ["| config | index ms | kernel ms | total ms | / default bwd | bitwise | inflation | "
              "union max / mean | dk err ref | dv err ref |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in RESULTS.get("deterministic", {}).items():
        if not isinstance(r, dict) or "total_ms" not in r:
            lines.append(f"| {name} | {r if isinstance(r, str) else r.get('error')} |||||||||")
            continue
        lines.append(
            f"| {name}{' (best)' if name == best else ''} | {r['index_ms']:.2f} | {r['kernel_ms']:.2f} | "
            f"{r['total_ms']:.2f} | {r.get('total_over_default_backward', float('nan')):.2f} | "
            f"{r['bitwise_equal_3_runs']} | {r['inflation']:.2f} | {r['union_rows_max']} / "
            f"{r['union_rows_mean']:.0f} | {r.get('dk_vs_reference', float('nan')):.2e} | "
            f"{r.get('dv_vs_reference', float('nan')):.2e} |")
    with open(os.path.join(OUT, "probe_deterministic.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
