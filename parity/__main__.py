"""``python -m parity``: run the references of both frameworks through every
layout and route family on identical numpy inputs and compare them with the
float64 oracle and with each other. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

from qsa_common.generators import FAMILIES
from qsa_common.layouts import LAYOUTS, make_problem
from qsa_common.oracle import oracle_forward_backward, relative_error

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def _torch_reference(q, k, v, routes, scale, do, dtype):
    import torch

    from qsa_torch import reference_sparse_gqa_attention

    leaves = [torch.tensor(x, dtype=getattr(torch, dtype), requires_grad=True) for x in (q, k, v)]
    out = reference_sparse_gqa_attention(*leaves, torch.from_numpy(routes), scale)
    out.backward(torch.tensor(do, dtype=out.dtype))
    return [t.detach().double().numpy() for t in (out, *(x.grad for x in leaves))]


def _jax_reference(q, k, v, routes, scale, do, dtype):
    import jax
    import jax.numpy as jnp

    from qsa_jax import reference

    args = [jnp.asarray(x, dtype=dtype) for x in (q, k, v)]
    out, vjp = jax.vjp(lambda *a: reference(*a, routes, scale), *args)
    return [np.asarray(t, dtype=np.float64) for t in (out, *vjp(jnp.asarray(do, dtype=dtype)))]


BACKENDS = {"torch-reference": _torch_reference, "jax-xla": _jax_reference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity", description=__doc__)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import ml_dtypes

    rng = np.random.default_rng(args.seed)
    failures = 0
    print(f"{'layout':8} {'family':12} {'dtype':9} {'backend':16} {'worst rel err':>14}  result")
    for layout, fam, dtype in itertools.product(LAYOUTS, FAMILIES, TOLERANCE):
        problem = make_problem(layout, fam, seed=int(rng.integers(2**31)), seq_len=args.seq_len, top_k=4)
        cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
        shape_q = problem.routes.shape[:2] + (4, 32)
        shape_kv = (problem.routes.shape[0], problem.kv_length, 2, 32)
        q, do = (rng.standard_normal(shape_q).astype(cast).astype(np.float64) for _ in range(2))
        k, v = (rng.standard_normal(shape_kv).astype(cast).astype(np.float64) for _ in range(2))
        want = oracle_forward_backward(q, k, v, problem.routes, 32**-0.5, do)
        results = {}
        for name, fn in BACKENDS.items():
            got = fn(q, k, v, problem.routes, 32**-0.5, do, dtype)
            results[name] = got
            err = max(relative_error(g, w) for g, w in zip(got, want))
            ok = err < TOLERANCE[dtype]
            failures += not ok
            print(f"{layout:8} {fam:12} {dtype:9} {name:16} {err:14.3e}  {'pass' if ok else 'FAIL'}")
        cross = max(relative_error(a, b) for a, b in zip(*results.values()))
        ok = cross < TOLERANCE[dtype]
        failures += not ok
        print(f"{layout:8} {fam:12} {dtype:9} {'torch vs jax':16} {cross:14.3e}  {'pass' if ok else 'FAIL'}")
    print(f"\n{'all cells pass' if not failures else f'{failures} cells FAIL'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
