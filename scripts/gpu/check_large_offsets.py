"""Inputs past 2**31 elements: B copies of one batch row through each backend.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 scripts/gpu/check_large_offsets.py --framework torch --out t.json
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 scripts/gpu/check_large_offsets.py --framework jax --out j.json
    ... --case name=B,S,HQ,HKV,D (repeatable: other shapes) --implementations pallas (JAX)

Every copy's output and gradients must equal the first copy's (bitwise for out and dq,
which one program computes; dK/dV within 1e-3, their fp32 atomics add in any order), and
the last copy's out and dq on up to 64 sampled rows must match the float32 reference computed on
those rows alone (1e-2, bf16). An element offset that wrapped at 2**31 would read another
batch row's data, or outside the tensor, for the later copies. Cases (bf16, routes: a
sliding window of W = 2052 keys, row i routing i - W + 1 .. i; the route tensor's batch
stride is 0 in torch):

* (24,2) D=256 B=4 S=131072: the Hopper kernels; Q holds 3.2e9 elements;
* (64,8) D=128 B=5 S=65536: the generic kernels; Q holds 2.7e9 elements.
"""

from __future__ import annotations

import argparse
import time

from gpu_common import Record, log, relative_error

CASES = {"hopper": (4, 131072, 24, 2, 256), "generic": (5, 65536, 64, 8, 128)}
WIDTH = 2052
SAMPLES = 64


def _rows(s):
    import numpy as np

    return np.unique(np.concatenate([np.linspace(0, s - 1, SAMPLES - 1).astype(np.int64), [s - 1]]))


def _compare_copies(grads: dict, equal) -> dict:
    """The B batch copies against the first: out and dq bitwise (``equal``), dK/dV (fp32
    atomics, summation order free) by their largest relative error."""
    result = {}
    for label, t in grads.items():
        if label in ("out", "dq"):
            result[f"{label} copies bitwise"] = all(bool(equal(t[j], t[0])) for j in range(1, t.shape[0]))
        else:
            result[f"{label} copies max rel"] = max(relative_error(t[j], t[0]) for j in range(1, t.shape[0]))
    return result


def run_torch(record: Record) -> None:
    import torch

    import qsa_torch

    for name, (b, s, hq, hkv, d) in CASES.items():
        def case(b=b, s=s, hq=hq, hkv=hkv, d=d):
            gen = torch.Generator(device="cuda").manual_seed(0)
            ones = [torch.randn(1, s, h, d, generator=gen, device="cuda", dtype=torch.bfloat16)
                    for h in (hq, hkv, hkv, hq)]
            q, k, v, do = (x.expand(b, -1, -1, -1).contiguous() for x in ones)
            del ones
            i = torch.arange(s, device="cuda")[:, None] - torch.arange(WIDTH, device="cuda")[None]
            routes = torch.where(i >= 0, i, -1).to(torch.int32)[None].expand(b, -1, -1)
            del i
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            start = time.perf_counter()
            out = qsa_torch.sparse_gqa_attention(q, k, v, routes, backend="triton")
            out.backward(do)
            torch.cuda.synchronize()
            result = {"seconds": time.perf_counter() - start, "q_elements": q.numel()}
            grads = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
            result.update(_compare_copies(grads, torch.equal))
            rows = torch.from_numpy(_rows(s)).cuda()
            leaves = [x.detach()[-1:].float() for x in (q, k, v)]
            sub = leaves[0][:, rows].requires_grad_()
            ref = qsa_torch.reference_sparse_gqa_attention(sub, leaves[1], leaves[2], routes[-1:, rows])
            ref.backward(do[-1:, rows].float())
            result["out sampled vs reference"] = relative_error(out.detach()[-1:, rows], ref)
            result["dq sampled vs reference"] = relative_error(q.grad[-1:, rows], sub.grad)
            del out, q, k, v, do, grads
            torch.cuda.empty_cache()
            return result

        record.run("torch", name, case)


def run_jax(record: Record, implementations=("triton", "pallas")) -> None:
    import jax
    import jax.numpy as jnp

    import qsa_jax

    for impl in implementations:
        for name, (b, s, hq, hkv, d) in CASES.items():
            def case(impl=impl, b=b, s=s, hq=hq, hkv=hkv, d=d):
                keys = jax.random.split(jax.random.key(0), 4)
                q, k, v, do = (jnp.broadcast_to(jax.random.normal(kk, (1, s, h, d), jnp.bfloat16), (b, s, h, d))
                               for kk, h in zip(keys, (hq, hkv, hkv, hq)))
                i = jnp.arange(s)[:, None] - jnp.arange(WIDTH)[None]
                routes = jnp.broadcast_to(jnp.where(i >= 0, i, -1).astype(jnp.int32)[None], (b, s, WIDTH))

                @jax.jit
                def step(q, k, v, do, routes):
                    out, pull = jax.vjp(lambda a, bb, c: qsa_jax.sparse_gqa_attention(
                        a, bb, c, routes, implementation=impl), q, k, v)
                    return (out, *pull(do))

                start = time.perf_counter()
                out, dq, dk, dv = jax.block_until_ready(step(q, k, v, do, routes))
                result = {"seconds (with compile)": time.perf_counter() - start, "q_elements": q.size}
                result.update(_compare_copies({"out": out, "dq": dq, "dk": dk, "dv": dv}, jnp.array_equal))
                rows = jnp.asarray(_rows(s))
                f32 = [x[-1:].astype(jnp.float32) for x in (q, k, v)]
                ref, pull = jax.vjp(lambda a: qsa_jax.sparse_gqa_attention(
                    a, f32[1], f32[2], routes[-1:, rows], implementation="xla"), f32[0][:, rows])
                (ref_dq,) = pull(do[-1:, rows].astype(jnp.float32))
                result["out sampled vs reference"] = relative_error(out[-1:, rows], ref)
                result["dq sampled vs reference"] = relative_error(dq[-1:, rows], ref_dq)
                return result

            record.run(f"jax-{impl}", name, case)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=("torch", "jax"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--case", action="append", default=[], metavar="NAME=B,S,HQ,HKV,D",
                        help="run these shapes instead of the default cases")
    parser.add_argument("--implementations", default="triton,pallas", help="JAX implementations")
    args = parser.parse_args()
    if args.case:
        CASES.clear()
        for spec in args.case:
            name, dims = spec.split("=")
            CASES[name] = tuple(int(x) for x in dims.split(","))
    record = Record(args.out, budget_s=args.budget_s, framework=args.framework, width=WIDTH,
                    shapes=[f"{name}=B,S,HQ,HKV,D={dims}" for name, dims in CASES.items()])
    if args.framework == "torch":
        run_torch(record)
    else:
        run_jax(record, tuple(args.implementations.split(",")))
    failed = []
    for section, entries in record.results.items():
        if not isinstance(entries, dict):
            continue
        for name, entry in entries.items():
            result = entry.get("result") or {}
            good = entry.get("ok") and all(
                value is True if key.endswith("bitwise") else value < (1e-3 if "copies" in key else 1e-2)
                for key, value in result.items() if "copies" in key or "reference" in key)
            if not good:
                failed.append(f"{section}/{name}")
    log("LARGE_OFFSETS_OK" if not failed else f"LARGE_OFFSETS_FAIL {failed}")


if __name__ == "__main__":
    main()
