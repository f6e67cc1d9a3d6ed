"""Raw Triton kernels of the token-gather QSA backend (see ``triton_qsa``).

Imported only on the first call of :func:`qsa_torch.triton_qsa.triton_sparse_gqa_attention`
(it imports ``triton`` at module level). The algorithm is the one of
``docs/design-token-gather.md``: a program owns one query tile (T consecutive rows of
one batch row) and one chunk of HB query heads of one KV head; its M = T * HB matrix
rows are the (query row, head) pairs, ordered row-major (m = t * HB + j). It walks
the tile's sorted route union in chunks of BLOCK_K IDs, gathering each K/V row once
for all M rows and masking entry (m, u) by bit t of ``rowbits[u]``.

Pointer arithmetic is int64 throughout; gathered IDs are clamped before an address
is formed (union entries past ``count`` are -1) and the loads are masked after.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # host-side float
# kernels may only read globals that are constexpr (or jitted functions)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """fp32-accumulated a @ b; exact fp32 products (no TF32) for fp32 inputs.

    ``IEEE`` is set for fp32 inputs and in the interpreter, whose dot multiplies the
    raw bits of bf16 operands: there both operands are widened to fp32 first.
    """
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


# No tl.sum / tl.max / tl.zeros below: those are jitted helpers, which break the
# interpreter when triton was imported before TRITON_INTERPRET was set. Reductions
# go through the builtin tl.reduce with the standard library's combine functions,
# which the interpreter recognises and runs as numpy reductions (a combine function
# of our own would run there element by element).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


_SUM = getattr(tl.standard, "_sum_combine", _add)
_MAX = getattr(tl.standard, "_elementwise_max", _maximum)


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """Round-to-nearest-even downcast of fp32 ``x``. The interpreter truncates
    fp32 -> bf16 casts, so there the rounding is done on the bits first."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load_count(COUNT, index):
    """The tile's union length as a scalar loop bound (a 1-element reduction keeps
    the interpreter, whose scalars are 1-element arrays, happy; free on the GPU)."""
    return tl.reduce(tl.load(COUNT + index + tl.arange(0, 1)), 0, _SUM)


@triton.jit
def _tile_coordinates(S_q, HKV, G, HB: tl.constexpr, T: tl.constexpr, D, D_PAD: tl.constexpr, N_CHUNKS,
                      FLAT: tl.constexpr):
    """Program -> tile, batch, KV head, and per matrix row m: its bit t in ``rowbits``,
    the query row and head (int64, clamped to 0 where invalid) and their validity.

    Padded tiles (m = t * HB + j): T rows of one batch row, heads ``chunk * HB + j``.
    Flat (FLAT, T = 1, N_CHUNKS = 1): program p's rows are the (row, head) pairs
    ``p * HB + m`` of one KV head's group, in row-major order, and t counts query rows
    from the program's first one."""
    tile = tl.program_id(0)
    pid = tl.program_id(1)
    chunk = pid % N_CHUNKS
    b = pid // N_CHUNKS // HKV
    g = pid // N_CHUNKS % HKV
    m = tl.arange(0, T * HB)
    if FLAT:
        pair = tile * (T * HB) + m
        row = pair // G
        local_head = pair % G
        t = row - (tile * (T * HB)) // G
    else:
        t = m // HB
        local_head = chunk * HB + (m % HB)
        row = tile * T + t
    row_ok = (row < S_q) & (local_head < G)
    head = tl.where(row_ok, g * G + local_head, 0).to(tl.int64)
    row64 = tl.where(row_ok, row, 0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    io_mask = row_ok[:, None] & d_ok[None, :]
    return tile, b.to(tl.int64), g.to(tl.int64), t, head, row64, row_ok, d, d_ok, io_mask


@triton.jit
def _gather_chunk(start, count, union, rowbits, k_base, v_base, sk_s, sk_d, sv_s, sv_d, d, d_ok, t, row_ok,
                  BLOCK_K: tl.constexpr):
    """Union chunk [start, start + BLOCK_K): IDs (int64, clamped), K/V rows, membership."""
    u = start + tl.arange(0, BLOCK_K)
    u_ok = u < count
    ids = tl.load(union + u, mask=u_ok, other=0)
    bits = tl.load(rowbits + u, mask=u_ok, other=0)
    ids64 = tl.where(u_ok & (ids >= 0), ids, 0).to(tl.int64)
    kv_mask = u_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + ids64[:, None] * sk_s + d[None, :] * sk_d, mask=kv_mask, other=0.0)
    v = tl.load(v_base + ids64[:, None] * sv_s + d[None, :] * sv_d, mask=kv_mask, other=0.0)
    member = (((bits[None, :] >> t[:, None]) & 1) != 0) & row_ok[:, None]
    return ids64, kv_mask, k, v, member


@triton.jit
def _forward_step(start, count, q, t, row_ok, d, d_ok, m_i, l_i, acc, union, rowbits,
                  k_base, v_base, sk_s, sk_d, sv_s, sv_d, scale_log2,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """One online-softmax update (log2 domain) over a union chunk."""
    ids64, kv_mask, k, v, member = _gather_chunk(
        start, count, union, rowbits, k_base, v_base, sk_s, sk_d, sv_s, sv_d, d, d_ok, t, row_ok, BLOCK_K)
    s = _mm(q, tl.trans(k), IEEE) * scale_log2
    s = tl.where(member, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
    # rows with nothing seen yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
    acc = acc * alpha[:, None] + _mm(_cast(p, v.dtype, INTERPRET), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _backward_step(start, count, q, do, delta, lse_log2, t, row_ok, d, d_ok, dq, union, rowbits,
                   k_base, v_base, dk_base, dv_base, sk_s, sk_d, sv_s, sv_d, sdk_s, scale, scale_log2,
                   BLOCK_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                   SKIP_DKDV: tl.constexpr):
    """dQ update and the chunk's dK/dV atomic adds; returns the new dQ (unscaled)."""
    ids64, kv_mask, k, v, member = _gather_chunk(
        start, count, union, rowbits, k_base, v_base, sk_s, sk_d, sv_s, sv_d, d, d_ok, t, row_ok, BLOCK_K)
    s = _mm(q, tl.trans(k), IEEE) * scale_log2
    p = tl.where(member, tl.exp2(s - lse_log2[:, None]), 0.0)
    dp = _mm(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    dq += _mm(_cast(ds, k.dtype, INTERPRET), k, IEEE)
    dv_blk = _mm(tl.trans(_cast(p, do.dtype, INTERPRET)), do, IEEE)
    dk_blk = _mm(tl.trans(_cast(ds, q.dtype, INTERPRET)), q, IEEE) * scale
    if SKIP_DKDV:
        # measurement hook: the same instructions under a mask that is false at run time,
        # so no atomic reaches memory. The condition is on a stride argument, whose sign
        # the compiler cannot know (``count < 0`` could be folded inside the loop over
        # count, and the dK/dV dots dropped with it).
        kv_mask = kv_mask & (tl.full([BLOCK_K], sdk_s, tl.int64) < 0)[:, None]
    # rows past count carry zeros and are masked: they add nothing
    acc_off = ids64[:, None] * sdk_s + d[None, :]
    tl.atomic_add(dv_base + acc_off, dv_blk, mask=kv_mask, sem="relaxed")
    tl.atomic_add(dk_base + acc_off, dk_blk, mask=kv_mask, sem="relaxed")
    return dq


@triton.jit
def qsa_forward_kernel(
    Q, K, V, O, LSE, UNION, COUNT, ROWBITS,
    sq_b, sq_s, sq_h, sq_d,
    sk_b, sk_s, sk_h, sk_d,
    sv_b, sv_s, sv_h, sv_d,
    so_b, so_s, so_h, so_d,
    sl_b, sl_h, sl_s,
    S_q, N_TILES, UNION_WIDTH, HKV, G, D, scale_log2,
    N_CHUNKS,
    T: tl.constexpr, HB: tl.constexpr, D_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr, FLAT: tl.constexpr = False,
):
    """Forward of one (tile, batch * KV head * head chunk) program.

    Writes O [B,S_q,Hq,D] (input dtype) and the natural-log LSE [B,Hq,S_q] (fp32,
    +inf for rows without routes) of the program's valid (row, head) pairs.
    """
    tile, b64, g64, t, head, row64, row_ok, d, d_ok, io_mask = _tile_coordinates(
        S_q, HKV, G, HB, T, D, D_PAD, N_CHUNKS, FLAT)

    q_ptr = Q + b64 * sq_b + row64[:, None] * sq_s + head[:, None] * sq_h + d[None, :] * sq_d
    q = tl.load(q_ptr, mask=io_mask, other=0.0)

    tile_base = (b64 * N_TILES + tile) * UNION_WIDTH
    count = _load_count(COUNT, b64 * N_TILES + tile)
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
                k_base, v_base, sk_s, sk_d, sv_s, sv_d, scale_log2, BLOCK_K, IEEE, INTERPRET)
            start += BLOCK_K
    else:
        for start in range(0, count, BLOCK_K):
            m_i, l_i, acc = _forward_step(
                start, count, q, t, row_ok, d, d_ok, m_i, l_i, acc, UNION + tile_base, ROWBITS + tile_base,
                k_base, v_base, sk_s, sk_d, sv_s, sv_d, scale_log2, BLOCK_K, IEEE, INTERPRET)

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptr = O + b64 * so_b + row64[:, None] * so_s + head[:, None] * so_h + d[None, :] * so_d
    tl.store(o_ptr, _cast(out, O.dtype.element_ty, INTERPRET), mask=io_mask)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * _LN2, float("inf"))
    tl.store(LSE + b64 * sl_b + head * sl_h + row64 * sl_s, lse, mask=row_ok)


@triton.jit
def qsa_backward_kernel(
    Q, K, V, O, DO, LSE, UNION, COUNT, ROWBITS, DQ, DK, DV,
    sq_b, sq_s, sq_h, sq_d,
    sk_b, sk_s, sk_h, sk_d,
    sv_b, sv_s, sv_h, sv_d,
    so_b, so_s, so_h, so_d,
    sdo_b, sdo_s, sdo_h, sdo_d,
    sl_b, sl_h, sl_s,
    sdq_b, sdq_s, sdq_h, sdq_d,
    sdk_b, sdk_s, sdk_h,
    S_q, N_TILES, UNION_WIDTH, HKV, G, D, scale, scale_log2,
    N_CHUNKS,
    T: tl.constexpr, HB: tl.constexpr, D_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr, SKIP_DKDV: tl.constexpr = False,
    FLAT: tl.constexpr = False,
):
    """Fused backward of one program: dQ in registers (written once), dK/dV by atomics.

    DK/DV are fp32 [B,S_kv,Hkv,D_PAD-or-D] accumulators (last stride 1) that must be
    zero on entry (``SKIP_DKDV``, a measurement hook, masks every add off at run time:
    the kernel's time without the atomics' memory traffic); each union chunk adds its [BLOCK_K, D] block (IDs within a chunk are
    distinct, so a chunk never adds to one address twice).
    """
    tile, b64, g64, t, head, row64, row_ok, d, d_ok, io_mask = _tile_coordinates(
        S_q, HKV, G, HB, T, D, D_PAD, N_CHUNKS, FLAT)

    q = tl.load(Q + b64 * sq_b + row64[:, None] * sq_s + head[:, None] * sq_h + d[None, :] * sq_d,
                mask=io_mask, other=0.0)
    do = tl.load(DO + b64 * sdo_b + row64[:, None] * sdo_s + head[:, None] * sdo_h
                 + d[None, :] * sdo_d, mask=io_mask, other=0.0)
    o = tl.load(O + b64 * so_b + row64[:, None] * so_s + head[:, None] * so_h + d[None, :] * so_d,
                mask=io_mask, other=0.0)
    delta = tl.reduce(do.to(tl.float32) * o.to(tl.float32), 1, _SUM)
    lse = tl.load(LSE + b64 * sl_b + head * sl_h + row64 * sl_s, mask=row_ok, other=float("inf"))
    lse_log2 = lse * _LOG2E

    tile_base = (b64 * N_TILES + tile) * UNION_WIDTH
    count = _load_count(COUNT, b64 * N_TILES + tile)
    k_base = K + b64 * sk_b + g64 * sk_h
    v_base = V + b64 * sv_b + g64 * sv_h
    dk_base = DK + b64 * sdk_b + g64 * sdk_h
    dv_base = DV + b64 * sdk_b + g64 * sdk_h

    dq = tl.full([T * HB, D_PAD], 0.0, tl.float32)
    if INTERPRET:
        start = 0
        while start < count:
            dq = _backward_step(
                start, count, q, do, delta, lse_log2, t, row_ok, d, d_ok, dq,
                UNION + tile_base, ROWBITS + tile_base, k_base, v_base, dk_base, dv_base,
                sk_s, sk_d, sv_s, sv_d, sdk_s, scale, scale_log2, BLOCK_K, IEEE, INTERPRET, SKIP_DKDV)
            start += BLOCK_K
    else:
        # Ascending IDs in every program: programs of neighbouring tiles run together over
        # nearly the same IDs, so their dK/dV adds hit rows already in L2 (starting each
        # program at its own chunk measured 5% slower on the H200).
        for start in range(0, count, BLOCK_K):
            dq = _backward_step(
                start, count, q, do, delta, lse_log2, t, row_ok, d, d_ok, dq,
                UNION + tile_base, ROWBITS + tile_base, k_base, v_base, dk_base, dv_base,
                sk_s, sk_d, sv_s, sv_d, sdk_s, scale, scale_log2, BLOCK_K, IEEE, INTERPRET, SKIP_DKDV)

    dq_ptr = DQ + b64 * sdq_b + row64[:, None] * sdq_s + head[:, None] * sdq_h + d[None, :] * sdq_d
    tl.store(dq_ptr, _cast(dq * scale, DQ.dtype.element_ty, INTERPRET), mask=io_mask)
