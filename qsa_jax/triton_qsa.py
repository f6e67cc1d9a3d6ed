"""Route-sparse GQA with the ``qsa_triton`` kernels, launched through jax-triton.

The same kernels, tiles, unions and launch configurations as ``qsa_torch.triton_qsa``
(both are built by ``qsa_triton.plan`` / ``qsa_triton.launch`` from the same shapes and
the same configuration table), so on one GPU the forward output and LSE equal torch's
bit for bit; dK/dV come from fp32 atomics in both, whose order varies from run to run,
or, with ``deterministic=True``, from int64 fixed-point sums (``qsa_triton.fixed_point``):
then all three gradients are bitwise reproducible and equal torch's deterministic ones.
The algorithm is docs/design-token-gather.md. Differentiable through ``jax.custom_vjp``:
the forward keeps its output, LSE and route unions for the backward (the backward cuts
the unions into its own tiles where those are shorter; nothing is sorted twice).

jax-triton 0.3.1 is imported on first use; it runs on CUDA GPUs only (no interpret
mode: on CPU use ``implementation="pallas"`` with ``interpret=True``). No ``jax.vmap``
(jax-triton's kernel call has no batching rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qsa_triton import launch as spec
from qsa_triton.config import BlockSizes, default_block_sizes
from qsa_triton.plan import Plan, backward_cut, default_plan, make_plan, union_recipe

from . import _triton_call
from ._triton_call import cut_unions, operand, step_unions
from .routes import UnsupportedDtype, UnsupportedShape, gpu_capability, on_gpu, prepare_routes, validate_inputs

__all__ = ["BlockSizes", "build_unions", "forward_with_lse", "input_maxima", "plan_for", "triton_sparse_gqa_attention"]

_DTYPES = ("float16", "bfloat16", "float32")


def build_unions(routes, kv_length: int, plan: Plan, launcher=None, *, padded: bool = True):
    """The forward's route unions ``(union, count, rowbits)`` of ``plan`` (int32; shapes
    ``[B, n, W]``, ``[B, n]``, ``[B, n, W]``), exactly as ``qsa_torch.triton_qsa`` builds
    them (``qsa_triton.plan.union_recipe``). ``routes``: int32 ``[B, S_q, K]`` (int64
    with x64); IDs outside ``[0, kv_length)`` are padding. ``padded`` False leaves the
    entries past each count unwritten (the forward's own unions: only its kernels read
    them); padded unions hold -1 / 0 there."""
    launcher = launcher or _triton_call.default_launcher()
    routes = jnp.asarray(routes)
    bsz, s_q, k = routes.shape
    step, cut = union_recipe(plan, s_q, k, kv_length, bsz, wide_keys=jax.config.jax_enable_x64)
    unions = step_unions(routes, kv_length, step, plan.max_grid_y, launcher, padded=padded and cut is None)
    return unions if cut is None else cut_unions(unions, cut, plan.max_grid_y, launcher, padded=padded)


def _hopper(launcher, q) -> bool:
    """Whether ``launcher`` launches compiled Gluon kernels on an sm_90 GPU (where the
    warp-specialized Hopper kernels run, for operands in their scope)."""
    return getattr(launcher, "gluon", False) and not launcher.interpreted and gpu_capability(q) == (9, 0)


def _forward_launch(q, k, v, union_shape, scale, plan, launcher, hopper: bool):
    """The forward's launch: where ``hopper`` (:func:`_hopper`), the warp-specialized
    kernel if the operands are in its scope (as ``qsa_torch`` does; both kernels give the
    same bits), else ``forward.py``'s."""
    dtype = jnp.dtype(q.dtype).name
    if hopper:
        launch = spec.forward_sm90_launch(plan, operand(q), operand(k), operand(v), union_shape, scale, dtype)
        if launch is not None:
            return launch
    return spec.forward_launch(plan, operand(q), operand(k), operand(v), union_shape, scale, dtype,
                               interpreted=launcher.interpreted)


def _forward(q, k, v, routes, scale, plan, launcher, hopper: bool):
    unions = build_unions(routes, k.shape[1], plan, launcher, padded=False)
    launch = _forward_launch(q, k, v, tuple(unions[0].shape), scale, plan, launcher, hopper)
    union, count, rowbits = unions
    out = launcher(launch, dict(Q=q, K=k, V=v, UNION=union, COUNT=count, ROWBITS=rowbits))
    return out["O"], out["LSE"], unions


def input_maxima(q, do, v, lse):
    """MAXIMA of the deterministic backward: f32 ``[3]``, max|q| and max|do| over the
    (row, head) pairs with routes (``lse`` ``[B, Hq, S_q]`` not +inf: the backward never reads
    the others), max|v| over the rows ``[b, j, g, :]`` whose own maximum is finite
    (``qsa_torch`` computes the same bits: maxima round nothing)."""
    routed = (lse != jnp.inf).transpose(0, 2, 1)

    def largest_routed(x):
        rows = jnp.max(jnp.abs(x), axis=-1)
        return jnp.max(jnp.where(routed, rows, jnp.zeros_like(rows))).astype(jnp.float32)

    rows = jnp.max(jnp.abs(v), axis=-1)
    finite_rows = jnp.where(jnp.isfinite(rows), rows, jnp.zeros_like(rows))
    return jnp.stack([largest_routed(q), largest_routed(do), jnp.max(finite_rows).astype(jnp.float32)])


def _backward(q, k, v, out, lse, unions, do, scale, plan, top_k, launcher, deterministic, hopper: bool):
    """``hopper``: the forward's :func:`_hopper`, carried here as a static argument, since
    a backward rule may be traced where the default device (which tracers follow) differs."""
    union, count, rowbits = unions
    cut = backward_cut(plan, q.shape[1], top_k, plan.rows_per_tile, union.shape[2])
    if cut is not None:
        union, count, rowbits = cut_unions(unions, cut, plan.max_grid_y, launcher, padded=False)
    # MAXIMA is read by the deterministic kernels only (LSE stands in for it otherwise)
    maxima = input_maxima(q, do, v, lse) if deterministic else lse
    arrays = dict(Q=q, K=k, V=v, O=out, DO=do, LSE=lse, UNION=union, COUNT=count, ROWBITS=rowbits, MAXIMA=maxima)
    launch = None
    if hopper:
        launch = spec.backward_sm90_launch(plan, operand(q), operand(k), operand(v), operand(out), operand(do),
                                           tuple(union.shape), scale, jnp.dtype(q.dtype).name,
                                           deterministic=deterministic)
    if launch is None:
        launch = spec.backward_launch(plan, operand(q), operand(k), operand(v), operand(out), operand(do),
                                      tuple(union.shape), scale, jnp.dtype(q.dtype).name,
                                      interpreted=launcher.interpreted, deterministic=deterministic)
    grads = launcher(launch, arrays)
    if not deterministic:
        return grads["DQ"], grads["DK"].astype(k.dtype), grads["DV"].astype(v.dtype)
    convert = spec.fixed_point_launch(tuple(k.shape), jnp.dtype(k.dtype).name, scale, q.shape[1] * plan.group,
                                      interpreted=launcher.interpreted)
    fixed = launcher(convert, dict(DK_FIXED=grads["DK"], DV_FIXED=grads["DV"], MAXIMA=maxima, FLAG=grads["FLAG"]))
    return grads["DQ"], fixed["DK"], fixed["DV"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _attention(q, k, v, routes, scale, plan, top_k, launcher, deterministic, hopper):
    return _forward(q, k, v, routes, scale, plan, launcher, hopper)[0]


def _attention_fwd(q, k, v, routes, scale, plan, top_k, launcher, deterministic, hopper):
    out, lse, unions = _forward(q, k, v, routes, scale, plan, launcher, hopper)
    return out, (q, k, v, out, lse, unions)


def _attention_bwd(scale, plan, top_k, launcher, deterministic, hopper, residuals, do):
    q, k, v, out, lse, unions = residuals
    dq, dk, dv = _backward(q, k, v, out, lse, unions, do, scale, plan, top_k, launcher, deterministic, hopper)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.jit, static_argnames=("scale", "plan", "launcher", "deterministic", "hopper"))
def _run(q, k, v, routes, *, scale, plan, launcher, deterministic, hopper):
    return _attention(q, k, v, routes, scale, plan, routes.shape[2], launcher, deterministic, hopper)


@functools.partial(jax.jit, static_argnames=("scale", "plan", "launcher", "hopper"))
def _run_forward(q, k, v, routes, *, scale, plan, launcher, hopper):
    out, lse, _ = _forward(q, k, v, routes, scale, plan, launcher, hopper)
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
        raise NotImplementedError(f"block_sizes for the triton implementation must be a qsa_triton.BlockSizes, "
                                  f"got {type(block_sizes).__name__}")
    plan = make_plan(group, head_dim, block_sizes)
    if not plan.pairs_fit(query.shape[1]):
        raise NotImplementedError(f"flatten_heads indexes (row, head) pairs in int32: S_q * G = "
                                  f"{query.shape[1] * group}")
    return plan


def _setup(query, key, value, selected_token_ids, softmax_scale, block_sizes, launcher):
    """Routes, scale, plan, launcher and the Hopper choice (:func:`_hopper`), all taken
    from the GPU ``query`` lives on, once, for the forward and the backward."""
    routes = prepare_routes(selected_token_ids)
    checked = validate_inputs(query, key, value, routes, softmax_scale)
    if jnp.dtype(query.dtype).name not in _DTYPES:
        raise UnsupportedDtype(f"the Triton kernels take bf16/f16/f32, not {jnp.dtype(query.dtype).name}")
    if checked.dims.head_dim > 256:
        raise UnsupportedShape(f"the Triton kernels support head dim <= 256, got {checked.dims.head_dim}")
    if launcher is None:
        launcher = _triton_call.default_launcher()
        if not on_gpu(query):
            raise NotImplementedError("jax-triton launches on CUDA GPUs only; the inputs are not on one "
                                      "(implementation='pallas' with interpret=True runs on CPU)")
    return jnp.asarray(routes), checked.scale, plan_for(query, key, block_sizes), launcher, _hopper(launcher, query)


def triton_sparse_gqa_attention(query, key, value, selected_token_ids, softmax_scale: float | None = None, *,
                                block_sizes: BlockSizes | None = None, launcher=None, deterministic: bool = False):
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
        deterministic: the backward's dK/dV as int64 fixed-point sums (bitwise
            reproducible, and equal to ``qsa_torch``'s deterministic gradients) instead
            of fp32 atomics. A non-finite value met by that backward makes all of dK/dV
            NaN (``qsa_triton.fixed_point``).

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype; rows without routes are exactly 0 and add
        nothing to any gradient, whatever their query holds. dQ is bitwise reproducible;
        dK/dV only with ``deterministic``. A non-finite K/V row that one row of a program
        routes to reaches that program's other rows (0 * NaN in P @ V); rows of other
        programs are unaffected.

    Raises:
        TypeError / ValueError: the contract's input checks.
        ImportError: jax-triton is not installed or cannot load (first use only).
        UnsupportedDtype (a TypeError and NotImplementedError): float64.
        UnsupportedShape (a ValueError and NotImplementedError): D > 256.
        NotImplementedError: inputs off the GPU, other block sizes' classes, or sort keys
            that need int64 without x64 (S_kv * T >= 2**31).
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    routes, scale, plan, launcher, hopper = _setup(query, key, value, selected_token_ids, softmax_scale,
                                                   block_sizes, launcher)
    return _run(query, key, value, routes, scale=scale, plan=plan, launcher=launcher, deterministic=deterministic,
                hopper=hopper)


def forward_with_lse(query, key, value, selected_token_ids, softmax_scale: float | None = None, *,
                     block_sizes: BlockSizes | None = None, launcher=None):
    """``(out, lse)``: the forward's output and natural-log LSE ``[B, Hq, S_q]`` fp32
    (+inf for rows without routes), no autograd; what ``qsa_torch.triton_qsa.
    forward_with_residuals`` returns first, for bitwise comparisons across frameworks.
    Arguments and errors as :func:`triton_sparse_gqa_attention`."""
    routes, scale, plan, launcher, hopper = _setup(query, key, value, selected_token_ids, softmax_scale,
                                                   block_sizes, launcher)
    return _run_forward(query, key, value, routes, scale=scale, plan=plan, launcher=launcher, hopper=hopper)


def supports(query, key, value, selected_token_ids, *, softmax_scale=None, deterministic: bool = False):
    """Why the Triton kernels through jax-triton cannot take these (valid) inputs, or
    None: float64 (UnsupportedDtype), head dim > 256 (UnsupportedShape). Deterministic
    gradients are available."""
    del key, value, selected_token_ids, softmax_scale, deterministic
    if jnp.dtype(query.dtype).name not in _DTYPES:
        return UnsupportedDtype(f"the Triton kernels take bf16/f16/f32, not {jnp.dtype(query.dtype).name}")
    if query.shape[-1] > 256:
        return UnsupportedShape(f"the Triton kernels support head dim <= 256, got {query.shape[-1]}")
    return None
