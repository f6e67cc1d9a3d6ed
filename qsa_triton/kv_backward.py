"""KV-owning dK/dV backward of QSA: bitwise reproducible, no atomics on the gradients.

Framework-neutral Triton kernels (they import triton only); ``qsa_torch._triton_deterministic``
launches them. The algorithm is the FlashAttention-2 backward split (one program owns a
K/V block and walks the query rows that attend to it; dQ is a separate pass), applied to
route sets:

* **Inverse route index.** Keys are cut into blocks of BLOCK_N consecutive keys of one
  batch row. For block ``j`` of batch row ``b`` (segment ``b * n_blocks + j``) the index
  holds, from ``start[seg]`` to ``start[seg + 1]``, the ascending distinct query rows that
  route to any key of the block, and per row a 64-bit mask whose bit ``n`` says that the
  row routes to key ``j * BLOCK_N + n``. Built from the routes by
  :func:`inverse_keys_kernel` (one sort key per route entry, naming its batch row, key
  block and query row), a sort, an inclusive prefix count of the first key of each
  (segment, row) pair, and :func:`inverse_from_sorted_kernel` (the row of each pair;
  the key bits ORed in, and OR does not depend on the order of the adds).
* **dK/dV.** Program (j, b * Hkv + g) loads K/V of its block once and walks its rows'
  (row, head) pairs ``p`` (row ``p // G``, head ``g * G + p % G``; the G heads of one KV
  head all feed the same dK/dV) in chunks of BLOCK_M pairs, in index order. Per chunk,
  with L the forward's natural-log LSE and delta = sum_d dO * O:
  S = scale * Q K^T (entries outside the row's mask excluded), P = exp(S - L),
  dV += P^T dO, dP = dO V^T, dS = P * (dP - delta), dK += scale * dS^T Q, in fp32
  registers; stored once, in the output dtype. Every key of [0, S_kv) belongs to exactly
  one program per (b, g), so each element is written exactly once (zero where no row
  routes to it), and each program's sums run in a fixed order: the result is bitwise
  reproducible run to run.

Expected work relative to the fused atomic backward of the token-gather backend
(docs/design-token-gather.md). That pass runs five products per (pair, union ID): Q K^T,
dO V^T, dS K, P^T dO, dS^T Q, over its query tiles' unions (1.5-1.6x the useful entries
at S = 32768 for tiles of 10-11 rows, QSA routes), and adds each union chunk's dK/dV with
fp32 atomics. The deterministic backward runs a dQ pass (three products over the same
unions) plus this kernel: four products (Q K^T and dO V^T a second time, P^T dO, dS^T Q)
over ``sum_j |rows(j)| * BLOCK_N`` entries per head, so its inflation is the union of
routing rows per key block. QSA routes select scattered four-token blocks, and far from
the diagonal a row routes to few keys of a key block: on the benchmark's routes
(qsa_common generators, top_k 512) the inflation is 6.5x at S = 32768 for BLOCK_N = 64,
4.7x for 32 and 3.0x for 16 (2.3x, BLOCK_N = 64, at S = 8192). At S = 32768 and BLOCK_N
= 32 this kernel thus runs 4 * 4.7 / (5 * 1.57) = 2.4x the fused pass's flops (the
deterministic backward with its dQ pass 3.0x), and it gathers each routing row's Q and
dO once per key block the row touches (about 290 blocks of 32 keys per row; 200 of 64,
380 of 16) where the fused pass gathers K/V once per query tile.

Hopper shape: BLOCK_N and BLOCK_M powers of two >= 16 (every dot has M, N, K >= 16). The
dK/dV accumulators are held transposed, 2 * D_PAD * BLOCK_N fp32 (2 * 256 * 64 at D = 256
and BLOCK_N = 64: 128 registers per thread with 8 warps), so that the dK/dV products have
M = D_PAD for any BLOCK_N; K/V of the block are read once into shared memory (one
pipeline stage keeps that copy out of the loop) and each step gathers one chunk of Q/dO.
Compiled for sm_90a (ptxas, 8 warps, one stage, 16-bit, D = 256), BLOCK_N x BLOCK_M =
32 x 128 and 16 x 128 spill nothing (172 and 152 KiB of shared memory), 64 x 64 244
bytes. Long unions (early keys are routed by many rows) make long
programs: the launch takes segments longest first (``ORDER``); none is split.

Signature order is the launchers' contract (``qsa_triton.launch``): array inputs, fp32
scalars, outputs, then integers and constexprs (by keyword).

Offsets: per-program base pointers and the gathered rows' offsets are int64. Rows past a
segment's end are masked (bits 0, Q/dO zero), so they contribute exactly nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .language import LOG2E, LOG2E_C, cast, load_count, mm

__all__ = ["LOG2E", "inverse_keys_kernel", "inverse_from_sorted_kernel", "kv_backward_kernel"]


# ------------------------------------------------------------------ inverse route index
# Sort keys: (b * (n_blocks + 1) + j) * S_q + i for a route of query row i (batch row b)
# to key block j; a padding route takes block n_blocks of its batch row (one past the
# last), so every batch row's keys sort within their own range.
@triton.jit
def inverse_keys_kernel(ROUTES, KEYS, n_entries, s_q, k, kv_length, n_blocks, sr_b, sr_s, sr_k,
                        LOG2_BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    """The sort key of each route entry ``e = (b * S_q + i) * K + slot`` of ``ROUTES
    [B, S_q, K]`` (int32/int64, any strides) into the flat KEYS (int32 or int64)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = e < n_entries
    slot = e % k
    i = (e // k) % s_q
    b = e // k // s_q
    ids = tl.load(ROUTES + b * sr_b + i * sr_s + slot * sr_k, mask=in_range, other=-1)
    # compared in the routes' dtype: huge int64 IDs must not wrap into range
    valid = (ids >= 0) & (ids < kv_length)
    block = tl.where(valid, tl.where(valid, ids, 0).to(tl.int64) >> LOG2_BLOCK_N, n_blocks)
    key = (b * (n_blocks + 1) + block) * s_q + tl.where(valid, i, 0)
    tl.store(KEYS + e, key.to(KEYS.dtype.element_ty), mask=in_range)


@triton.jit
def inverse_from_sorted_kernel(KEYS, SOURCE, SLOTS, ROUTES, ROWS, BITS, n_entries, s_q, k, n_blocks,
                               sr_b, sr_s, sr_k, LOG2_BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    """Rows and key masks of the index from the sorted keys.

    ``KEYS`` ascending; ``SOURCE[e]``: the route entry (numbered as by
    :func:`inverse_keys_kernel`) that sorted key ``e`` came from; ``SLOTS[e]``: how many
    (block, row) pairs start at or before ``e`` (an inclusive prefix count). Key ``e``
    belongs to pair ``SLOTS[e] - 1``: the pair's first key writes its row into ``ROWS``
    (int32), every key ORs bit ``id % BLOCK_N`` of its route into ``BITS`` (int64, zero
    on entry)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = e < n_entries
    key = tl.load(KEYS + e, mask=in_range, other=0).to(tl.int64)
    prev = tl.load(KEYS + e - 1, mask=in_range & (e > 0), other=-1).to(tl.int64)
    valid = in_range & ((key // s_q) % (n_blocks + 1) != n_blocks)
    pair = tl.load(SLOTS + e, mask=valid, other=1).to(tl.int64) - 1
    tl.store(ROWS + pair, (key % s_q).to(tl.int32), mask=valid & (key != prev))
    entry = tl.load(SOURCE + e, mask=valid, other=0)
    ids = tl.load(ROUTES + entry // k // s_q * sr_b + entry // k % s_q * sr_s + entry % k * sr_k,
                  mask=valid, other=0)
    bit = tl.full([BLOCK], 1, tl.int64) << (ids.to(tl.int64) & ((1 << LOG2_BLOCK_N) - 1))
    tl.atomic_or(BITS + pair, bit, mask=valid, sem="relaxed")


# ------------------------------------------------------------------------------ dK/dV
@triton.jit
def _kv_step(p0, n_pairs, first, rows, bits_ptr, q_base, do_base, lse_base, delta_base,
             sq_s, sq_h, sq_d, sdo_s, sdo_h, sdo_d, sl_h, sl_s, sdl_h, sdl_s,
             g, G, k, v, n, d, d_ok, dk, dv, scale_log2,
             BLOCK_M: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """One chunk of BLOCK_M (row, head) pairs of the block's rows; returns dK^T, dV^T
    ``[D_PAD, BLOCK_N]`` (dK unscaled)."""
    p = p0 + tl.arange(0, BLOCK_M)
    ok = p < n_pairs
    u = first + p // G
    head = (g * G + p % G).to(tl.int64)
    row = tl.load(rows + u, mask=ok, other=0).to(tl.int64)
    bits = tl.load(bits_ptr + u, mask=ok, other=0)
    io_mask = ok[:, None] & d_ok[None, :]
    q = tl.load(q_base + row[:, None] * sq_s + head[:, None] * sq_h + d[None, :] * sq_d, mask=io_mask, other=0.0)
    do = tl.load(do_base + row[:, None] * sdo_s + head[:, None] * sdo_h + d[None, :] * sdo_d, mask=io_mask,
                 other=0.0)
    lse_log2 = tl.load(lse_base + head * sl_h + row * sl_s, mask=ok, other=0.0) * LOG2E_C
    delta = tl.load(delta_base + head * sdl_h + row * sdl_s, mask=ok, other=0.0)
    # bit n of the int64 mask, tested on its 32-bit halves (int32 shifts, and no
    # [BLOCK_M, BLOCK_N] int64 shift amounts held across the loop)
    word = tl.where((n < 32)[None, :], bits.to(tl.int32)[:, None], (bits >> 32).to(tl.int32)[:, None])
    member = ((word >> (n & 31)[None, :]) & 1) != 0
    s = mm(q, tl.trans(k), IEEE) * scale_log2
    # where, not a product: S and dP of keys no row routes to may be inf/NaN (such K/V
    # rows may hold anything) and must not reach the sums
    prob = tl.where(member, tl.exp2(s - lse_log2[:, None]), 0.0)
    dp = mm(do, tl.trans(v), IEEE)
    ds = tl.where(member, prob * (dp - delta[:, None]), 0.0)
    # transposed products, dV^T += dO^T P and dK^T += Q^T dS: M = D_PAD fills the wgmma
    # tiles of both warpgroups whatever BLOCK_N is, and every operand is read from
    # shared memory
    dv += mm(tl.trans(do), cast(prob, do.dtype, INTERPRET), IEEE)
    dk += mm(tl.trans(q), cast(ds, q.dtype, INTERPRET), IEEE)
    return dk, dv


@triton.jit
def kv_backward_kernel(
    Q, K, V, DO, LSE, DELTA, ROWS, BITS, START, ORDER, scale, scale_log2, DK, DV,
    sq_b, sq_s, sq_h, sq_d,
    sk_b, sk_s, sk_h, sk_d,
    sv_b, sv_s, sv_h, sv_d,
    sdo_b, sdo_s, sdo_h, sdo_d,
    sl_b, sl_h, sl_s,
    sdl_b, sdl_h, sdl_s,
    sdk_b, sdk_s, sdk_h, sdk_d,
    sdv_b, sdv_s, sdv_h, sdv_d,
    S_kv, N_BLOCKS, HKV, G, D,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, D_PAD: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr, EVEN_D: tl.constexpr,
):
    """dK, dV [B, S_kv, Hkv, D] (their own dtype) of one key block and KV head.

    Q, DO ``[B, S_q, Hq, D]``; K, V ``[B, S_kv, Hkv, D]``; LSE (natural log) and DELTA
    (sum_d dO * O) fp32 ``[B, Hq, S_q]``; ROWS int32, BITS int64 and START int64
    ``[B * N_BLOCKS + 1]``: the inverse route index with BLOCK_N keys per block. Any
    strides. One-dimensional grid of ``B * N_BLOCKS * HKV`` programs: program p takes
    KV head ``p % HKV`` of segment ``ORDER[p // HKV]`` (segment b * N_BLOCKS + j: batch
    row b, keys from j * BLOCK_N); ORDER (int32, a permutation) lists the segments
    longest first, so that the long ones start first (longest-processing-time order: the
    results do not depend on it). Writes every element of DK and DV below S_kv.
    ``EVEN_D``: D == D_PAD.
    """
    pid = tl.program_id(0)
    g = (pid % HKV).to(tl.int64)
    seg = load_count(ORDER, pid // HKV).to(tl.int64)
    b = seg // N_BLOCKS
    blk = seg % N_BLOCKS
    n = tl.arange(0, BLOCK_N)
    key = blk * BLOCK_N + n
    d = tl.arange(0, D_PAD)
    d_ok = d < D_PAD if EVEN_D else d < D  # EVEN_D (D == D_PAD): no masks along D
    kv_mask = (key < S_kv)[:, None] & d_ok[None, :]
    k = tl.load(K + b * sk_b + g * sk_h + key[:, None] * sk_s + d[None, :] * sk_d, mask=kv_mask, other=0.0)
    v = tl.load(V + b * sv_b + g * sv_h + key[:, None] * sv_s + d[None, :] * sv_d, mask=kv_mask, other=0.0)

    first = load_count(START, seg)
    # pairs within one segment are numbered in int32 (the host checks S_q * G < 2**31)
    n_pairs = ((load_count(START, seg + 1) - first) * G).to(tl.int32)
    q_base = Q + b * sq_b
    do_base = DO + b * sdo_b
    lse_base = LSE + b * sl_b
    delta_base = DELTA + b * sdl_b
    dk = tl.full([D_PAD, BLOCK_N], 0.0, tl.float32)  # transposed: dK^T, dV^T
    dv = tl.full([D_PAD, BLOCK_N], 0.0, tl.float32)
    if INTERPRET:
        p0 = 0
        while p0 < n_pairs:
            dk, dv = _kv_step(p0, n_pairs, first, ROWS, BITS, q_base, do_base, lse_base, delta_base,
                              sq_s, sq_h, sq_d, sdo_s, sdo_h, sdo_d, sl_h, sl_s, sdl_h, sdl_s,
                              g, G, k, v, n, d, d_ok, dk, dv, scale_log2, BLOCK_M, IEEE, INTERPRET)
            p0 += BLOCK_M
    else:
        for p0 in range(0, n_pairs, BLOCK_M):
            dk, dv = _kv_step(p0, n_pairs, first, ROWS, BITS, q_base, do_base, lse_base, delta_base,
                              sq_s, sq_h, sq_d, sdo_s, sdo_h, sdo_d, sl_h, sl_s, sdl_h, sdl_s,
                              g, G, k, v, n, d, d_ok, dk, dv, scale_log2, BLOCK_M, IEEE, INTERPRET)

    # the store's coordinates again, from a segment the compiler cannot prove equal to the
    # prologue's (n_pairs is never negative): no [BLOCK_N, D_PAD] masks held over the loop
    seg = tl.where(n_pairs < 0, 0, seg)
    b = seg // N_BLOCKS
    key = seg % N_BLOCKS * BLOCK_N + n
    out_mask = d_ok[:, None] & (key < S_kv)[None, :]
    dk_ptr = DK + b * sdk_b + g * sdk_h + key[None, :] * sdk_s + d[:, None] * sdk_d
    tl.store(dk_ptr, cast(dk * scale, DK.dtype.element_ty, INTERPRET), mask=out_mask)
    dv_ptr = DV + b * sdv_b + g * sdv_h + key[None, :] * sdv_s + d[:, None] * sdv_d
    tl.store(dv_ptr, cast(dv, DV.dtype.element_ty, INTERPRET), mask=out_mask)
