"""Raw Triton kernels of the token-gather QSA backend (see ``triton_qsa``).

Imported only on the first call of :func:`qsa_torch.triton_qsa.triton_sparse_gqa_attention`
(it imports ``triton`` at module level). The algorithm is the one of
``docs/design-token-gather.md``: a program owns one query tile (T consecutive rows of
one batch row) and one chunk of HB query heads of one KV head; its M = T * HB matrix
rows are the (query row, head) pairs, ordered row-major (m = t * HB + j). It walks
the tile's sorted route union in chunks of BLOCK_K IDs, gathering each K/V row once
for all M rows and masking entry (m, u) by bit t of ``rowbits[u]``.

Per-program base pointers are formed in int64; the per-element offsets of the K/V
gathers and dK/dV adds are int32 when the host has checked that every one fits
(``OFFS32``), else int64. Gathered IDs are clamped to 0 before an address is formed
(union entries past ``count`` are -1) and the loads are masked after. The union
kernels at the end build and cut the tile unions themselves.
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
def _pair_coordinates(tile, S_q, HKV, G, HB: tl.constexpr, T: tl.constexpr, N_CHUNKS, FLAT: tl.constexpr):
    """Per matrix row m of program (``tile``, ``tl.program_id(1)``): its bit t in
    ``rowbits``, query head and row (int64, 0 where invalid) and validity."""
    pid = tl.program_id(1)
    chunk = pid % N_CHUNKS
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
    return t, head, row64, row_ok


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
    b = pid // N_CHUNKS // HKV
    g = pid // N_CHUNKS % HKV
    t, head, row64, row_ok = _pair_coordinates(tile, S_q, HKV, G, HB, T, N_CHUNKS, FLAT)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    io_mask = row_ok[:, None] & d_ok[None, :]
    return tile, b.to(tl.int64), g.to(tl.int64), t, head, row64, row_ok, d, d_ok, io_mask


@triton.jit
def _gather_chunk(start, count, union, rowbits, k_base, v_base, sk_s, sk_d, sv_s, sv_d, d, d_ok, t, row_ok,
                  BLOCK_K: tl.constexpr, EVEN_D: tl.constexpr, OFFS32: tl.constexpr):
    """Union chunk [start, start + BLOCK_K): IDs (clamped to 0 past ``count``), K/V
    rows, the [BLOCK_K, D_PAD] mask of real entries, and membership.

    ``OFFS32``: every element offset from the K/V/dK/dV base pointers fits int32 (the
    host checks), so the per-element address arithmetic stays 32-bit; it measured as
    more instructions in int64. ``EVEN_D``: D == D_PAD, so the
    masks are per row only."""
    u = start + tl.arange(0, BLOCK_K)
    u_ok = u < count
    ids = tl.load(union + u, mask=u_ok, other=0)
    bits = tl.load(rowbits + u, mask=u_ok, other=0)
    rows = tl.where(ids >= 0, ids, 0)
    if not OFFS32:
        rows = rows.to(tl.int64)
    k_off = rows[:, None] * sk_s + d[None, :] * sk_d
    v_off = rows[:, None] * sv_s + d[None, :] * sv_d
    # entries past count load zeros, not row 0: K/V rows that no query routes to may
    # hold anything (even inf), and 0 * inf would leak into the dots
    if EVEN_D:
        kv_mask = tl.broadcast_to(u_ok[:, None], (BLOCK_K, d.shape[0]))
    else:
        kv_mask = u_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + k_off, mask=kv_mask, other=0.0)
    v = tl.load(v_base + v_off, mask=kv_mask, other=0.0)
    member = (((bits[None, :] >> t[:, None]) & 1) != 0) & row_ok[:, None]
    return rows, kv_mask, k, v, member


@triton.jit
def _forward_step(start, count, q, t, row_ok, d, d_ok, m_i, l_i, acc, union, rowbits,
                  k_base, v_base, sk_s, sk_d, sv_s, sv_d, scale_log2,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                  EVEN_D: tl.constexpr, OFFS32: tl.constexpr):
    """One online-softmax update (log2 domain) over a union chunk."""
    rows, kv_mask, k, v, member = _gather_chunk(
        start, count, union, rowbits, k_base, v_base, sk_s, sk_d, sv_s, sv_d, d, d_ok, t, row_ok, BLOCK_K,
        EVEN_D, OFFS32)
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
                   SKIP_DKDV: tl.constexpr, EVEN_D: tl.constexpr, OFFS32: tl.constexpr,
                   LEAN_REGISTERS: tl.constexpr):
    """dQ update and the chunk's dK/dV atomic adds; returns the new dQ (unscaled)."""
    rows, kv_mask, k, v, member = _gather_chunk(
        start, count, union, rowbits, k_base, v_base, sk_s, sk_d, sv_s, sv_d, d, d_ok, t, row_ok, BLOCK_K,
        EVEN_D, OFFS32)
    s = _mm(q, tl.trans(k), IEEE) * scale_log2
    p = tl.where(member, tl.exp2(s - lse_log2[:, None]), 0.0)
    dp = _mm(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    dq += _mm(_cast(ds, k.dtype, INTERPRET), k, IEEE)
    if SKIP_DKDV:
        # measurement hook: the same instructions under a mask that is false at run time,
        # so no atomic reaches memory. The condition is on a stride argument, whose sign
        # the compiler cannot know (``count < 0`` could be folded inside the loop over
        # count, and the dK/dV dots dropped with it).
        kv_mask = kv_mask & (tl.full([BLOCK_K], sdk_s, tl.int64) < 0)[:, None]
    # rows past count carry zeros and are masked: they add nothing. Each [BLOCK_K, D]
    # block is added as soon as it is computed, so only one of them holds registers.
    if LEAN_REGISTERS:
        # dV^T = dO^T P and dK^T = Q^T dS: both wgmma operands can come from shared
        # memory (no [BLOCK_K, D] bf16 operand held in registers). The same products
        # summed in the same order; the adds stay 4-wide along D (ptxas, sm_90a).
        acc_off_t = rows[None, :] * sdk_s + d[:, None]
        kv_mask_t = tl.trans(kv_mask)
        dv_t = _mm(tl.trans(do), _cast(p, do.dtype, INTERPRET), IEEE)
        tl.atomic_add(dv_base + acc_off_t, dv_t, mask=kv_mask_t, sem="relaxed")
        dk_t = _mm(tl.trans(q), _cast(ds, q.dtype, INTERPRET), IEEE) * scale
        tl.atomic_add(dk_base + acc_off_t, dk_t, mask=kv_mask_t, sem="relaxed")
    else:
        acc_off = rows[:, None] * sdk_s + d[None, :]
        dv_blk = _mm(tl.trans(_cast(p, do.dtype, INTERPRET)), do, IEEE)
        tl.atomic_add(dv_base + acc_off, dv_blk, mask=kv_mask, sem="relaxed")
        dk_blk = _mm(tl.trans(_cast(ds, q.dtype, INTERPRET)), q, IEEE) * scale
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
    EVEN_D: tl.constexpr = False, OFFS32: tl.constexpr = False,
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
                k_base, v_base, sk_s, sk_d, sv_s, sv_d, scale_log2, BLOCK_K, IEEE, INTERPRET, EVEN_D, OFFS32)
            start += BLOCK_K
    else:
        for start in range(0, count, BLOCK_K):
            m_i, l_i, acc = _forward_step(
                start, count, q, t, row_ok, d, d_ok, m_i, l_i, acc, UNION + tile_base, ROWBITS + tile_base,
                k_base, v_base, sk_s, sk_d, sv_s, sv_d, scale_log2, BLOCK_K, IEEE, INTERPRET, EVEN_D, OFFS32)

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
    FLAT: tl.constexpr = False, EVEN_D: tl.constexpr = False, OFFS32: tl.constexpr = False,
    LEAN_REGISTERS: tl.constexpr = False,
):
    """Fused backward of one program: dQ in registers (written once), dK/dV by atomics.

    DK/DV are fp32 [B, S_kv, Hkv, D] accumulators (last stride 1) that must be zero on
    entry; each union chunk adds its [BLOCK_K, D] block (IDs within a chunk are
    distinct, so a chunk never adds to one address twice). ``SKIP_DKDV``, a measurement
    hook, masks every add off at run time: the kernel's time without the atomics'
    memory traffic. ``LEAN_REGISTERS``: the same results with less register pressure
    (transposed dK/dV products, dQ-store coordinates recomputed after the loop).
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
                sk_s, sk_d, sv_s, sv_d, sdk_s, scale, scale_log2, BLOCK_K, IEEE, INTERPRET, SKIP_DKDV,
                EVEN_D, OFFS32, LEAN_REGISTERS)
            start += BLOCK_K
    else:
        # Ascending IDs in every program: programs of neighbouring tiles run together over
        # nearly the same IDs, so their dK/dV adds hit rows already in L2 (starting each
        # program at its own chunk measured 5% slower on the H200).
        for start in range(0, count, BLOCK_K):
            dq = _backward_step(
                start, count, q, do, delta, lse_log2, t, row_ok, d, d_ok, dq,
                UNION + tile_base, ROWBITS + tile_base, k_base, v_base, dk_base, dv_base,
                sk_s, sk_d, sv_s, sv_d, sdk_s, scale, scale_log2, BLOCK_K, IEEE, INTERPRET, SKIP_DKDV,
                EVEN_D, OFFS32, LEAN_REGISTERS)

    if LEAN_REGISTERS:
        # the store's per-row coordinates again, from a tile the compiler cannot prove
        # equal to the prologue's (count is never negative), so the prologue's int64
        # offsets and masks are not held (spilled) across the loop
        _, head, row64, row_ok = _pair_coordinates(tl.where(count < 0, 0, tile), S_q, HKV, G, HB, T,
                                                   N_CHUNKS, FLAT)
        io_mask = row_ok[:, None] & d_ok[None, :]
    dq_ptr = DQ + b64 * sdq_b + row64[:, None] * sdq_s + head[:, None] * sdq_h + d[None, :] * sdq_d
    tl.store(dq_ptr, _cast(dq * scale, DQ.dtype.element_ty, INTERPRET), mask=io_mask)


# ------------------------------------------------------------------- tile unions
# The sorted (ID, row) keys of a tile give its union in one pass: an ID starts a new
# union slot where it differs from the previous key's ID, the slot is a running count
# of those starts (a prefix sum per chunk plus the count carried from earlier chunks),
# and each key ORs its row's bit into its slot (OR is idempotent, so repeated (ID, row)
# keys need no care).
@triton.jit
def _program_rows(first_pair, PAIRS: tl.constexpr, group):
    """First and last query row (inclusive) that the flat program of (row, head) pairs
    ``[first_pair, first_pair + PAIRS)`` over ``group`` heads touches."""
    return first_pair // group, (first_pair + PAIRS - 1) // group


@triton.jit
def union_keys_kernel(ROUTES, KEYS, s_q, k, kv_length, n_tiles, sr_b, sr_s, sr_k, per_sort, sentinel, group_size,
                      T: tl.constexpr, SHIFT: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr,
                      PAIRS: tl.constexpr = 0):
    """Program (group, chunk): BLOCK of the T * K sort keys of one tile (group = batch
    row * n_tiles + tile), straight from the routes ``[B, S_q, K]`` (any strides, int32
    or int64): key i is row ``i // K`` of the tile, route ``i % K``;
    ``(group % per_sort) << KEY_BITS | (id << SHIFT | row)``, or ``sentinel`` in the low
    bits where the ID is outside [0, kv_length) or the row is past S_q. With ``PAIRS``,
    tile p is the flat program of pairs ``[p * PAIRS, (p + 1) * PAIRS)`` over
    ``group_size`` heads: its rows start at the first pair's and stop after the last's."""
    group = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_range = i < T * k
    t = i // k
    tile = group % n_tiles
    if PAIRS == 0:
        row = tile * T + t
        row_ok = in_range & (row < s_q)
    else:
        first_row, last_row = _program_rows(tile * PAIRS, PAIRS, group_size)
        row = first_row + t
        row_ok = in_range & (row < s_q) & (row <= last_row)
    ptr = ROUTES + (group // n_tiles) * sr_b + row.to(tl.int64) * sr_s + (i % k).to(tl.int64) * sr_k
    ids = tl.load(ptr, mask=row_ok, other=-1)
    # compared in the routes' dtype: huge int64 IDs must not wrap into range
    valid = row_ok & (ids >= 0) & (ids < kv_length)
    key_type = KEYS.dtype.element_ty
    low = tl.where(valid, (tl.where(valid, ids, 0).to(key_type) << SHIFT) + t.to(key_type), sentinel)
    high = (group % per_sort).to(key_type) << KEY_BITS
    tl.store(KEYS + group * (T * k) + i, high | low.to(key_type), mask=in_range)


@triton.jit
def union_from_sorted_kernel(KEYS, UNION, ROWBITS, COUNT, n_keys, width, low_mask, sentinel,
                             SHIFT: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """One program per group: KEYS [n_groups, n_keys] ascending per group, each
    ``(group << b) | (id << SHIFT | row)`` (or ``sentinel`` in the low bits: no
    route); UNION [n_groups, width] must hold -1 and ROWBITS zeros on entry."""
    group = tl.program_id(0).to(tl.int64)
    keys = KEYS + group * n_keys
    out = group * width
    carry = tl.reduce(tl.full([1], 0, tl.int32), 0, _SUM)
    if INTERPRET:
        start = 0
        while start < n_keys:
            carry = _union_step(start, n_keys, keys, UNION + out, ROWBITS + out, low_mask, sentinel, carry,
                                SHIFT, BLOCK)
            start += BLOCK
    else:
        for start in range(0, n_keys, BLOCK):
            carry = _union_step(start, n_keys, keys, UNION + out, ROWBITS + out, low_mask, sentinel, carry,
                                SHIFT, BLOCK)
    tl.store(COUNT + group + tl.arange(0, 1), tl.full([1], 0, tl.int32) + carry)


@triton.jit
def _union_step(start, n_keys, keys, union, rowbits, low_mask, sentinel, carry,
                SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    in_range = offs < n_keys
    low = tl.load(keys + offs, mask=in_range, other=sentinel) & low_mask
    prev = tl.load(keys + offs - 1, mask=in_range & (offs > 0), other=-1) & low_mask
    valid = low != sentinel
    ids = low >> SHIFT
    first = valid & (ids != (prev >> SHIFT))
    slot = carry + tl.associative_scan(first.to(tl.int32), 0, _SUM) - 1
    tl.store(union + slot, ids.to(tl.int32), mask=first)
    bit = tl.full([BLOCK], 1, tl.int32) << (low & ((1 << SHIFT) - 1)).to(tl.int32)
    tl.atomic_or(rowbits + slot, bit, mask=valid, sem="relaxed")
    return carry + tl.reduce(first.to(tl.int32), 0, _SUM)


@triton.jit
def split_unions_kernel(UNION, ROWBITS, COUNT, SUB_UNION, SUB_ROWBITS, SUB_COUNT,
                        n_tiles, width, n_sub, sub_width, group,
                        SUB_T: tl.constexpr, PARTS: tl.constexpr, PAIRS: tl.constexpr,
                        BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (sub-union, batch row): keep the parent tile's IDs with a bit in the
    sub-union's row window, in order, with those bits shifted down to bit 0. Sub-union
    s is part ``s % PARTS`` of tile ``s // PARTS``; its window is rows
    ``[part * SUB_T, (part + 1) * SUB_T)`` (``PAIRS`` = 0) or, for flat programs of
    PAIRS (row, head) pairs over ``group`` heads, the rows those pairs touch.
    Parents are [B, n_tiles, width]; sub-unions [B, n_sub, sub_width], SUB_UNION
    holding -1 and SUB_ROWBITS zeros on entry."""
    sub = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    parent = b * n_tiles + sub // PARTS
    if PAIRS == 0:
        shift = (sub % PARTS) * SUB_T
        mask = (1 << SUB_T) - 1
    else:
        shift, last_row = _program_rows((sub % PARTS) * PAIRS, PAIRS, group)
        mask = (1 << (last_row - shift + 1)) - 1
    count = _load_count(COUNT, parent)
    out = (b * n_sub + sub) * sub_width
    carry = tl.reduce(tl.full([1], 0, tl.int32), 0, _SUM)
    if INTERPRET:
        start = 0
        while start < count:
            carry = _split_step(start, count, UNION + parent * width, ROWBITS + parent * width,
                                SUB_UNION + out, SUB_ROWBITS + out, sub_width, shift, mask, carry, BLOCK)
            start += BLOCK
    else:
        for start in range(0, count, BLOCK):
            carry = _split_step(start, count, UNION + parent * width, ROWBITS + parent * width,
                                SUB_UNION + out, SUB_ROWBITS + out, sub_width, shift, mask, carry, BLOCK)
    tl.store(SUB_COUNT + b * n_sub + sub + tl.arange(0, 1), tl.full([1], 0, tl.int32) + carry)


@triton.jit
def _split_step(start, count, union, rowbits, sub_union, sub_rowbits, sub_width, shift, mask, carry,
                BLOCK: tl.constexpr):
    u = start + tl.arange(0, BLOCK)
    u_ok = u < count
    ids = tl.load(union + u, mask=u_ok, other=-1)
    # the arithmetic shift drags int32's sign bit (row 31) down: the mask drops it
    bits = (tl.load(rowbits + u, mask=u_ok, other=0) >> shift) & mask
    keep = u_ok & (bits != 0)
    slot = carry + tl.associative_scan(keep.to(tl.int32), 0, _SUM) - 1
    # the host sizes sub-unions from K; the bound only keeps a wrong K inside memory
    tl.store(sub_union + slot, ids, mask=keep & (slot < sub_width))
    tl.store(sub_rowbits + slot, bits, mask=keep & (slot < sub_width))
    return carry + tl.reduce(keep.to(tl.int32), 0, _SUM)
