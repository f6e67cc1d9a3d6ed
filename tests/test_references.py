"""The torch and JAX references against the float64 oracle, via the shared contract base."""

from __future__ import annotations

import numpy as np
import pytest
from contract_base import BackendContract, UnroutedRowsIsolated, random_inputs
from runners import run_jax, run_torch

from qsa_common.layouts import make_problem
from qsa_common.oracle import oracle_forward_backward, relative_error


class TestTorchReference(UnroutedRowsIsolated, BackendContract):
    dtypes = ("float32", "bfloat16")

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        from qsa_torch import reference_sparse_gqa_attention

        fn = lambda *a: reference_sparse_gqa_attention(*a, chunk_rows=5)  # noqa: E731
        return run_torch(fn, q, k, v, routes, scale, grad_out, dtype)


class TestJaxReference(UnroutedRowsIsolated, BackendContract):
    dtypes = ("float32", "bfloat16")

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        from qsa_jax import reference_sparse_gqa_attention as reference

        fn = lambda *a: reference(*a, chunk_rows=5)  # noqa: E731
        return run_jax(fn, q, k, v, routes, scale, grad_out, dtype)


def test_torch_reference_accepts_strided_inputs():
    import torch

    from qsa_torch import reference_sparse_gqa_attention

    rng = np.random.default_rng()
    problem = make_problem("padded", "adversarial", seed=int(rng.integers(2**31)), seq_len=24, width=8)
    q, k, v, do = random_inputs(rng, problem.routes, 24, (4, 2), 8, "float32")
    # [B,S,H,D] views over [B,H,S,D] storage, and routes as a strided slice
    tq, tk, tv = (torch.tensor(x.transpose(0, 2, 1, 3).copy()).transpose(1, 2) for x in (q, k, v))
    wide = torch.from_numpy(np.repeat(problem.routes, 2, axis=-1))
    routes = wide[..., ::2]
    assert not tq.is_contiguous() and not routes.is_contiguous()
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    out = reference_sparse_gqa_attention(tq, tk, tv, routes)
    out.backward(torch.tensor(do))
    want = oracle_forward_backward(q, k, v, problem.routes, 8**-0.5, do)
    for got, ref in zip((out, tq.grad, tk.grad, tv.grad), want):
        assert relative_error(got.detach().double().numpy(), ref) < 1e-5


def test_jax_reference_under_jit_and_vmap():
    import jax
    import jax.numpy as jnp

    from qsa_jax import reference_sparse_gqa_attention as reference

    rng = np.random.default_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=32, top_k=2)
    q, k, v, do = random_inputs(rng, problem.routes, 32, (2, 1), 8, "float32")
    stacked = [jnp.asarray(np.stack([x, 2 * x]), jnp.float32) for x in (q, k, v, do)]
    routes = jnp.asarray(problem.routes.astype(np.int32))

    def forward_backward(a, b, c, g):  # out and (dq, dk, dv) of one example
        out, vjp = jax.vjp(lambda a, b, c: reference(a, b, c, routes, 0.5), a, b, c)
        return (out, *vjp(g))

    batched = jax.jit(jax.vmap(forward_backward))(*stacked)
    for i, scale_up in enumerate((1, 2)):
        want = oracle_forward_backward(scale_up * q, scale_up * k, scale_up * v, problem.routes, 0.5, scale_up * do)
        for name, got, ref in zip(("out", "dq", "dk", "dv"), batched, want):
            assert relative_error(np.asarray(got[i]), ref) < 1e-5, (name, i)


@pytest.mark.parametrize("layout", ["padded", "packed", "cp"])
def test_frameworks_agree_on_identical_inputs(layout):
    import jax
    import jax.numpy as jnp
    import torch

    from qsa_jax import reference_sparse_gqa_attention as jax_reference
    from qsa_torch import reference_sparse_gqa_attention

    rng = np.random.default_rng()
    problem = make_problem(layout, "adversarial", seed=int(rng.integers(2**31)), seq_len=32, width=12, rank=1)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (4, 2), 16, "float32")
    leaves = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in (q, k, v)]
    t_out = reference_sparse_gqa_attention(*leaves, torch.from_numpy(problem.routes))
    t_out.backward(torch.tensor(do, dtype=torch.float32))
    j_out, vjp = jax.vjp(lambda a, b, c: jax_reference(a, b, c, problem.routes),
                         *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    j_grads = vjp(jnp.asarray(do, jnp.float32))
    for name, j, t in zip(("out", "dq", "dk", "dv"), (j_out, *j_grads), (t_out, *(x.grad for x in leaves))):
        assert relative_error(np.asarray(j), t.detach().numpy()) < 1e-6, name
