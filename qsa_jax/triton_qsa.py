"""Route-sparse GQA with the ``qsa_triton`` kernels, launched through jax-triton.

The same kernels, tiles, unions and launch configurations as ``qsa_torch.triton_qsa``:
both run ``qsa_triton.driver`` (union recipe, kernel choice, fixed-point steps) from the
same shapes and the same configuration table, each through its own small adapter
(``_triton_call``), so on one GPU the forward output and LSE equal torch's bit for bit;
dK/dV come from fp32 atomics in both, whose order varies from run to run, or, with
``deterministic=True``, from int64 fixed-point sums (``qsa_triton.fixed_point``): then
all three gradients are bitwise reproducible and equal torch's deterministic ones. The
algorithm is docs/design-token-gather.md. Differentiable through ``jax.custom_vjp``: the
forward keeps its output, LSE and route unions for the backward (the backward cuts the
unions into its own tiles where those are shorter; nothing is sorted twice).

jax-triton 0.3.1 is imported on first use; it runs on CUDA GPUs only (no interpret
mode: on CPU use ``implementation="pallas"`` with ``interpret=True``). No ``jax.vmap``
(jax-triton's kernel call has no batching rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qsa_common._extras import installed
from qsa_common.errors import BackendDeclined, UnsupportedShape
from qsa_triton import driver
from qsa_triton.config import BlockSizes, default_block_sizes
from qsa_triton.limits import decline
from qsa_triton.plan import Plan, default_plan, make_plan

from . import _triton_call
from ._triton_call import JaxAdapter, input_maxima
from .routes import gpu_capability, prepare_routes, validate_inputs

__all__ = ["BlockSizes", "build_unions", "checked_attention", "forward_with_lse", "input_maxima", "plan_for",
           "supports", "triton_sparse_gqa_attention"]


def _platform(x) -> str:
    """The platform ``x`` lives on (for tracers and host arrays, the default backend's)."""
    try:
        return next(iter(x.devices())).platform
    except Exception:  # a tracer, a NumPy array: no devices of its own
        return jax.default_backend()


def supports(query, key, value, selected_token_ids, *, softmax_scale=None,
             deterministic: bool | None = False) -> BackendDeclined | None:
    """The :class:`qsa_common.errors.BackendDeclined` this implementation raises for these
    (contract-valid) inputs, or None: UnsupportedShape for D > 256, UnsupportedDtype for
    float64, MissingRuntime without jax_triton, UnsupportedDevice off a CUDA GPU of
    compute capability 8.0+. Reads metadata only; the limits are ``qsa_triton.limits``'
    (``qsa_torch``'s too). ``softmax_scale`` and ``deterministic`` decline nothing."""
    return decline(query.shape[-1], jnp.dtype(query.dtype).name, runtime="jax_triton",
                   runtime_present=installed("jax_triton"), device=_platform(query),
                   capability=gpu_capability(query))


def build_unions(routes, kv_length: int, plan: Plan, launcher=None, *, padded: bool = True):
    """The forward's route unions ``(union, count, rowbits)`` of ``plan`` (int32; shapes
    ``[B, n, W]``, ``[B, n]``, ``[B, n, W]``), exactly as ``qsa_torch.triton_qsa`` builds
    them (``qsa_triton.driver.build_unions``). ``routes``: int32 ``[B, S_q, K]`` (int64
    with x64); IDs outside ``[0, kv_length)`` are padding. ``padded`` False leaves the
    entries past each count unwritten; padded unions hold -1 / 0 there."""
    ad = JaxAdapter(launcher or _triton_call.default_launcher(), wide_keys=jax.config.jax_enable_x64)
    u = driver.build_unions(ad, jnp.asarray(routes), kv_length, plan, padded=padded)
    return u.union, u.count, u.rowbits


def _forward(q, k, v, routes, scale, plan, ad):
    unions = driver.build_unions(ad, routes, k.shape[1], plan, padded=False)
    out, lse = driver.forward(ad, q, k, v, unions, scale, plan)
    return out, lse, (unions.union, unions.count, unions.rowbits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attention(q, k, v, routes, scale, plan, top_k, ad, deterministic):
    return _forward(q, k, v, routes, scale, plan, ad)[0]


def _attention_fwd(q, k, v, routes, scale, plan, top_k, ad, deterministic):
    out, lse, unions = _forward(q, k, v, routes, scale, plan, ad)
    return out, (q, k, v, out, lse, unions)


def _attention_bwd(scale, plan, top_k, ad, deterministic, residuals, do):
    q, k, v, out, lse, unions = residuals
    unions = driver.backward_unions(ad, driver.Unions(*unions, plan.rows_per_tile), plan, top_k, q.shape[1])
    dq, dk, dv = driver.backward(ad, q, k, v, out, lse, do, unions, scale, plan, deterministic=deterministic)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.jit, static_argnames=("scale", "plan", "ad", "deterministic"))
def _run(q, k, v, routes, *, scale, plan, ad, deterministic):
    return _attention(q, k, v, routes, scale, plan, routes.shape[2], ad, deterministic)


@functools.partial(jax.jit, static_argnames=("scale", "plan", "ad"))
def _run_forward(q, k, v, routes, *, scale, plan, ad):
    out, lse, _ = _forward(q, k, v, routes, scale, plan, ad)
    return out, lse


def plan_for(query, key, block_sizes: BlockSizes | None = None) -> Plan:
    """The plan the kernels run for these inputs: ``block_sizes``, by default the row of
    ``qsa_triton.config.default_block_sizes`` for the GPU ``query`` lives on (the table
    ``qsa_torch`` reads too)."""
    group, head_dim = query.shape[2] // key.shape[2], query.shape[3]
    dtype = jnp.dtype(query.dtype).name
    if block_sizes is None:
        return default_plan(group, head_dim, default_block_sizes(gpu_capability(query), head_dim, dtype),
                            query.shape[1])
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    plan = make_plan(group, head_dim, block_sizes)
    if not plan.pairs_fit(query.shape[1]):
        raise UnsupportedShape("the flat tiling indexes (row, head) pairs in int32: "
                               f"S_q * G = {query.shape[1] * group} is too many; use flatten_heads=False")
    return plan


def _adapter(query, launcher) -> JaxAdapter:
    """The adapter of this call, taken from the GPU ``query`` lives on, once, for the
    forward and the backward; ``launcher`` None: jax-triton's, after :func:`supports`."""
    if launcher is None:
        reason = supports(query, query, query, None)
    else:  # an injected launcher runs anywhere; the kernels' own limits still hold
        reason = decline(query.shape[-1], jnp.dtype(query.dtype).name, runtime="jax_triton", runtime_present=True,
                         device=_platform(query), capability=None, interpreted=True)
    if reason is not None:
        raise reason
    launcher = launcher or _triton_call.default_launcher()
    hopper = getattr(launcher, "gluon", False) and not launcher.interpreted and gpu_capability(query) == (9, 0)
    return JaxAdapter(launcher, hopper, jax.config.jax_enable_x64)


def checked_attention(query, key, value, routes, softmax_scale: float, *, deterministic: bool | None = False,
                      block_sizes: BlockSizes | None = None, launcher=None):
    """:func:`triton_sparse_gqa_attention` on inputs a dispatcher has already checked
    (``routes`` prepared, ``softmax_scale`` a float): no second validation."""
    ad = _adapter(query, launcher)
    return _run(query, key, value, jnp.asarray(routes), scale=softmax_scale, plan=plan_for(query, key, block_sizes),
                ad=ad, deterministic=bool(deterministic))


def _checked(query, key, value, selected_token_ids, softmax_scale):
    routes = prepare_routes(selected_token_ids)
    return routes, validate_inputs(query, key, value, routes, softmax_scale).scale


def triton_sparse_gqa_attention(query, key, value, selected_token_ids, softmax_scale: float | None = None, *,
                                block_sizes: BlockSizes | None = None, launcher=None,
                                deterministic: bool | None = None):
    """Route-sparse GQA with the ``qsa_triton`` kernels (forward and custom_vjp backward).

    Args:
        query: ``[B, S_q, Hq, D]`` bf16/f16/f32 on a CUDA GPU, D <= 256.
        key, value: ``[B, S_kv, Hkv, D]``, same dtype; Hq % Hkv == 0.
        selected_token_ids: ``[B, S_q, K]`` int32/int64 IDs; anything outside
            ``[0, S_kv)`` is padding and duplicates count once.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        block_sizes: a ``qsa_triton.BlockSizes`` (the one class both frameworks take),
            default :func:`plan_for`'s.
        launcher: how kernels are launched (default: ``jax_triton.triton_call``); tests
            inject one that runs the kernels in Triton's interpreter.
        deterministic: True: the backward's dK/dV as int64 fixed-point sums (bitwise
            reproducible, and equal to ``qsa_torch``'s deterministic gradients); False or
            None (JAX has no global switch): fp32 atomics. In both, a non-finite value in
            a row's query or output gradient reaches dK/dV only at the keys that row
            routes (NaN there); any other non-finite value met by the deterministic
            backward (a routed key/value row, an overflow) makes all of dK/dV NaN
            (``qsa_triton.fixed_point``).

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype; rows without routes are exactly 0 and add
        nothing to any gradient, whatever their query holds. dQ is bitwise reproducible;
        dK/dV only with ``deterministic``.

    Raises:
        InvalidInput / InvalidDtype: the contract's input checks; TypeError also for a
            ``deterministic`` that is neither a bool nor None.
        UnsupportedShape / UnsupportedDtype / UnsupportedDevice / MissingRuntime: what
            :func:`supports` returns (without an injected ``launcher``); UnsupportedShape
            also for sort keys that need int64 without x64 (S_kv * T >= 2**31).
    """
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {deterministic!r}")
    routes, scale = _checked(query, key, value, selected_token_ids, softmax_scale)
    return checked_attention(query, key, value, routes, scale, deterministic=deterministic,
                             block_sizes=block_sizes, launcher=launcher)


def forward_with_lse(query, key, value, selected_token_ids, softmax_scale: float | None = None, *,
                     block_sizes: BlockSizes | None = None, launcher=None):
    """``(out, lse)``: the forward's output and natural-log LSE ``[B, Hq, S_q]`` fp32
    (+inf for rows without routes), no autograd; what ``qsa_torch.triton_qsa.
    forward_with_residuals`` returns first, for bitwise comparisons across frameworks.
    Arguments and errors as :func:`triton_sparse_gqa_attention`."""
    routes, scale = _checked(query, key, value, selected_token_ids, softmax_scale)
    ad = _adapter(query, launcher)
    return _run_forward(query, key, value, jnp.asarray(routes), scale=scale, plan=plan_for(query, key, block_sizes),
                        ad=ad)
