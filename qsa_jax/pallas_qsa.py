"""Route-sparse GQA in Pallas (Triton lowering) with ``jax.custom_vjp``.

The algorithm is docs/design-token-gather.md: query rows are grouped in tiles of
T consecutive rows; each tile walks the sorted union of its rows' routes in
chunks of ``block_k`` IDs, gathering each K/V row once for all T * G (row, head)
pairs of one KV head, with a per-ID bitmask saying which rows route to it.

* forward kernel: online softmax in fp32, output and natural-log LSE;
* backward kernel (one fused pass): dQ kept on chip, dK/dV accumulated per
  union chunk into fp32 buffers with atomic adds (IDs in a chunk are distinct).

Work is proportional to S_q * |union| (about 1.5 K for QSA-format routes), never
S^2. Inputs are validated by :func:`qsa_jax.attention.sparse_gqa_attention`;
:func:`pallas_sparse_gqa_attention` validates too when called directly.

JAX's own implementation of the algorithm whose Triton kernels ``qsa_triton`` holds
(``implementation="triton"``), sharing their tiling arithmetic. Module layout: this
module is the API, launches and custom_vjp; ``_pallas_tiles`` the geometry, unions
and arrangement; ``_pallas_kernels`` the kernels. Launch grids are (tiles, batch, KV
heads); Pallas' Triton lowering folds the y and z axes into x past CUDA's 65535.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qsa_common.errors import (
    BackendDeclined,
    DeterminismUnavailable,
    UnsupportedDevice,
    UnsupportedDtype,
    UnsupportedOption,
    UnsupportedShape,
)
from qsa_triton.config import block_shared_memory

from ._pallas_kernels import backward_kernel, forward_kernel
from ._pallas_tiles import Geometry as _Geometry
from ._pallas_tiles import arrange_queries as _arrange_queries
from ._pallas_tiles import flat_route_union, tile_route_union
from ._pallas_tiles import pad_head_dim as _pad_head_dim
from ._pallas_tiles import restore_queries as _restore_queries
from ._pallas_tiles import route_union as _route_union
from .routes import dtype_name, gpu_capability, on_gpu, prepare_routes, resolve_deterministic, validate_inputs

_MAX_HEAD_DIM = 256
_MAX_KV_LENGTH = 2**27  # the kernels' int32 sort keys hold S_kv * 16

__all__ = ["BlockSizes", "flat_route_union", "pallas_sparse_gqa_attention", "supports", "tile_route_union"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile shapes and launch parameters of the kernels.

    ``block_m``: (query row, head) pairs per program, i.e. T * G_pad where
    G_pad is the GQA group rounded up to a power of two (T = block_m // G_pad,
    at most 16 rows). ``block_k``: union IDs per step. ``*_bwd``: the same for
    the backward kernel. ``num_warps`` / ``num_stages``: Triton launch options.
    ``flatten_heads``: when G is not a power of two, a program's M rows are
    ``block_m`` consecutive (query row, head) pairs instead of T rows x G_pad heads,
    so no matrix row is head padding (G=12 pads a quarter of every dot otherwise);
    its rows span up to ``(block_m - 1) // G + 2`` query rows. On by default for
    16-bit inputs at D > 128 on GPUs whose blocks take 192 KiB of shared memory, or an
    unknown GPU (see :meth:`default`).
    Where the backward's geometry (``*_bwd``) equals the forward's, the backward reuses
    the forward's route unions instead of sorting the routes again; they are then
    residuals that live from forward to backward (union and row bits, int32
    ``[B, n_programs, ~span * K]`` each: about 0.56 GiB per layer at S=32768, G=12,
    K=2052). Where ``block_m_bwd`` or ``block_k_bwd`` differs from the forward's (the
    default at every head dim), the backward sorts the routes again and no unions are
    kept. The backward computes and adds its dK/dV blocks transposed (dV^T = dO^T P,
    dK^T = Q^T dS): for sm_90a this removes ptxas's serialization of the wgmma
    instructions for lack of registers (C7512).
    """

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2
    block_m_bwd: int = 64
    block_k_bwd: int = 64
    num_warps_bwd: int = 8
    num_stages_bwd: int = 1
    flatten_heads: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_m_bwd", "block_k_bwd"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value}")
        if not isinstance(self.flatten_heads, bool):
            raise TypeError(f"BlockSizes.flatten_heads must be a bool, got {self.flatten_heads!r}")

    @classmethod
    def default(cls, head_dim: int, interpret: bool, dtype=jnp.bfloat16,
                capability: tuple[int, int] | None = None) -> BlockSizes:
        """The defaults. Chosen on H200 for D=256 bf16 (S=32768, (24,2), QSA routes; see
        docs/benchmarks.md): flat programs over 64-ID chunks, 128 pairs and 2 stages
        forward, 64 pairs backward (which then sorts its own unions). Every tile must fit
        the shared memory of a block as Triton compiles it for sm_90 (CPU CI's Triton 3.9
        and the one in the GPU host's jaxlib): a 128-pair 16-bit backward at D=256 keeps Q
        and dO twice, as they are and transposed for dK^T and dV^T (320 KiB), so the tuned
        backward is 64 pairs (192 KiB; 144 KiB for the D <= 128 tiles), and a third forward
        stage asks Triton 3.9 for 257 KiB, so the forward runs two (193 KiB). Small tiles in
        interpret mode, for fp32 inputs (fp32 operands take twice the
        bytes), and on GPUs of a known ``capability`` whose blocks may take less than the
        tuned backward needs (``qsa_triton.config.block_shared_memory``); an unknown GPU
        gets the tuned tiles."""
        if interpret:
            return cls(block_m=16, block_k=16, block_m_bwd=16, block_k_bwd=16)
        tuned_kib = 144 if head_dim <= 128 else 192  # the tuned 16-bit backward's shared memory
        small_memory = capability is not None and block_shared_memory(capability) < tuned_kib * 1024
        if jnp.dtype(dtype) == jnp.float32 or small_memory:
            return cls(block_m=64, block_k=16, num_stages=1, block_m_bwd=32, block_k_bwd=16)
        if head_dim <= 128:  # not measured at these head dims
            return cls(block_m=128, block_k=64, num_stages=2, block_m_bwd=128, block_k_bwd=32)
        return cls(flatten_heads=True)


# --------------------------------------------------------------------- launchers
def _specs(geo: _Geometry, kv_length: int, union_width: int):
    q_spec = pl.BlockSpec((None, None, geo.block_m, geo.head_dim_pad), lambda t, b, g: (b, g, t, 0))
    row_spec = pl.BlockSpec((None, None, geo.block_m), lambda t, b, g: (b, g, t))
    kv_spec = pl.BlockSpec((None, kv_length, None, geo.head_dim_pad), lambda t, b, g: (b, 0, g, 0))
    union_spec = pl.BlockSpec((None, None, union_width), lambda t, b, g: (b, t, 0))
    count_spec = pl.BlockSpec((None, None, 1), lambda t, b, g: (b, t, 0))
    return q_spec, row_spec, kv_spec, union_spec, count_spec


def _forward_call(q, k, v, union, bits, count, geo: _Geometry, scale, bs: BlockSizes, interpret):
    """The forward kernel over precomputed tile unions: ``(o_arr, lse)`` in the tile arrangement."""
    bsz = q.shape[0]
    kv_length, hkv = k.shape[1], k.shape[2]
    n_tiles = union.shape[1]
    q_arr = _arrange_queries(q, geo, hkv)
    k_pad, v_pad = _pad_head_dim(k, geo.head_dim_pad), _pad_head_dim(v, geo.head_dim_pad)
    q_spec, row_spec, kv_spec, union_spec, count_spec = _specs(geo, kv_length, union.shape[2])
    return pl.pallas_call(
        functools.partial(forward_kernel, scale=scale, geo=geo),
        grid=(n_tiles, bsz, hkv),
        in_specs=[q_spec, kv_spec, kv_spec, union_spec, union_spec, count_spec],
        out_specs=[q_spec, row_spec],
        out_shape=[
            jax.ShapeDtypeStruct(q_arr.shape, q.dtype),
            jax.ShapeDtypeStruct(q_arr.shape[:3], jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="qsa_forward",
    )(q_arr, k_pad, v_pad, union, bits, count)


def _forward(q, k, v, routes, scale, bs: BlockSizes, interpret):
    s_q, d = q.shape[1], q.shape[3]
    geo = _forward_geometry(q.shape[2] // k.shape[2], d, bs)
    unions = _route_union(routes, geo)
    o_arr, lse = _forward_call(q, k, v, *unions, geo, scale, bs, interpret)
    return _restore_queries(o_arr, geo, s_q, d), (o_arr, lse, geo, unions)


def _backward_call(q, k, v, do, lse, delta, union, bits, count, geo: _Geometry, scale,
                   bs: BlockSizes, interpret):
    """The backward kernel over precomputed tile unions; ``lse``/``delta`` are
    ``[B, Hkv, n_tiles * block_m]`` in the backward tile arrangement. Returns
    ``dq_arr`` (tile arrangement) and fp32 ``dk, dv [B, S_kv, Hkv, D_pad]``."""
    bsz = q.shape[0]
    kv_length, hkv = k.shape[1], k.shape[2]
    n_tiles = union.shape[1]
    q_arr, do_arr = _arrange_queries(q, geo, hkv), _arrange_queries(do, geo, hkv)
    k_pad, v_pad = _pad_head_dim(k, geo.head_dim_pad), _pad_head_dim(v, geo.head_dim_pad)
    acc_shape = (bsz, kv_length, hkv, geo.head_dim_pad)
    zeros = jnp.zeros(acc_shape, jnp.float32)
    q_spec, row_spec, kv_spec, union_spec, count_spec = _specs(geo, kv_length, union.shape[2])
    return pl.pallas_call(
        functools.partial(backward_kernel, scale=scale, geo=geo),
        grid=(n_tiles, bsz, hkv),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, union_spec, union_spec,
                  count_spec, kv_spec, kv_spec],
        out_specs=[q_spec, kv_spec, kv_spec],
        out_shape=[
            jax.ShapeDtypeStruct(q_arr.shape, q.dtype),
            jax.ShapeDtypeStruct(acc_shape, jnp.float32),
            jax.ShapeDtypeStruct(acc_shape, jnp.float32),
        ],
        input_output_aliases={9: 1, 10: 2},
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps_bwd, num_stages=bs.num_stages_bwd),
        interpret=interpret,
        name="qsa_backward",
    )(q_arr, k_pad, v_pad, do_arr, lse, delta, union, bits, count, zeros, zeros)


def _backward(q, k, v, routes, o_arr_fwd, lse_fwd, geo_fwd, do, scale, bs: BlockSizes, interpret,
              unions_fwd=None):
    """``unions_fwd``: the forward's unions, which :func:`_qsa_fwd` keeps only when its
    geometry is the backward's; else None and the routes are sorted again here."""
    s_q, hq, d = q.shape[1:]
    hkv = k.shape[2]
    geo = _backward_geometry(hq // hkv, d, bs)
    # LSE and delta in the backward tile arrangement
    o = _restore_queries(o_arr_fwd, geo_fwd, s_q, d)
    lse_rows = _restore_queries(lse_fwd[..., None], dataclasses.replace(geo_fwd, head_dim_pad=1), s_q, 1)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
    as_rows = lambda x: _arrange_queries(x, dataclasses.replace(geo, head_dim_pad=1), hkv)[..., 0]  # noqa: E731
    lse, delta = as_rows(lse_rows), as_rows(delta)
    union, bits, count = _route_union(routes, geo) if unions_fwd is None else unions_fwd
    dq_arr, dk, dv = _backward_call(q, k, v, do, lse, delta, union, bits, count, geo, scale, bs,
                                    interpret)
    dq = _restore_queries(dq_arr, geo, s_q, d)
    return dq, dk[..., :d].astype(k.dtype), dv[..., :d].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _qsa(q, k, v, routes, scale, block_sizes, interpret):
    return _forward(q, k, v, routes, scale, block_sizes, interpret)[0]


def _forward_geometry(group: int, head_dim: int, bs: BlockSizes) -> _Geometry:
    return _Geometry.make(group, head_dim, bs.block_m, bs.block_k, bs.flatten_heads)


def _backward_geometry(group: int, head_dim: int, bs: BlockSizes) -> _Geometry:
    return _Geometry.make(group, head_dim, bs.block_m_bwd, bs.block_k_bwd, bs.flatten_heads)


def _qsa_fwd(q, k, v, routes, scale, block_sizes, interpret):
    out, (o_arr, lse, geo, unions) = _forward(q, k, v, routes, scale, block_sizes, interpret)
    # the unions outlive the forward only where the backward would sort the same ones
    same = geo == _backward_geometry(q.shape[2] // k.shape[2], q.shape[3], block_sizes)
    return out, (q, k, v, routes, o_arr, lse, unions if same else None)


def _qsa_bwd(scale, block_sizes, interpret, residuals, do):
    q, k, v, routes, o_arr, lse, unions = residuals
    geo_fwd = _forward_geometry(q.shape[2] // k.shape[2], q.shape[3], block_sizes)
    dq, dk, dv = _backward(q, k, v, routes, o_arr, lse, geo_fwd, do, scale, block_sizes, interpret,
                           unions)
    return dq, dk, dv, None


_qsa.defvjp(_qsa_fwd, _qsa_bwd)


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
def _run(q, k, v, routes, *, scale, block_sizes, interpret):
    # clip to [-1, S_kv) here so kernels never see an out-of-range ID
    kv_length = k.shape[1]
    routes = jnp.where((routes >= 0) & (routes < kv_length), routes, -1).astype(jnp.int32)
    return _qsa(q, k, v, routes, scale, block_sizes, interpret)


def _pairs_fit_int32(pairs: int, block_sizes: BlockSizes) -> bool:
    return pairs + 2 * max(block_sizes.block_m, block_sizes.block_m_bwd) < 2**31


def pallas_sparse_gqa_attention(
    query,
    key,
    value,
    selected_token_ids,
    softmax_scale: float | None = None,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    deterministic: bool | None = None,
):
    """Route-sparse GQA with the Pallas Triton kernels (forward and custom_vjp backward).

    Shapes and semantics as :func:`qsa_jax.sparse_gqa_attention`: query
    ``[B,S_q,Hq,D]``, key/value ``[B,S_kv,Hkv,D]`` (bf16, f16 or f32; D <= 256),
    routes ``[B,S_q,K]``; output in query's dtype. ``interpret`` defaults to
    True when the inputs do not live on GPUs. A non-finite K/V row that one row
    of a query tile routes to reaches the other rows of that tile (0 * NaN in
    the P @ V product); rows of other tiles are unaffected. dK/dV are accumulated with
    fp32 atomics: not bitwise deterministic, so ``deterministic=True`` is declined.

    Raises:
        InvalidInput / InvalidDtype: the contract's checks.
        BackendDeclined: what :func:`supports` returns (UnsupportedDtype: f64;
            UnsupportedShape: D > 256 or S_kv >= 2**27; DeterminismUnavailable:
            ``deterministic=True``, use ``implementation="triton"``); UnsupportedOption:
            ``block_sizes`` of another class; UnsupportedDevice: ``interpret=False``
            off a GPU; UnsupportedShape: ``flatten_heads`` past int32.
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    deterministic = resolve_deterministic(deterministic)
    declined = supports(query, key, value, selected_token_ids, softmax_scale=softmax_scale,
                        deterministic=deterministic)
    if declined is not None:
        raise declined
    routes = prepare_routes(selected_token_ids)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise UnsupportedOption("block_sizes for the Pallas kernels must be a qsa_jax.pallas_qsa.BlockSizes, "
                                f"got {type(block_sizes).__name__}")
    if interpret is None:
        interpret = not on_gpu(query)
    elif not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool or None, got {interpret!r}")
    elif not interpret and not on_gpu(query):
        raise UnsupportedDevice("the Pallas kernels compile for GPUs only; off a GPU they run with interpret=True")
    pairs = checked.dims.query_length * checked.dims.group_size
    if block_sizes is None:
        block_sizes = BlockSizes.default(checked.dims.head_dim, interpret, query.dtype,
                                         None if interpret else gpu_capability(query))
        if block_sizes.flatten_heads and not _pairs_fit_int32(pairs, block_sizes):
            block_sizes = dataclasses.replace(block_sizes, flatten_heads=False)
    elif block_sizes.flatten_heads and not _pairs_fit_int32(pairs, block_sizes):
        raise UnsupportedShape(f"flatten_heads indexes (row, head) pairs in int32: S_q * G = {pairs}")
    return _run(query, key, value, routes, scale=checked.scale, block_sizes=block_sizes,
                interpret=interpret)



def supports(query, key, value, selected_token_ids, *, softmax_scale=None,
             deterministic: bool = False) -> BackendDeclined | None:
    """Why the Pallas kernels cannot take these (valid, :func:`validate_inputs`-checked)
    inputs, or None: float64 (:class:`UnsupportedDtype`), head dim > 256 or
    S_kv >= 2**27 (:class:`UnsupportedShape`), ``deterministic=True``
    (:class:`DeterminismUnavailable`: the backward adds dK/dV with fp32 atomics)."""
    del value, selected_token_ids, softmax_scale
    if dtype_name(query.dtype) == "float64":
        return UnsupportedDtype("the Pallas kernels take bf16/f16/f32, not float64")
    if query.shape[-1] > _MAX_HEAD_DIM:
        return UnsupportedShape(f"the Pallas kernels support head dim <= {_MAX_HEAD_DIM}, got {query.shape[-1]}")
    if key.shape[1] >= _MAX_KV_LENGTH:
        return UnsupportedShape(f"the Pallas kernels need S_kv < 2**27, got {key.shape[1]} (int32 sort keys)")
    if deterministic:
        return DeterminismUnavailable("deterministic=True needs implementation='triton' (the Pallas backward adds "
                                      "dK/dV with fp32 atomics, whose order varies from run to run)")
    return None
