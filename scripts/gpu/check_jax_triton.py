#!/usr/bin/env python3
"""torch Triton against JAX Triton on one H200: the same qsa_triton kernels, bit for bit.

From the repository root, after ``source /tmp/qsa-site/env.sh`` (jax-triton 0.3.1)::

    python3 scripts/gpu/check_jax_triton.py --out $OUT        # about 1.5 minutes

S=8192, D=256, bf16, QSA-format routes (top_k 512); heads (24,2) and (12,1); layouts
padded (B=2), packed and cp (the last of 2 ranks: 4096 local rows against 8192 K/V);
one worker process per layout (compilation is CPU-bound), merged at the end.
Per case, on the same bf16 inputs:

1. forward: ``qsa_torch.triton_qsa.forward_with_residuals`` against
   ``qsa_jax.triton_qsa.forward_with_lse``: out and LSE max |diff| must be 0;
2. backward: dq, dk, dv of torch autograd against ``jax.vjp``, max |diff| and relative
   difference, next to torch against itself run twice (the fp32 atomics' own
   run-to-run difference in dK/dV), and every result's relative error against the
   torch reference computed in fp32 from the same inputs (tolerance 1e-2).

Writes check_jax_triton.json and check_jax_triton.md under --out; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

from gpu_common import ROOT, Record, log, max_abs_diff, relative_error  # noqa: E402

LAYOUTS = ("packed", "padded", "cp")
HEADS = ((24, 2), (12, 1))
SEQ, TOP_K, D, SCALE, TOL = 8192, 512, 256, 1.0 / 16, 1e-2


def _inputs(layout: str, heads, seed: int):
    import numpy as np
    import torch

    from qsa_common.layouts import make_problem

    problem = make_problem(layout, "qsa", seed=seed, seq_len=SEQ, top_k=TOP_K, batch=2, world_size=2, rank=1)
    b, s_q, _ = problem.routes.shape
    hq, hkv = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    tensors = (make(b, s_q, hq, D), make(b, problem.kv_length, hkv, D), make(b, problem.kv_length, hkv, D),
               make(b, s_q, hq, D))
    return np.ascontiguousarray(problem.routes), tensors


def _to_jax(t):
    import jax.numpy as jnp
    import numpy as np
    import torch

    host = t.detach().cpu()
    if host.dtype == torch.bfloat16:
        return jnp.asarray(host.view(torch.int16).numpy().view(jnp.bfloat16))
    return jnp.asarray(np.asarray(host))


def _to_torch(x):
    import numpy as np
    import torch

    try:
        return torch.from_dlpack(x)
    except Exception:  # noqa: BLE001 -- any DLPack incompatibility: through the host
        host = np.asarray(x)
        if host.dtype.name == "bfloat16":
            return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(host).cuda()


def check_case(layout: str, heads, seed: int) -> dict:
    import jax
    import torch

    from qsa_jax.triton_qsa import forward_with_lse, triton_sparse_gqa_attention
    from qsa_torch import reference_sparse_gqa_attention, triton_qsa

    routes_np, (q, k, v, do) = _inputs(layout, heads, seed)
    routes = torch.from_numpy(routes_np).cuda()
    jq, jk, jv, jdo = (_to_jax(t) for t in (q, k, v, do))

    out_t, lse_t, *_ = triton_qsa.forward_with_residuals(q, k, v, routes, SCALE)
    out_j, lse_j = forward_with_lse(jq, jk, jv, routes_np, SCALE)
    out_j, lse_j = _to_torch(out_j), _to_torch(lse_j)
    result = {"forward": {"out_max_abs_diff": max_abs_diff(out_t, out_j),
                          "lse_max_abs_diff": max_abs_diff(lse_t, lse_j)}}
    result["forward"]["bitwise"] = result["forward"]["out_max_abs_diff"] == result["forward"]["lse_max_abs_diff"] == 0

    def torch_grads():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        triton_qsa.triton_sparse_gqa_attention(*leaves, routes, SCALE).backward(do)
        return [t.grad for t in leaves]

    grads_t, grads_t2 = torch_grads(), torch_grads()
    _, pullback = jax.vjp(lambda a, b, c: triton_sparse_gqa_attention(a, b, c, routes_np, SCALE), jq, jk, jv)
    grads_j = [_to_torch(g) for g in pullback(jdo)]
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    ref_out = reference_sparse_gqa_attention(*leaves, routes, SCALE)
    ref_out.backward(do.float())
    refs = [ref_out.detach()] + [t.grad for t in leaves]
    backward = {}
    for name, a, b, a2, ref in zip(("dq", "dk", "dv"), grads_t, grads_j, grads_t2, refs[1:]):
        backward[name] = {"torch_vs_jax_max_abs_diff": max_abs_diff(a, b),
                          "torch_vs_jax_relative": relative_error(b, a),
                          "torch_vs_torch_max_abs_diff": max_abs_diff(a, a2),
                          "torch_vs_reference": relative_error(a, ref), "jax_vs_reference": relative_error(b, ref)}
    result["backward"] = backward
    result["out_vs_reference"] = {"torch": relative_error(out_t, refs[0]), "jax": relative_error(out_j, refs[0])}
    errors = [result["out_vs_reference"]["torch"], result["out_vs_reference"]["jax"]]
    errors += [x[key] for x in backward.values() for key in ("torch_vs_reference", "jax_vs_reference")]
    result["pass"] = bool(result["forward"]["bitwise"] and all(e < TOL for e in errors))
    torch.cuda.empty_cache()
    return result


def worker(layout: str, out_dir: str, budget_s: float) -> int:
    import jax
    import torch

    record = Record(os.path.join(out_dir, "check_jax_triton.json"), budget_s, layout=layout,
                    versions={"torch": torch.__version__, "jax": jax.__version__})
    for i, heads in enumerate(HEADS):
        record.run("cases", f"{layout} {heads[0]}:{heads[1]}",
                   lambda heads=heads, i=i: check_case(layout, heads, 10 + i))
    return 0


def _markdown(cases: dict) -> str:
    lines = ["# torch Triton vs JAX Triton (qsa_triton kernels), S=8192, D=256, bf16, QSA routes", "",
             "| case | out max|diff| | LSE max|diff| | dq t-j | dk t-j | dv t-j | dk t-t | dv t-t | "
             "worst vs reference | pass |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in cases.items():
        r = entry.get("result")
        if not r:
            lines.append(f"| {name} | {entry.get('error') or entry.get('skipped')} |||||||| FAIL |")
            continue
        b = r["backward"]
        worst = max([*r["out_vs_reference"].values()]
                    + [x[k] for x in b.values() for k in ("torch_vs_reference", "jax_vs_reference")])
        lines.append(f"| {name} | {r['forward']['out_max_abs_diff']:.3g} | {r['forward']['lse_max_abs_diff']:.3g} | "
                     f"{b['dq']['torch_vs_jax_max_abs_diff']:.3g} | {b['dk']['torch_vs_jax_max_abs_diff']:.3g} | "
                     f"{b['dv']['torch_vs_jax_max_abs_diff']:.3g} | {b['dk']['torch_vs_torch_max_abs_diff']:.3g} | "
                     f"{b['dv']['torch_vs_torch_max_abs_diff']:.3g} | {worst:.2e} | {r['pass']} |")
    lines += ["", "t-j: torch against JAX; t-t: torch against itself run twice (fp32 atomics order)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=110.0)
    parser.add_argument("--worker", choices=LAYOUTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.out, args.budget_s)
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    procs = {}
    for layout in LAYOUTS:
        out = os.path.join(args.out, layout)
        os.makedirs(out, exist_ok=True)
        log_file = open(os.path.join(out, "worker.log"), "w")
        procs[layout] = (subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", layout, "--out", out,
                                           "--budget-s", str(args.budget_s - 15)], cwd=ROOT, stdout=log_file,
                                          stderr=subprocess.STDOUT), log_file)
    cases, status = {}, {}
    for layout, (proc, log_file) in procs.items():
        try:
            status[layout] = proc.wait(timeout=max(1.0, args.budget_s - (time.time() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            status[layout] = "killed at the budget"
        log_file.close()
        path = os.path.join(args.out, layout, "check_jax_triton.json")
        if os.path.exists(path):
            with open(path) as f:
                cases.update(json.load(f).get("cases", {}))
    summary = {"cases": cases, "workers": status, "seconds": round(time.time() - start, 1),
               "all_pass": len(cases) == len(LAYOUTS) * len(HEADS) and all(
                   (c.get("result") or {}).get("pass") for c in cases.values())}
    with open(os.path.join(args.out, "check_jax_triton.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    text = _markdown(cases)
    with open(os.path.join(args.out, "check_jax_triton.md"), "w") as f:
        f.write(text)
    log(text)
    log(f"workers: {status}; all pass: {summary['all_pass']}; {summary['seconds']} s")
    return 0 if summary["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
