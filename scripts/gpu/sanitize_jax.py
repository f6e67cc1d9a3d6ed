"""The JAX Pallas kernels alone, small, for compute-sanitizer (run on the GPU host).

    compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/gpu/sanitize_jax.py

Forward and backward (``jax.vjp``) of ``pallas_sparse_gqa_attention`` on small problems
covering the default flattened-heads tiling, padded tiles with split heads, fp32 tiles,
packed / padded / CP layouts and adversarial routes; each checked against the float64
numpy oracle, so nothing else of XLA's (no reference attention, no cuDNN) runs under
the sanitizer. Prints PROBE_OK when every case agrees.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402


def main() -> int:
    faulthandler.enable()
    import jax
    import jax.numpy as jnp

    from contract_base import random_inputs
    from qsa_common.layouts import make_problem
    from qsa_common.oracle import oracle_forward_backward, relative_error
    from qsa_jax.pallas_qsa import BlockSizes, pallas_sparse_gqa_attention

    print(jax.__version__, jax.devices(), flush=True)
    rng = np.random.default_rng(0)
    padded_split = BlockSizes(block_m=64, block_k=32, block_m_bwd=32, block_k_bwd=32)
    cases = [  # (problem, heads, dtype, block sizes, tolerance)
        (make_problem("packed", "qsa", seed=1, seq_len=128, top_k=8), (12, 1), "bfloat16", None, 1e-2),
        (make_problem("padded", "adversarial", seed=2, seq_len=64, width=12), (24, 2), "bfloat16",
         padded_split, 1e-2),
        (make_problem("cp", "random", seed=3, seq_len=96, width=16), (12, 1), "float32", None, 1e-4),
        (make_problem("packed", "adversarial", seed=4, seq_len=100, width=12), (24, 2), "bfloat16", None, 1e-2),
        (make_problem("packed", "adversarial", seed=5, seq_len=100, width=12), (12, 1), "bfloat16",
         dataclasses.replace(BlockSizes.default(256, False), lean_backward=True), 1e-2),
    ]
    worst = 0.0
    for problem, heads, dtype, blocks, tol in cases:
        q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, heads, 256, dtype)
        jdt = jnp.dtype(dtype)
        args = [jnp.asarray(x, jdt) for x in (q, k, v)]
        routes = problem.routes  # int64 numpy, huge IDs included: the API maps them to padding

        def f(a, b, c, routes=routes, blocks=blocks):
            return pallas_sparse_gqa_attention(a, b, c, routes, 1 / 16, block_sizes=blocks)

        out, pullback = jax.vjp(f, *args)
        grads = pullback(jnp.asarray(do, jdt))
        got = [np.asarray(x, np.float64) for x in (out, *grads)]
        want = oracle_forward_backward(q, k, v, problem.routes, 1 / 16, do)
        errs = [relative_error(g, w) for g, w in zip(got, want)]
        label = "default" if blocks is None else "lean" if blocks.lean_backward else "padded/split"
        print("probe", problem.layout, heads, dtype, label,
              ["%.2e" % e for e in errs], flush=True)
        worst = max(worst, max(e / tol for e in errs))
    print("PROBE_OK" if worst < 1 else "PROBE_NUMERICS_FAIL", flush=True)
    return 0 if worst < 1 else 2


if __name__ == "__main__":
    sys.exit(main())
