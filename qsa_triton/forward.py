"""Forward kernel: one program per (tile, batch row x KV head x head chunk).

A program owns one query tile (T consecutive rows of one batch row, or with FLAT a run
of consecutive (row, head) pairs) and HB query heads of one KV head; its M = T * HB
matrix rows are the (query row, head) pairs. It walks the tile's sorted route union in
chunks of BLOCK_K IDs, gathering each K/V row once for all M rows, masking entry (m, u)
by bit t of ``rowbits[u]``, and runs an fp32 online softmax in the log2 domain.

Signature order is the launchers' contract (``qsa_triton.launch``): array inputs, fp32
scalars, outputs, then integers and constexprs (by keyword).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .language import LN2_C, MAX, SUM, cast, gather_chunk, mm, pair_pointers, program_tile


@triton.jit
def _forward_step(start, count, q, t, row_ok, d, d_ok, m_i, l_i, acc, union, rowbits,
                  k_base, v_base, sk_s, sk_d, sv_s, sv_d, scale_log2,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                  EVEN_D: tl.constexpr, OFFS32: tl.constexpr):
    """One online-softmax update (log2 domain) over a union chunk."""
    rows, kv_mask, k, v, member = gather_chunk(
        start, count, union, rowbits, k_base, v_base, sk_s, sk_d, sv_s, sv_d, d, d_ok, t, row_ok, BLOCK_K,
        EVEN_D, OFFS32)
    s = mm(q, tl.trans(k), IEEE) * scale_log2
    s = tl.where(member, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX))
    # rows with nothing seen yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.reduce(p, 1, SUM)
    acc = acc * alpha[:, None] + mm(cast(p, v.dtype, INTERPRET), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def qsa_forward_kernel(
    Q, K, V, UNION, COUNT, ROWBITS,
    scale_log2,
    O, LSE,
    sq_b, sq_s, sq_h, sq_d,
    sk_b, sk_s, sk_h, sk_d,
    sv_b, sv_s, sv_h, sv_d,
    so_b, so_s, so_h, so_d,
    sl_b, sl_h, sl_s,
    B, S_q, N_TILES, UNION_WIDTH, HKV, G, D, N_CHUNKS,
    T: tl.constexpr, HB: tl.constexpr, D_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr, FLAT: tl.constexpr, EVEN_D: tl.constexpr,
    OFFS32: tl.constexpr, FOLD: tl.constexpr,
):
    """Writes O [B,S_q,Hq,D] (input dtype) and the natural-log LSE [B,Hq,S_q] (fp32,
    +inf for rows without routes) of the program's valid (row, head) pairs.

    Q [B,S_q,Hq,D], K/V [B,S_kv,Hkv,D] (any strides); UNION/ROWBITS int32
    [B, N_TILES, UNION_WIDTH] and COUNT int32 [B, N_TILES] (contiguous) as
    ``qsa_triton.plan.union_recipe`` builds them; ``scale_log2`` = softmax scale * log2(e)
    in fp32. Grid: ``fold_grid(N_TILES, B * HKV * N_CHUNKS)``.
    """
    tile, b64, g64, t, head, row64, row_ok, d, d_ok, io_mask, count = program_tile(
        COUNT, B, S_q, N_TILES, HKV, G, D, N_CHUNKS, HB, T, D_PAD, FLAT, FOLD)

    q_ptr = pair_pointers(Q, b64, row64, head, d, sq_b, sq_s, sq_h, sq_d)
    q = tl.load(q_ptr, mask=io_mask, other=0.0)

    tile_base = (b64 * N_TILES + tile) * UNION_WIDTH
    k_base = K + b64 * sk_b + g64 * sk_h
    v_base = V + b64 * sv_b + g64 * sv_h

    m_i = tl.full([T * HB], float("-inf"), tl.float32)
    l_i = tl.full([T * HB], 0.0, tl.float32)
    acc = tl.full([T * HB, D_PAD], 0.0, tl.float32)
    if INTERPRET:
        start = 0
        while start < count:
            m_i, l_i, acc = _forward_step(
                start, count, q, t, row_ok, d, d_ok, m_i, l_i, acc, UNION + tile_base, ROWBITS + tile_base,
                k_base, v_base, sk_s, sk_d, sv_s, sv_d, scale_log2, BLOCK_K, IEEE, INTERPRET, EVEN_D, OFFS32)
            start += BLOCK_K
    else:
        for start in range(0, count, BLOCK_K):
            m_i, l_i, acc = _forward_step(
                start, count, q, t, row_ok, d, d_ok, m_i, l_i, acc, UNION + tile_base, ROWBITS + tile_base,
                k_base, v_base, sk_s, sk_d, sv_s, sv_d, scale_log2, BLOCK_K, IEEE, INTERPRET, EVEN_D, OFFS32)

    # l_i is 0 exactly for a row without routes and at least 1 otherwise; NaN (a NaN
    # met on the way) counts as routed, so its LSE is NaN, never +inf (no routes)
    has = l_i != 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptr = pair_pointers(O, b64, row64, head, d, so_b, so_s, so_h, so_d)
    tl.store(o_ptr, cast(out, O.dtype.element_ty, INTERPRET), mask=io_mask)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2_C, float("inf"))
    tl.store(LSE + b64 * sl_b + head * sl_h + row64 * sl_s, lse, mask=row_ok)
