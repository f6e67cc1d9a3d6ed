#!/usr/bin/env python3
"""Time the lean backward against the default one, torch Triton and JAX Pallas (H200).

From the repository root::

    python3 scripts/gpu/probe_kernels.py --out $OUT        # under 90 seconds

B=1, S=32768, (24,2), D=256, bf16, QSA-format routes (top_k 512), the tuned default
block sizes of each backend with and without ``lean_backward`` (transposed dK/dV
products, dQ-store coordinates recomputed after the loop). Times the backward alone:
torch through ``qsa_torch.triton_qsa.backward_from_residuals`` on the forward's
residuals, JAX through the jitted pullback of ``jax.vjp`` (the Pallas backward kernel,
its LSE/delta arrangement and the dK/dV casts); medians of CUDA-event / wall-clock
timings after warm-up. Checks that lean and default gradients agree (relative
difference < 1e-2: the same products summed in another order). Writes probe.json and
prints one verdict line last: per backend, make lean the default where it is at least
2% faster, else delete it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

from gpu_common import Record, cuda_ms, jax_ms, log, relative_error  # noqa: E402

import numpy as np  # noqa: E402

S, HQ, HKV, D, SCALE = 32768, 24, 2, 256, 1.0 / 16
BETTER = 0.98  # lean must take at most this fraction of the default's time to be adopted


def torch_part(record: Record, routes_np) -> None:
    import torch

    from qsa_torch import triton_qsa

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for h in (HQ, HKV, HKV, HQ))
    routes = torch.from_numpy(routes_np).cuda()
    default = triton_qsa.default_block_sizes(q.device, D, q.dtype)
    grads = {}
    for name, blocks in (("default", default), ("lean", dataclasses.replace(default, lean_backward=True))):
        def measure(blocks=blocks, name=name):
            residuals = triton_qsa.forward_with_residuals(q, k, v, routes, SCALE, block_sizes=blocks)
            run = lambda: triton_qsa.backward_from_residuals(  # noqa: E731
                do, q, k, v, *residuals, SCALE, routes.shape[2], block_sizes=blocks)
            grads[name] = run()
            return {"backward_ms": cuda_ms(run, reps=10, warmup=1), "blocks": str(blocks)}

        record.run("torch_triton", name, measure, margin_s=10)
    if len(grads) == 2:
        record.run("torch_triton", "lean_vs_default", lambda: {
            n: relative_error(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads["lean"], grads["default"])})


def jax_part(record: Record, routes_np) -> None:
    import jax
    import jax.numpy as jnp

    from qsa_jax.pallas_qsa import BlockSizes, pallas_sparse_gqa_attention

    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (1, S, h, D), jnp.bfloat16) for key, h in zip(keys, (HQ, HKV, HKV, HQ)))
    routes = jnp.asarray(routes_np.astype(np.int32))  # a jit argument: a constant would be folded for minutes
    default = BlockSizes.default(D, False, jnp.bfloat16)
    pull = jax.jit(lambda vjp, g: vjp(g))
    grads = {}
    for name, blocks in (("default", default), ("lean", dataclasses.replace(default, lean_backward=True))):
        def measure(blocks=blocks, name=name):
            forward = jax.jit(lambda a, b, c, r: jax.vjp(
                lambda a_, b_, c_: pallas_sparse_gqa_attention(a_, b_, c_, r, SCALE, block_sizes=blocks), a, b, c)[1])
            vjp = forward(q, k, v, routes)
            grads[name] = pull(vjp, do)
            return {"backward_ms": jax_ms(pull, vjp, do, reps=10, warmup=1), "blocks": str(blocks)}

        record.run("jax_pallas", name, measure, margin_s=15)
    if len(grads) == 2:
        record.run("jax_pallas", "lean_vs_default", lambda: {
            n: relative_error(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads["lean"], grads["default"])})


def verdict(results: dict) -> str:
    parts = []
    for section, label in (("torch_triton", "torch Triton"), ("jax_pallas", "JAX Pallas")):
        entries = results.get(section, {})
        times = {n: (entries.get(n) or {}).get("result", {}).get("backward_ms") for n in ("default", "lean")}
        agree = (entries.get("lean_vs_default") or {}).get("result") or {}
        if None in times.values():
            parts.append(f"{label}: not measured ({', '.join(n for n, t in times.items() if t is None)} missing)")
            continue
        change = times["lean"] / times["default"] - 1
        if agree and max(agree.values()) >= 1e-2:
            decision = "lean gradients disagree: delete lean"
        else:
            decision = "make lean the default" if times["lean"] <= BETTER * times["default"] else "delete lean"
        parts.append(f"{label} backward lean {times['lean']:.2f} ms vs default {times['default']:.2f} ms "
                     f"({change:+.1%}): {decision}")
    return "VERDICT " + "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "probe-out"))
    parser.add_argument("--budget-s", type=float, default=85.0)
    parser.add_argument("--parts", default="torch,jax")
    args = parser.parse_args()
    from qsa_common.generators import qsa_format_routes

    record = Record(os.path.join(args.out, "probe.json"), args.budget_s,
                    shape={"B": 1, "S": S, "heads": [HQ, HKV], "D": D, "dtype": "bfloat16", "routes": "qsa top_k 512"})
    routes_np = qsa_format_routes(S, top_k=512, rng=np.random.default_rng(S))[None]
    if "torch" in args.parts:
        torch_part(record, routes_np)
        import torch

        torch.cuda.empty_cache()  # the torch part's gradients are gone: give JAX the memory
    if "jax" in args.parts:
        jax_part(record, routes_np)
    record.results["verdict"] = verdict(record.results)
    record.save()
    log(record.results["verdict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
