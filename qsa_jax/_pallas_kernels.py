"""The Pallas kernels (Triton lowering) of the token-gather QSA: forward and fused backward.

A program owns one tile's ``block_m`` (query row, head) pairs of one KV head and walks
its sorted route union in chunks of ``block_k`` IDs (docs/design-token-gather.md):

* forward: online softmax in fp32, output and natural-log LSE;
* backward (one fused pass): dQ kept on chip, dK/dV accumulated per union chunk into
  fp32 buffers with relaxed atomic adds (IDs in a chunk are distinct).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._pallas_atomics import relaxed_addupdate
from ._pallas_tiles import Geometry

__all__ = ["backward_kernel", "forward_kernel"]


def _dot(a, b, *, trans_b=False, trans_a=False):
    """fp32-accumulating dot; exact fp32 (no tf32) for fp32 operands."""
    allow_tf32 = False if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=allow_tf32)


def _rows_of(geo: Geometry) -> jax.Array:
    """For each of the program's M rows, its query row's bit in ``rowbits``."""
    m = jnp.arange(geo.block_m, dtype=jnp.int32)
    if not geo.flat:
        return m // geo.group_pad
    first_pair = pl.program_id(0) * geo.block_m
    return (first_pair + m) // geo.group - first_pair // geo.group


def _chunk(union_ref, bits_ref, c, geo: Geometry, rows_of: jax.Array):
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


def _n_chunks(count, block_k: int):
    """Chunks of ``block_k`` IDs covering a union of ``count`` (int32) IDs, in int32 (with
    x64 enabled a Python int operand would be int64, and Pallas divides same dtypes only)."""
    return (count + jnp.int32(block_k - 1)) // jnp.int32(block_k)


def forward_kernel(q_ref, k_ref, v_ref, union_ref, bits_ref, count_ref, o_ref, lse_ref, *,
                    scale: float, geo: Geometry):
    m_rows = geo.block_m
    rows_of = _rows_of(geo)
    q = q_ref[...]
    n_chunks = _n_chunks(count_ref[0], geo.block_k)

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
    has = l_i != 0  # 0 exactly without routes; NaN (a NaN met on the way) counts as routed
    o_ref[...] = jnp.where(has[:, None], acc / jnp.where(has, l_i, 1.0)[:, None], 0.0).astype(
        o_ref.dtype
    )
    lse_ref[...] = jnp.where(has, m_i + jnp.log(jnp.where(has, l_i, 1.0)), jnp.inf)


def backward_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, union_ref, bits_ref,
                     count_ref, dk_in_ref, dv_in_ref, dq_ref, dk_ref, dv_ref, *,
                     scale: float, geo: Geometry):
    del dk_in_ref, dv_in_ref  # aliased with dk_ref / dv_ref
    m_rows = geo.block_m
    rows_of = _rows_of(geo)
    cols = jnp.arange(geo.head_dim_pad)[None, :]
    lse = lse_ref[...]
    # a row without routes (LSE +inf; a NaN LSE is a routed row that met a NaN) adds
    # nothing to any gradient: whatever its q, dO and delta hold is replaced by zeros, so
    # no 0 * NaN reaches dK/dV
    routed = lse != jnp.inf
    q = jnp.where(routed[:, None], q_ref[...], 0).astype(q_ref.dtype)
    do = jnp.where(routed[:, None], do_ref[...], 0).astype(do_ref.dtype)
    delta = jnp.where(routed, delta_ref[...], 0.0)
    # The dK/dV products sum over all the program's rows, and 0 * NaN is NaN: a routed row
    # whose LSE (non-finite q) or delta (non-finite dO) is not finite gets LSE NaN and
    # delta 0, and non-finite q and dO entries become 0, so the row's P, dS and dQ are NaN
    # at exactly the keys it routes (P and dS are 0 elsewhere) and the products carry that
    # to those keys' dK/dV, every lane (qsa_triton.language.confine_non_finite)
    finite = (jnp.abs(lse) < jnp.inf) & (jnp.abs(delta) < jnp.inf)
    lse = jnp.where(finite | ~routed, lse, jnp.nan)
    delta = jnp.where(finite, delta, 0.0)
    q = jnp.where(jnp.abs(q.astype(jnp.float32)) < jnp.inf, q, 0).astype(q.dtype)
    do = jnp.where(jnp.abs(do.astype(jnp.float32)) < jnp.inf, do, 0).astype(do.dtype)
    n_chunks = _n_chunks(count_ref[0], geo.block_k)

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
        # dV^T = dO^T P, dK^T = Q^T dS, added transposed (fewer registers than the
        # [block_k, D] orientation)
        relaxed_addupdate(dv_ref, (ids[None, :], cols.T), _dot(do, p.astype(do.dtype), trans_a=True))
        relaxed_addupdate(dk_ref, (ids[None, :], cols.T), scale * _dot(q, ds.astype(q.dtype), trans_a=True))
        return dq

    dq = jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((m_rows, geo.head_dim_pad), jnp.float32))
    dq_ref[...] = (scale * dq).astype(dq_ref.dtype)
