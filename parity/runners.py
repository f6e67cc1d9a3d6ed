"""Run one backend, or the oracle, on one case's numpy inputs.

Inputs are float32 numpy arrays whose values are already representable in
the case's dtype, so every framework and the oracle see identical numbers.
Results come back as torch tensors on the *compare device* (the GPU when
torch has one, else the CPU): float32 for backends (exact for bf16/fp16/fp32
results), float64 for the oracle. Comparisons then run on that device, which
matters at GPU sizes (hundreds of MB per tensor).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["CaseInputs", "ContractViolation", "run_backend", "run_forward_lse", "oracle", "relative_error",
           "max_abs_diff"]

QUANTITIES = ("out", "dq", "dk", "dv")

# Dense oracle up to this many score elements (B * Hq * S_q * S_kv); beyond it
# the torch reference runs in float64 instead (the dense oracle is O(S^2)).
DENSE_ORACLE_LIMIT = 1 << 24


class ContractViolation(AssertionError):
    """A backend returned something the contract forbids (dtype, shape, missing grad)."""


@dataclass
class CaseInputs:
    """q ``[B,S_q,Hq,D]``, k/v ``[B,S_kv,Hkv,D]``, do like q (float32), routes ``[B,S_q,K]`` int64."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    routes: np.ndarray
    scale: float


def compare_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _tensor(x: np.ndarray, device: str, dtype):
    """A fresh torch tensor (never sharing the numpy buffer: backends must not alter inputs)."""
    import torch

    host = x.copy() if device == "cpu" else np.ascontiguousarray(x)
    return torch.from_numpy(host).to(device).to(dtype)


def _run_torch(fn, inputs: CaseInputs, dtype: str, backward: bool):
    import torch

    device = compare_device()
    tdtype = getattr(torch, dtype)
    leaves = [_tensor(x, device, tdtype).requires_grad_(backward)
              for x in (inputs.q, inputs.k, inputs.v)]
    routes = _tensor(inputs.routes, device, torch.int64)
    out = fn(*leaves, routes, inputs.scale)
    if out.dtype != tdtype or tuple(out.shape) != inputs.q.shape:
        raise ContractViolation(f"output is {out.dtype} {tuple(out.shape)}, "
                                f"expected {tdtype} {inputs.q.shape}")
    if not backward:
        return (out.detach().float(),)
    out.backward(_tensor(inputs.do, device, tdtype))
    for name, leaf in zip(("query", "key", "value"), leaves):
        if leaf.grad is None:
            raise ContractViolation(f"no gradient reached {name}")
    return tuple(t.detach().float() for t in (out, *(x.grad for x in leaves)))


def _jax_to_torch(x):
    import jax.numpy as jnp
    import torch

    x = x.astype(jnp.float32)
    if compare_device() == "cuda" and next(iter(x.devices())).platform == "gpu":
        try:
            return torch.from_dlpack(x)  # zero-copy: large results stay on the GPU
        except Exception:  # noqa: BLE001 -- any DLPack incompatibility: go through the host
            pass
    return torch.from_numpy(np.array(x)).to(compare_device())


@functools.lru_cache(maxsize=64)
def _jitted(fn, scale: float, backward: bool):
    """One jitted forward (or forward+VJP) per (function, scale): compiled once per shape."""
    import jax

    def forward(q, k, v, r):
        return fn(q, k, v, r, scale)

    def forward_backward(q, k, v, r, do):
        out, vjp = jax.vjp(lambda a, b, c: forward(a, b, c, r), q, k, v)
        return (out, *vjp(do))

    return jax.jit(forward_backward if backward else forward)


def _run_jax(fn, inputs: CaseInputs, dtype: str, backward: bool):
    import jax
    import jax.numpy as jnp

    from qsa_jax.routes import prepare_routes

    jdtype = jnp.dtype(dtype)
    q, k, v, do = (jax.device_put(x).astype(jdtype) for x in (inputs.q, inputs.k, inputs.v, inputs.do))
    routes = jax.device_put(prepare_routes(inputs.routes))
    if backward:
        results = _jitted(fn, inputs.scale, True)(q, k, v, routes, do)
    else:
        results = (_jitted(fn, inputs.scale, False)(q, k, v, routes),)
    out = results[0]
    if out.dtype != jdtype or tuple(out.shape) != inputs.q.shape:
        raise ContractViolation(f"output is {out.dtype} {tuple(out.shape)}, "
                                f"expected {jdtype} {inputs.q.shape}")
    return tuple(_jax_to_torch(t) for t in results)


def run_backend(backend, inputs: CaseInputs, dtype: str, *, backward: bool):
    """``(out, dq, dk, dv)`` (or ``(out,)``) of ``backend`` as float32 torch tensors."""
    fn = backend.load()
    runner = _run_torch if backend.framework == "torch" else _run_jax
    return runner(fn, inputs, dtype, backward)


def run_forward_lse(backend, inputs: CaseInputs, dtype: str):
    """``(out, lse)`` of ``backend``'s forward without autograd (``Backend.forward_lse``),
    as float32 torch tensors on the compare device (exact for 16-bit outputs)."""
    fn = backend.forward_lse()
    if backend.framework == "torch":
        import torch

        tdtype = getattr(torch, dtype)
        device = compare_device()
        with torch.no_grad():
            out, lse = fn(*(_tensor(x, device, tdtype) for x in (inputs.q, inputs.k, inputs.v)),
                          _tensor(inputs.routes, device, torch.int64), inputs.scale)[:2]
        return out.float(), lse.float()
    import jax
    import jax.numpy as jnp

    from qsa_jax.routes import prepare_routes

    jdtype = jnp.dtype(dtype)
    q, k, v = (jax.device_put(x).astype(jdtype) for x in (inputs.q, inputs.k, inputs.v))
    out, lse = fn(q, k, v, jax.device_put(prepare_routes(inputs.routes)), inputs.scale)[:2]
    return _jax_to_torch(out), _jax_to_torch(lse)


def max_abs_diff(a, b) -> float:
    """``max |a - b|`` in float64: 0 where the values are equal (equal infinities
    included, as in the LSE of rows without routes), inf where either holds a NaN or
    the shapes differ."""
    import torch

    if a.shape != b.shape:
        return float("inf")
    a, b = a.to(torch.float64), b.to(device=a.device, dtype=torch.float64)
    d = torch.where(a == b, 0.0, (a - b).abs())
    if bool(torch.isnan(d).any()):
        return float("inf")
    return float(d.max()) if d.numel() else 0.0


def oracle(inputs: CaseInputs) -> tuple[tuple, str]:
    """Float64 ``(out, dq, dk, dv)`` on the compare device, and which oracle made them.

    Small problems use the dense float64 oracle of :mod:`qsa_common.oracle`; large
    ones the torch reference computed in float64 (on the GPU when there is one).
    """
    import torch

    device = compare_device()
    b, s_q, hq, _ = inputs.q.shape
    s_kv = inputs.k.shape[1]
    if b * hq * s_q * s_kv <= DENSE_ORACLE_LIMIT:
        from qsa_common.oracle import oracle_forward_backward

        want = oracle_forward_backward(inputs.q, inputs.k, inputs.v, inputs.routes, inputs.scale,
                                       inputs.do)
        return tuple(torch.from_numpy(np.ascontiguousarray(w)).to(device) for w in want), "dense"
    from qsa_torch import reference_sparse_gqa_attention

    leaves = [_tensor(x, device, torch.float64).requires_grad_() for x in (inputs.q, inputs.k, inputs.v)]
    routes = _tensor(inputs.routes, device, torch.int64)
    out = reference_sparse_gqa_attention(*leaves, routes, inputs.scale)
    out.backward(_tensor(inputs.do, device, torch.float64))
    results = tuple(t.detach() for t in (out, *(x.grad for x in leaves)))
    return results, f"torch-reference-float64-{device}"


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in float64 on the tensors' device.

    Same rule as :func:`qsa_common.oracle.relative_error` (inf for NaN/inf in
    ``actual``; the absolute norm when ``expected`` is zero), for torch tensors
    that may live on the GPU.
    """
    import torch

    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a = actual.to(torch.float64)
    e = expected.to(device=a.device, dtype=torch.float64)
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    ref = float(torch.linalg.vector_norm(e))
    diff = float(torch.linalg.vector_norm(a - e))
    return diff / ref if ref > 0 else diff
