"""Run a torch or JAX attention function on numpy inputs and return numpy results.

Used by the contract test subclasses: each backend's test class is a few lines
naming the function, and the same :class:`contract_base.BackendContract`
checks every backend.
"""

from __future__ import annotations

import numpy as np


def run_torch(fn, q, k, v, routes, scale, grad_out, dtype, *, device="cpu", backward=True):
    """``fn(query, key, value, routes, scale)`` in torch; returns float64 numpy results."""
    import torch

    tdtype = getattr(torch, dtype)
    leaves = [torch.tensor(x, dtype=tdtype, device=device, requires_grad=backward) for x in (q, k, v)]
    out = fn(*leaves, torch.from_numpy(np.ascontiguousarray(routes)).to(device), scale)
    assert out.dtype == tdtype and out.shape == leaves[0].shape
    if not backward:
        return (out.detach().double().cpu().numpy(),)
    out.backward(torch.tensor(grad_out, dtype=tdtype, device=device))
    return tuple(t.detach().double().cpu().numpy() for t in (out, *(x.grad for x in leaves)))


def run_jax(fn, q, k, v, routes, scale, grad_out, dtype, *, backward=True):
    """``fn(query, key, value, routes, scale)`` in JAX; returns float64 numpy results."""
    import jax
    import jax.numpy as jnp

    jdtype = jnp.dtype(dtype)
    args = [jnp.asarray(x, dtype=jdtype) for x in (q, k, v)]
    call = lambda q_, k_, v_: fn(q_, k_, v_, routes, scale)  # noqa: E731
    if not backward:
        out = call(*args)
        assert out.dtype == jdtype and out.shape == args[0].shape
        return (np.asarray(out, dtype=np.float64),)
    out, vjp = jax.vjp(call, *args)
    assert out.dtype == jdtype and out.shape == args[0].shape
    grads = vjp(jnp.asarray(grad_out, dtype=jdtype))
    return tuple(np.asarray(t, dtype=np.float64) for t in (out, *grads))
