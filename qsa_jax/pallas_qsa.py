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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._pallas_atomics import relaxed_addupdate
from .routes import gpu_capability, on_gpu, prepare_routes, validate_inputs

__all__ = ["BlockSizes", "pallas_sparse_gqa_attention", "tile_route_union"]

_NO_ID = jnp.iinfo(jnp.int32).max  # sorts after every valid ID


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
    16-bit inputs at D > 128 on SM90/SM100 or an unknown GPU (measured faster there,
    see :meth:`default`). Where the backward's geometry (``*_bwd``) equals the
    forward's, the backward reuses the forward's route unions instead of sorting the
    routes again; they are then residuals that live from forward to backward (union
    and row bits, int32 ``[B, n_programs, ~span * K]`` each: about 0.56 GiB per layer
    at S=32768, G=12, K=2052). ``block_m_bwd=64`` trades that memory for a second
    sort and a slower backward (58.2 against 39.4 ms forward+backward there).
    ``lean_backward``: compute and add the dK/dV blocks transposed (dV^T = dO^T P,
    dK^T = Q^T dS), the same results; for sm_90a it removes ptxas's warning that the
    backward's wgmma instructions are serialized for lack of registers (C7512). Not yet
    timed on a GPU, so off.
    """

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    block_m_bwd: int = 64
    block_k_bwd: int = 64
    num_warps_bwd: int = 8
    num_stages_bwd: int = 1
    flatten_heads: bool = False
    lean_backward: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_m_bwd", "block_k_bwd"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value}")
        if not isinstance(self.flatten_heads, bool):
            raise TypeError(f"BlockSizes.flatten_heads must be a bool, got {self.flatten_heads!r}")

    @classmethod
    def default(cls, head_dim: int, interpret: bool, dtype=jnp.bfloat16,
                capability: tuple[int, int] | None = None) -> "BlockSizes":
        """The defaults: tuned on the H200 for 16-bit inputs at D=256 (S=32768, (24,2),
        QSA routes: forward 11.9 ms with 3 stages against 12.4 with 2; backward 49.9 ms
        with 64-ID chunks against 60.4 with 32; flattened heads, which only change
        groups that are not a power of two, 9.7 ms forward and 39.9 ms backward against
        12.0 and 49.6 padded, the unions 4.3 ms against 4.1; backward programs of 128
        flat pairs, 26.1 ms against 40.4 at 64, and the forward's unions reused:
        forward+backward 39.4 ms against 58.2, docs/benchmarks.md); small tiles for interpret
        mode; for fp32 inputs tiles that fit the 227 KiB of shared memory (fp32 operands
        take twice the bytes: the 16-bit tiles asked for 385 KiB there). The tuned 16-bit
        backward takes 192 KiB per program: GPUs of a known ``capability`` other than
        SM90/SM100 (227 KiB per block; SM80 has 163, SM120 99) get those small tiles too."""
        if interpret:
            return cls(block_m=16, block_k=16, block_m_bwd=16, block_k_bwd=16)
        small_memory = capability is not None and capability[0] not in (9, 10)
        if jnp.dtype(dtype) == jnp.float32 or (small_memory and head_dim > 128):
            return cls(block_m=64, block_k=16, num_stages=1, block_m_bwd=32, block_k_bwd=16)
        if head_dim <= 128:  # not measured at these head dims
            return cls(block_m=128, block_k=64, num_stages=2, block_m_bwd=128, block_k_bwd=32)
        return cls(flatten_heads=True, block_m_bwd=128)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static sizes derived from the inputs and a (block_m, block_k) choice.

    Padded (default): a program's ``block_m`` rows are T query rows x G_pad heads.
    Flat: they are ``block_m`` consecutive (query row, head) pairs of one KV head's
    group (no head padding); ``rows`` then bounds how many query rows one program spans.
    """

    group: int  # G = Hq // Hkv
    group_pad: int  # padded: G rounded up to a power of two; flat: G
    rows: int  # padded: T, query rows per tile; flat: most query rows one program spans
    block_m: int
    head_dim_pad: int
    block_k: int
    flat: bool = False

    @staticmethod
    def make(group: int, head_dim: int, block_m: int, block_k: int, flat: bool = False) -> "_Geometry":
        head_dim_pad = max(16, pl.next_power_of_2(head_dim))
        group_pad = pl.next_power_of_2(group)
        if flat and group != group_pad:
            span = lambda m: (m - 1) // group + 2  # noqa: E731 - rows that m pairs can touch
            while block_m > 16 and span(block_m) > 16:
                block_m //= 2
            return _Geometry(group, group, span(block_m), block_m, head_dim_pad, block_k, True)
        rows = max(1, min(16, block_m // group_pad))
        if rows * group_pad < 16:  # dots need M >= 16
            rows = -(-16 // group_pad)
        return _Geometry(group, group_pad, rows, rows * group_pad, head_dim_pad, block_k)


# ----------------------------------------------------------------- preprocessing
def tile_route_union(routes: jax.Array, rows: int, block_k: int):
    """Per tile of ``rows`` consecutive query rows: the union of their routes.

    Args:
        routes: ``[B, S_q, K]`` int32 routes; IDs < 0 are padding (call with
            IDs already clipped to ``[-1, S_kv)``, S_kv * rows < 2**31).
            Duplicates are allowed.
        rows: T, query rows per tile (<= 32).
        block_k: the union width is padded to a multiple of this.

    Returns:
        ``union [B, n_tiles, U]`` int32 ascending distinct IDs then -1,
        ``rowbits [B, n_tiles, U]`` int32 (bit t: row t of the tile routes to
        the ID), ``count [B, n_tiles, 1]`` int32 number of distinct IDs, with
        ``n_tiles = ceil(S_q / T)`` and ``U = round_up(T * K, block_k)``.
    """
    bsz, s_q, width = routes.shape
    n_tiles = -(-s_q // rows)
    r = jnp.pad(routes, ((0, 0), (0, n_tiles * rows - s_q), (0, 0)), constant_values=-1)
    return _union_of_row_groups(r.reshape(bsz, n_tiles, rows * width), rows, width, block_k)


def _flat_blocks(s_q: int, geo: _Geometry):
    """Flat geometry: per program, the query rows ``[n, rows]`` it may touch and which
    of them it does."""
    n_blocks = -(-s_q * geo.group // geo.block_m)
    first_pair = jnp.arange(n_blocks, dtype=jnp.int32) * geo.block_m
    last_row = jnp.minimum((first_pair + geo.block_m - 1) // geo.group, s_q - 1)
    row = (first_pair // geo.group)[:, None] + jnp.arange(geo.rows, dtype=jnp.int32)[None, :]
    return row, row <= last_row[:, None]


def flat_route_union(routes: jax.Array, geo: _Geometry):
    """:func:`tile_route_union` for a flat geometry: per program, the union of the
    routes of the query rows its ``block_m`` (row, head) pairs touch; bit t of
    ``rowbits`` is row ``first_row + t`` of the program."""
    bsz, s_q, width = routes.shape
    row, ok = _flat_blocks(s_q, geo)
    r = jnp.where(ok[None, :, :, None], routes[:, jnp.minimum(row, s_q - 1), :], -1)
    return _union_of_row_groups(r.reshape(bsz, row.shape[0], geo.rows * width), geo.rows, width,
                                geo.block_k)


def _route_union(routes: jax.Array, geo: _Geometry):
    return flat_route_union(routes, geo) if geo.flat else tile_route_union(routes, geo.rows, geo.block_k)


def _union_of_row_groups(r: jax.Array, rows: int, width: int, block_k: int):
    """Union, row bits and count of each group ``r[b, g]`` of ``rows`` route rows
    (``[B, n, rows * width]``, row t's routes at ``[t * width, (t + 1) * width)``)."""
    bsz, n_tiles, _ = r.shape
    # One int32 sort key per (ID, row) pair: a single-operand sort (XLA can hand
    # it to a radix sort) instead of a two-key comparator sort.
    tok = jnp.broadcast_to(jnp.repeat(jnp.arange(rows, dtype=jnp.int32), width), r.shape)
    keys = jnp.sort(jnp.where(r >= 0, r * rows + tok, _NO_ID), axis=2)
    valid = keys != _NO_ID
    ids, tok = keys // rows, keys % rows
    prev_key = jnp.pad(keys[..., :-1], ((0, 0), (0, 0), (1, 0)), constant_values=-1)
    first = valid & (ids != prev_key // rows)
    # a repeated (ID, row) pair adds its bit once
    fresh = valid & (keys != prev_key)
    slot = jnp.cumsum(first, axis=2, dtype=jnp.int32) - 1
    width_pad = -(-rows * width // block_k) * block_k
    slot = jnp.where(valid, slot, width_pad)  # out of bounds: dropped

    def scatter(slot_t, ids_t, bits_t, first_t):
        union = jnp.full((width_pad,), -1, jnp.int32).at[jnp.where(first_t, slot_t, width_pad)].set(
            ids_t, mode="drop"
        )
        rowbits = jnp.zeros((width_pad,), jnp.int32).at[slot_t].add(bits_t, mode="drop")
        return union, rowbits

    bits = jnp.where(fresh, jnp.left_shift(jnp.int32(1), tok), 0)
    flat = lambda x: x.reshape(bsz * n_tiles, -1)  # noqa: E731
    union, rowbits = jax.vmap(scatter)(flat(slot), flat(ids), flat(bits), flat(first))
    count = jnp.sum(first, axis=2, dtype=jnp.int32)[..., None]
    return union.reshape(bsz, n_tiles, width_pad), rowbits.reshape(bsz, n_tiles, width_pad), count


def _arrange_queries(x: jax.Array, geo: _Geometry, kv_heads: int) -> jax.Array:
    """``[B, S_q, Hq, D]`` -> ``[B, Hkv, n_tiles * block_m, D_pad]`` (zero padded)."""
    bsz, s_q, _, d = x.shape
    if geo.flat:
        x = x.reshape(bsz, s_q, kv_heads, geo.group, d).transpose(0, 2, 1, 3, 4)
        x = x.reshape(bsz, kv_heads, s_q * geo.group, d)
        total = -(-s_q * geo.group // geo.block_m) * geo.block_m
        return jnp.pad(x, ((0, 0), (0, 0), (0, total - s_q * geo.group), (0, geo.head_dim_pad - d)))
    n_tiles = -(-s_q // geo.rows)
    x = jnp.pad(x, ((0, 0), (0, n_tiles * geo.rows - s_q), (0, 0), (0, geo.head_dim_pad - d)))
    x = x.reshape(bsz, n_tiles, geo.rows, kv_heads, geo.group, geo.head_dim_pad)
    x = jnp.pad(x, ((0, 0),) * 4 + ((0, geo.group_pad - geo.group), (0, 0)))
    x = x.transpose(0, 3, 1, 2, 4, 5)
    return x.reshape(bsz, kv_heads, n_tiles * geo.block_m, geo.head_dim_pad)


def _restore_queries(x: jax.Array, geo: _Geometry, s_q: int, head_dim: int) -> jax.Array:
    """Inverse of :func:`_arrange_queries`."""
    bsz, kv_heads, total, _ = x.shape
    if geo.flat:
        x = x[:, :, : s_q * geo.group, :head_dim].reshape(bsz, kv_heads, s_q, geo.group, head_dim)
        return x.transpose(0, 2, 1, 3, 4).reshape(bsz, s_q, kv_heads * geo.group, head_dim)
    n_tiles = total // geo.block_m
    x = x.reshape(bsz, kv_heads, n_tiles, geo.rows, geo.group_pad, geo.head_dim_pad)
    x = x[:, :, :, :, : geo.group, :head_dim].transpose(0, 2, 3, 1, 4, 5)
    return x.reshape(bsz, n_tiles * geo.rows, kv_heads * geo.group, head_dim)[:, :s_q]


def _pad_head_dim(x: jax.Array, head_dim_pad: int) -> jax.Array:
    d = x.shape[-1]
    return x if d == head_dim_pad else jnp.pad(x, ((0, 0),) * 3 + ((0, head_dim_pad - d),))


# ----------------------------------------------------------------------- kernels
def _dot(a, b, *, trans_b=False, trans_a=False):
    """fp32-accumulating dot; exact fp32 (no tf32) for fp32 operands."""
    allow_tf32 = False if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=allow_tf32)


def _rows_of(geo: _Geometry) -> jax.Array:
    """For each of the program's M rows, its query row's bit in ``rowbits``."""
    m = jnp.arange(geo.block_m, dtype=jnp.int32)
    if not geo.flat:
        return m // geo.group_pad
    first_pair = pl.program_id(0) * geo.block_m
    return (first_pair + m) // geo.group - first_pair // geo.group


def _chunk(union_ref, bits_ref, c, geo: _Geometry, rows_of: jax.Array):
    """Union chunk ``c``: IDs clamped for addressing, which are real, and the [M, BK] membership."""
    span = pl.ds(c * geo.block_k, geo.block_k)
    ids = union_ref[span]
    bits = bits_ref[span]
    member = (jnp.right_shift(bits[None, :], rows_of[:, None]) & 1) == 1
    return jnp.maximum(ids, 0), ids >= 0, member


def _gather(ref, ids, real, head_dim_pad):
    """Rows ``ids`` of ``ref``; padding IDs (which address row 0) give zero rows,
    so a non-finite row 0 cannot reach other rows through 0 * NaN."""
    rows = ref[ids[:, None], jnp.arange(head_dim_pad)[None, :]]
    return jnp.where(real[:, None], rows, jnp.zeros_like(rows))


def _forward_kernel(q_ref, k_ref, v_ref, union_ref, bits_ref, count_ref, o_ref, lse_ref, *,
                    scale: float, geo: _Geometry):
    m_rows = geo.block_m
    rows_of = _rows_of(geo)
    q = q_ref[...]
    n_chunks = pl.cdiv(count_ref[0], geo.block_k)

    def body(c, carry):
        acc, m_prev, l_prev = carry
        ids, real, member = _chunk(union_ref, bits_ref, c, geo, rows_of)
        k = _gather(k_ref, ids, real, geo.head_dim_pad)
        v = _gather(v_ref, ids, real, geo.head_dim_pad)
        s = jnp.where(member, _dot(q, k, trans_b=True) * scale, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with nothing yet
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_next, l_next

    init = (
        jnp.zeros((m_rows, geo.head_dim_pad), jnp.float32),
        jnp.full((m_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
    )
    acc, m_i, l_i = jax.lax.fori_loop(0, n_chunks, body, init)
    has = l_i > 0
    o_ref[...] = jnp.where(has[:, None], acc / jnp.where(has, l_i, 1.0)[:, None], 0.0).astype(
        o_ref.dtype
    )
    lse_ref[...] = jnp.where(has, m_i + jnp.log(jnp.where(has, l_i, 1.0)), jnp.inf)


def _backward_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, union_ref, bits_ref,
                     count_ref, dk_in_ref, dv_in_ref, dq_ref, dk_ref, dv_ref, *,
                     scale: float, geo: _Geometry, lean: bool = False):
    del dk_in_ref, dv_in_ref  # aliased with dk_ref / dv_ref
    m_rows = geo.block_m
    rows_of = _rows_of(geo)
    cols = jnp.arange(geo.head_dim_pad)[None, :]
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    n_chunks = pl.cdiv(count_ref[0], geo.block_k)

    def body(c, dq):
        ids, real, member = _chunk(union_ref, bits_ref, c, geo, rows_of)
        k = _gather(k_ref, ids, real, geo.head_dim_pad)
        v = _gather(v_ref, ids, real, geo.head_dim_pad)
        s = _dot(q, k, trans_b=True) * scale
        p = jnp.where(member, jnp.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])
        dq = dq + _dot(ds.astype(k.dtype), k)
        # padding IDs point at row 0 with all-zero contributions
        if lean:  # dV^T = dO^T P, dK^T = Q^T dS: the same products, added transposed
            relaxed_addupdate(dv_ref, (ids[None, :], cols.T), _dot(do, p.astype(do.dtype), trans_a=True))
            relaxed_addupdate(dk_ref, (ids[None, :], cols.T), scale * _dot(q, ds.astype(q.dtype), trans_a=True))
        else:
            relaxed_addupdate(dv_ref, (ids[:, None], cols), _dot(p.astype(do.dtype), do, trans_a=True))
            relaxed_addupdate(dk_ref, (ids[:, None], cols), scale * _dot(ds.astype(q.dtype), q, trans_a=True))
        return dq

    dq = jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((m_rows, geo.head_dim_pad), jnp.float32))
    dq_ref[...] = (scale * dq).astype(dq_ref.dtype)


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
        functools.partial(_forward_kernel, scale=scale, geo=geo),
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
        functools.partial(_backward_kernel, scale=scale, geo=geo, lean=bs.lean_backward),
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
):
    """Route-sparse GQA with the Pallas Triton kernels (forward and custom_vjp backward).

    Shapes and semantics as :func:`qsa_jax.sparse_gqa_attention`: query
    ``[B,S_q,Hq,D]``, key/value ``[B,S_kv,Hkv,D]`` (bf16, f16 or f32; D <= 256),
    routes ``[B,S_q,K]``; output in query's dtype. ``interpret`` defaults to
    True when the inputs do not live on GPUs. A non-finite K/V row that one row
    of a query tile routes to reaches the other rows of that tile (0 * NaN in
    the P @ V product); rows of other tiles are unaffected. dK/dV are accumulated with
    fp32 atomics: not bitwise deterministic.

    Raises:
        NotImplementedError: f64 inputs, D > 256, S_kv >= 2**27 (use
            ``implementation="xla"``), or ``block_sizes`` of another class.
    """
    routes = prepare_routes(selected_token_ids)
    checked = validate_inputs(query, key, value, routes, softmax_scale)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise NotImplementedError("block_sizes for the Pallas kernels must be a qsa_jax.pallas_qsa.BlockSizes, "
                                  f"got {type(block_sizes).__name__}")
    if jnp.dtype(query.dtype) == jnp.float64:
        raise NotImplementedError("the Pallas kernels take bf16/f16/f32, not float64")
    if checked.dims.head_dim > 256:
        raise NotImplementedError(f"the Pallas kernels support head dim <= 256, got {checked.dims.head_dim}")
    if checked.dims.kv_length * 16 >= 2**31:
        raise NotImplementedError(
            f"the Pallas kernels need S_kv < 2**27, got {checked.dims.kv_length} (int32 sort keys)"
        )
    if interpret is None:
        interpret = not on_gpu(query)
    pairs = checked.dims.query_length * checked.dims.group_size
    if block_sizes is None:
        block_sizes = BlockSizes.default(checked.dims.head_dim, interpret, query.dtype,
                                         None if interpret else gpu_capability(query))
        if block_sizes.flatten_heads and not _pairs_fit_int32(pairs, block_sizes):
            block_sizes = dataclasses.replace(block_sizes, flatten_heads=False)
    elif block_sizes.flatten_heads and not _pairs_fit_int32(pairs, block_sizes):
        raise NotImplementedError(f"flatten_heads indexes (row, head) pairs in int32: S_q * G = {pairs}")
    return _run(query, key, value, routes, scale=checked.scale, block_sizes=block_sizes,
                interpret=bool(interpret))

