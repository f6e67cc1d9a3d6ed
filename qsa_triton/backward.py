"""Fused backward kernel: dQ kept in registers (written once), dK/dV by atomics.

Programs are laid out as the forward's (``forward.py``), over the backward's tiles. Each
union chunk adds its [BLOCK_K, D] dK and dV blocks to accumulators as soon as they are
computed (a union's IDs are distinct; the last chunk's columns past the union's count
repeat IDs from its start and add zeros there, see ``language.gather_chunk``).

By default the blocks are fp32 and so are the accumulators; the order in which programs
add is the GPU's, so dK/dV are not bitwise reproducible from run to run. With the
``DETERMINISTIC`` constexpr the same blocks are added as int64 fixed point
(``fixed_point.py``: scaled by a power of two from a bound on the gradients, rounded to
nearest; FLAG says which sums a NaN reached): integer sums do not depend on the order of
the adds, so dK/dV are bitwise reproducible. Everything else (tiles, unions, the products, dQ) is the default
backward's; dQ was reproducible already (each (row, head) pair belongs to one program).

Signature order is the launchers' contract (``qsa_triton.launch``): array inputs, fp32
scalars, outputs, then integers and constexprs (by keyword).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fixed_point import add_fixed, fixed_point_factors
from .language import (
    LOG2E_C,
    OR,
    SUM,
    cast,
    confine_non_finite,
    finite,
    gather_chunk,
    mm,
    pair_coordinates,
    pair_pointers,
    program_tile,
    program_xy,
)


@triton.jit
def _add_block(ptr, block, mask, factor, DETERMINISTIC: tl.constexpr, INTERPRET: tl.constexpr):
    """Atomically add an fp32 ``block``: as is, or (DETERMINISTIC) times ``factor`` (a
    power of two) rounded to int64."""
    if DETERMINISTIC:
        add_fixed(ptr, block * factor, mask, INTERPRET)
    else:
        tl.atomic_add(ptr, block, mask=mask, sem="relaxed")


@triton.jit
def _backward_step(start, count, q, do, delta, lse_log2, t, row_ok, d, d_ok, dq, union, rowbits,
                   k_base, v_base, dk_base, dv_base, sk_s, sk_d, sv_s, sv_d, sdk_s, scale, scale_log2,
                   fix_k, fix_v,
                   BLOCK_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                   EVEN_D: tl.constexpr, OFFS32: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """dQ update and the chunk's dK/dV atomic adds; returns the new dQ (unscaled)."""
    rows, kv_mask, k, v, member = gather_chunk(
        start, count, union, rowbits, k_base, v_base, sk_s, sk_d, sv_s, sv_d, d, d_ok, t, row_ok, BLOCK_K,
        EVEN_D, OFFS32)
    s = mm(q, tl.trans(k), IEEE) * scale_log2
    p = tl.where(member, tl.exp2(s - lse_log2[:, None]), 0.0)
    dp = mm(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    dq += mm(cast(ds, k.dtype, INTERPRET), k, IEEE)
    # columns past count repeat union IDs with P = dS = 0: they add zeros (gather_chunk),
    # so the adds carry only the head-dim mask. Each [BLOCK_K, D] block is
    # added as soon as it is computed, so only one of them holds registers.
    # dV^T = dO^T P and dK^T = Q^T dS: both wgmma operands can come from shared memory
    # (no [BLOCK_K, D] 16-bit operand held in registers); the adds stay 4-wide along D.
    acc_off_t = rows[None, :] * sdk_s + d[:, None]
    kv_mask_t = tl.trans(kv_mask)
    dv_t = mm(tl.trans(do), cast(p, do.dtype, INTERPRET), IEEE)
    _add_block(dv_base + acc_off_t, dv_t, kv_mask_t, fix_v, DETERMINISTIC, INTERPRET)
    dk_t = mm(tl.trans(q), cast(ds, q.dtype, INTERPRET), IEEE) * scale
    _add_block(dk_base + acc_off_t, dk_t, kv_mask_t, fix_k, DETERMINISTIC, INTERPRET)
    return dq


@triton.jit
def flag_routed_keys(FLAG, union, rowbits, count, bad_bits, flag_base, flag_stride, BLOCK: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """``FLAG[flag_base + id * flag_stride] = 1`` (int32) for every ID among the first
    ``count`` of ``union`` whose ``rowbits`` meet ``bad_bits`` (the program's confined
    rows), ``BLOCK`` entries per step; nothing when ``bad_bits`` is 0. Programs that flag
    the same key all store 1: the result does not depend on their order."""
    if bad_bits != 0:
        if INTERPRET:
            start = 0
            while start < count:
                _flag_step(FLAG, union, rowbits, count, bad_bits, flag_base, flag_stride, start, BLOCK)
                start += BLOCK
        else:
            for start in range(0, count, BLOCK):
                _flag_step(FLAG, union, rowbits, count, bad_bits, flag_base, flag_stride, start, BLOCK)


@triton.jit
def _flag_step(FLAG, union, rowbits, count, bad_bits, flag_base, flag_stride, start, BLOCK: tl.constexpr):
    u = start + tl.arange(0, BLOCK)
    u_ok = u < count
    ids = tl.load(union + u, mask=u_ok, other=0)
    hit = u_ok & ((tl.load(rowbits + u, mask=u_ok, other=0) & bad_bits) != 0)
    tl.store(FLAG + flag_base + ids.to(tl.int64) * flag_stride, tl.full([BLOCK], 1, tl.int32), mask=hit)


@triton.jit
def qsa_backward_kernel(
    Q, K, V, O, DO, LSE, UNION, COUNT, ROWBITS, MAXIMA,
    scale, scale_log2,
    DQ, DK, DV, FLAG,
    sq_b, sq_s, sq_h, sq_d,
    sk_b, sk_s, sk_h, sk_d,
    sv_b, sv_s, sv_h, sv_d,
    so_b, so_s, so_h, so_d,
    sdo_b, sdo_s, sdo_h, sdo_d,
    sl_b, sl_h, sl_s,
    sdq_b, sdq_s, sdq_h, sdq_d,
    sdk_b, sdk_s, sdk_h,
    B, S_q, N_TILES, UNION_WIDTH, HKV, G, D, N_CHUNKS, BOUND_K, BOUND_V,
    T: tl.constexpr, HB: tl.constexpr, D_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr, FLAT: tl.constexpr, EVEN_D: tl.constexpr,
    OFFS32: tl.constexpr, FOLD: tl.constexpr, DETERMINISTIC: tl.constexpr,
):
    """Writes DQ (Q's dtype) and adds into DK/DV, [B, S_kv, Hkv, D] accumulators (last
    stride 1, DV with DK's strides) that must be zero on entry: fp32, or with
    DETERMINISTIC int64 fixed-point sums (held in any 32-bit-word buffer of that many
    bytes; the strides count int64 elements).

    O and LSE are the forward's; DO the output's gradient; the unions those of the
    backward's tiles. ``scale`` is the softmax scale and ``scale_log2`` = scale * log2(e),
    both fp32. dK/dV blocks are computed transposed and the dQ store's coordinates
    recomputed after the loop, which keeps ptxas from spilling the prologue's offsets
    and serializing the wgmma instructions at the tuned tiling.

    Read or written only with DETERMINISTIC (``fixed_point.py``): MAXIMA (fp32 [3]: max|Q|
    and max|dO| over the routed rows with a finite maximum, max|V| over the V rows with a
    finite maximum) and BOUND_K / BOUND_V (``qsa_triton.launch.fixed_point_bounds``),
    which fix the scales, and FLAG (int32 ``[1 + B * S_kv * Hkv]``, zero on entry):
    FLAG[1 + r] is set for each accumulator row r = (b * S_kv + j) * Hkv + g (the row's
    element offset / D) that a confined (row, head) pair routes
    (``language.confine_non_finite``: its dK/dV contributions there are NaN), FLAG[0]
    where another pair's dQ is non-finite (a NaN/inf met elsewhere: a routed K/V row, an
    overflow, which may have reached any of the program's keys);
    :func:`qsa_triton.fixed_point.fixed_point_kernel` converts the sums with the same
    MAXIMA and bounds and writes NaN where FLAG says.
    """
    tile, b64, g64, t, head, row64, row_ok, d, d_ok, io_mask, count = program_tile(
        COUNT, B, S_q, N_TILES, HKV, G, D, N_CHUNKS, HB, T, D_PAD, FLAT, FOLD)

    lse = tl.load(LSE + b64 * sl_b + head * sl_h + row64 * sl_s, mask=row_ok, other=float("inf"))
    lse_log2 = lse * LOG2E_C
    # a row without routes (LSE +inf; a NaN LSE is a routed row that met a NaN) adds
    # nothing to any gradient: its q and dO are not read, so whatever they hold cannot
    # reach dK/dV through 0 * NaN
    io_mask = io_mask & (lse != float("inf"))[:, None]
    q_ptr = pair_pointers(Q, b64, row64, head, d, sq_b, sq_s, sq_h, sq_d)
    do_ptr = pair_pointers(DO, b64, row64, head, d, sdo_b, sdo_s, sdo_h, sdo_d)
    do = tl.load(do_ptr, mask=io_mask, other=0.0)
    o = tl.load(pair_pointers(O, b64, row64, head, d, so_b, so_s, so_h, so_d), mask=io_mask, other=0.0)
    delta = tl.reduce(do.to(tl.float32) * o.to(tl.float32), 1, SUM)
    delta, lse_log2 = confine_non_finite(delta, lse_log2)
    # q and dO as the products read them: without non-finite entries, and no dO for a
    # confined row (LSE NaN; confine_non_finite). Loaded again with those entries masked
    # off rather than selected away, which keeps the compiled kernel's operands in the
    # shared memory they took before
    q = tl.load(q_ptr, mask=io_mask, other=0.0)
    q = tl.load(q_ptr, mask=io_mask & finite(q), other=0.0)
    do = tl.load(do_ptr, mask=io_mask & finite(do) & (lse_log2 == lse_log2)[:, None], other=0.0)

    tile_base = (b64 * N_TILES + tile) * UNION_WIDTH
    k_base = K + b64 * sk_b + g64 * sk_h
    v_base = V + b64 * sv_b + g64 * sv_h
    if DETERMINISTIC:
        # int64 accumulators (in any 32-bit-word buffer: JAX has no int64 without x64)
        fix_k, fix_v = fixed_point_factors(MAXIMA, BOUND_K, BOUND_V)
        dk_base = DK.to(tl.pointer_type(tl.int64)) + b64 * sdk_b + g64 * sdk_h
        dv_base = DV.to(tl.pointer_type(tl.int64)) + b64 * sdk_b + g64 * sdk_h
    else:
        fix_k, fix_v = 1.0, 1.0
        dk_base = DK + b64 * sdk_b + g64 * sdk_h
        dv_base = DV + b64 * sdk_b + g64 * sdk_h

    dq = tl.full([T * HB, D_PAD], 0.0, tl.float32)
    if INTERPRET:
        start = 0
        while start < count:
            dq = _backward_step(
                start, count, q, do, delta, lse_log2, t, row_ok, d, d_ok, dq,
                UNION + tile_base, ROWBITS + tile_base, k_base, v_base, dk_base, dv_base,
                sk_s, sk_d, sv_s, sv_d, sdk_s, scale, scale_log2, fix_k, fix_v, BLOCK_K, IEEE, INTERPRET,
                EVEN_D, OFFS32, DETERMINISTIC)
            start += BLOCK_K
    else:
        # Ascending IDs in every program: programs of neighbouring tiles run together over
        # nearly the same IDs, so their dK/dV adds hit rows already in L2.
        for start in range(0, count, BLOCK_K):
            dq = _backward_step(
                start, count, q, do, delta, lse_log2, t, row_ok, d, d_ok, dq,
                UNION + tile_base, ROWBITS + tile_base, k_base, v_base, dk_base, dv_base,
                sk_s, sk_d, sv_s, sv_d, sdk_s, scale, scale_log2, fix_k, fix_v, BLOCK_K, IEEE, INTERPRET,
                EVEN_D, OFFS32, DETERMINISTIC)

    if DETERMINISTIC:
        # the int64 sums cannot carry a NaN: FLAG makes the conversion write it
        # (fixed_point.py). A confined row's contributions are NaN at exactly the keys it
        # routes: the union entries whose rowbits meet its bit, flagged below. Any other
        # non-finite P or dS of this program reaches its dQ (dQ += dS K; 0 * inf is NaN
        # too) and may have reached any of its keys: FLAG[0], all of dK/dV
        confined = lse_log2 != lse_log2
        bad_bits = tl.reduce(tl.where(confined, tl.full([T * HB], 1, tl.int32) << t, 0), 0, OR)
        poisoned = tl.reduce(dq * 0.0, 1, SUM)
        tl.store(FLAG + tl.full([T * HB], 0, tl.int32), tl.full([T * HB], 1, tl.int32),
                 mask=(poisoned != poisoned) & (lse_log2 == lse_log2))

    # the store's per-row coordinates again, from a tile the compiler cannot prove equal to
    # the prologue's (count is never negative), so the prologue's int64 offsets and masks
    # are not held (spilled) across the loop
    tile, pid, live = program_xy(N_TILES, B * HKV * N_CHUNKS, FOLD)
    _, head, row64, row_ok = pair_coordinates(tl.where(count < 0, 0, tile), pid, S_q, HKV, G, HB, T,
                                              N_CHUNKS, FLAT)
    if FOLD > 1:
        row_ok = tl.where(live, row_ok, False)
    io_mask = row_ok[:, None] & d_ok[None, :]
    dq_ptr = pair_pointers(DQ, b64, row64, head, d, sdq_b, sdq_s, sdq_h, sdq_d)
    tl.store(dq_ptr, cast(dq * scale, DQ.dtype.element_ty, INTERPRET), mask=io_mask)
    if DETERMINISTIC:
        tile_base = (b64 * N_TILES + tile) * UNION_WIDTH
        flag_base = 1 + (b64 * sdk_b + g64 * sdk_h) // D
        flag_routed_keys(FLAG, UNION + tile_base, ROWBITS + tile_base, count, bad_bits, flag_base, sdk_s // D,
                         BLOCK_K, INTERPRET)


