"""``@triton.jit`` helpers shared by the token-gather kernels.

Rules every kernel here follows:

* Reductions go through the builtin ``tl.reduce`` with the standard library's combine
  functions (no ``tl.sum`` / ``tl.max`` / ``tl.zeros``): those are jitted helpers, which
  break the interpreter when triton was imported before ``TRITON_INTERPRET`` was set,
  while the builtin with the standard combine functions runs there as a numpy reduction.
* ``INTERPRET`` (constexpr) selects interpreter-safe forms: while-loops over runtime
  bounds, round-to-nearest bf16 casts, fp32 dots (``IEEE``).
* ``FOLD`` (constexpr) is the launch grid's fold (:func:`qsa_triton.plan.fold_grid`):
  with FOLD == 1 a program's coordinates are its program ids, unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

# kernels may only read globals that are constexpr (or jitted functions)
LOG2E_C = tl.constexpr(1.4426950408889634)
LN2_C = tl.constexpr(0.6931471805599453)


@triton.jit
def mm(a, b, IEEE: tl.constexpr):
    """fp32-accumulated a @ b; exact fp32 products (no TF32) for fp32 inputs.

    ``IEEE`` is set for fp32 inputs and in the interpreter, whose dot multiplies the
    raw bits of bf16 operands: there both operands are widened to fp32 first.
    """
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _or(a, b):
    return a | b


SUM = getattr(tl.standard, "_sum_combine", _add)
MAX = getattr(tl.standard, "_elementwise_max", _maximum)
OR = getattr(tl.standard, "_or_combine", _or)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """Round-to-nearest-even downcast of fp32 ``x``. The interpreter truncates
    fp32 -> bf16 casts, so there the rounding is done on the bits first."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def finite(x):
    """Elementwise: x is neither NaN nor +-inf."""
    return tl.abs(x.to(tl.float32)) < float("inf")


@triton.jit
def confine_non_finite(delta, lse):
    """The backward's guard that keeps a non-finite query or dO row within its reach.

    The dK/dV products sum over all of a program's rows, and 0 * NaN is NaN: a NaN or
    inf entry of row m's q or dO would reach every key of the tile's union, routed by
    row m or not. Such a row shows in its own statistics: a non-finite q makes the
    forward's LSE (computed from it) NaN or infinite (+inf: no routes, then q and dO are
    not read), since every score of the row is then non-finite, and a non-finite dO
    makes delta = dO . O non-finite. So where the LSE or delta is not finite the row is
    *confined*: it gets LSE NaN and delta 0 (returned: ``(delta, lse)``, unchanged for
    other rows; ``lse`` in either log base; a confined row is one whose returned LSE is
    NaN), and the caller drops the non-finite entries of q and the whole dO row of a
    confined row (reads them as 0) in the operands the products read: the row's P, and
    so its dS and dQ, are NaN at exactly the keys it routes (P is 0 elsewhere, and dS =
    P (dP - delta) with dP = 0 and delta = 0 is 0 there), and the products carry that NaN
    to those keys' dK and dV, every lane; everywhere else the row adds exact zeros, and
    none of its finite entries enters a finite sum (which the deterministic backward's
    bound relies on: ``qsa_triton.fixed_point``). A float64 gather reference gives the
    same non-finite dQ and dK; where dO is poisoned its dV is non-finite only at the
    poisoned lanes of the routed keys, here at all of them. The loop is not touched."""
    ok = finite(lse) & finite(delta)
    return tl.where(ok, delta, 0.0), tl.where(ok | (lse == float("inf")), lse, float("nan"))


@triton.jit
def load_count(COUNT, index):
    """A union's length as a scalar loop bound (a 1-element reduction keeps the
    interpreter, whose scalars are 1-element arrays, happy; free on the GPU)."""
    return tl.reduce(tl.load(COUNT + index + tl.arange(0, 1)), 0, SUM)


@triton.jit
def program_xy(NX, NY, FOLD: tl.constexpr):
    """``(x, y, live)``: this program's coordinates in the unfolded ``NX x NY`` grid.

    With FOLD > 1, programs past NY are dead: ``live`` is False and y is clamped to
    NY - 1 so that their addresses stay in bounds; the caller masks all their work off
    (with ``tl.where(live, mask, False)``: the interpreter mistypes ``mask & live``)."""
    if FOLD == 1:  # every program is live (the flag is unused there, and compiled away)
        return tl.program_id(0), tl.program_id(1), tl.program_id(1) >= 0
    else:
        pid = tl.program_id(0)
        y = pid // NX + FOLD * tl.program_id(1)
        return pid % NX, tl.minimum(y, NY - 1), y < NY


@triton.jit
def pair_coordinates(tile, pid, S_q, HKV, G, HB: tl.constexpr, T: tl.constexpr, N_CHUNKS,
                     FLAT: tl.constexpr):
    """Per matrix row m of program (``tile``, ``pid``): its bit t in ``rowbits``, query
    head and row (int64, 0 where invalid) and validity.

    Padded tiles (m = t * HB + j): T rows of one batch row, heads ``chunk * HB + j``.
    Flat (FLAT, T = 1, N_CHUNKS = 1): program p's rows are the (row, head) pairs
    ``p * HB + m`` of one KV head's group, in row-major order, and t counts query rows
    from the program's first one."""
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
def program_tile(COUNT, B, S_q, N_TILES, HKV, G, D, N_CHUNKS, HB: tl.constexpr, T: tl.constexpr,
                 D_PAD: tl.constexpr, FLAT: tl.constexpr, FOLD: tl.constexpr):
    """What the forward and backward programs start from: tile, batch row and KV head
    (int64), the matrix rows' :func:`pair_coordinates`, the head-dim lanes, the
    [M, D_PAD] load/store mask and the tile's union length (0 for dead programs)."""
    tile, pid, live = program_xy(N_TILES, B * HKV * N_CHUNKS, FOLD)
    b64 = (pid // N_CHUNKS // HKV).to(tl.int64)
    g64 = (pid // N_CHUNKS % HKV).to(tl.int64)
    t, head, row64, row_ok = pair_coordinates(tile, pid, S_q, HKV, G, HB, T, N_CHUNKS, FLAT)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    count = load_count(COUNT, b64 * N_TILES + tile)
    if FOLD > 1:
        row_ok = tl.where(live, row_ok, False)
        count = tl.where(live, count, 0)
    io_mask = row_ok[:, None] & d_ok[None, :]
    return tile, b64, g64, t, head, row64, row_ok, d, d_ok, io_mask, count


@triton.jit
def pair_pointers(base, b64, row64, head, d, s_b, s_s, s_h, s_d):
    """[M, D_PAD] pointers to the program's (row, head) pairs' head-dim lanes ``d`` in a
    ``[B, S, H, D]`` operand at ``base`` with strides ``s_*`` (Q, O, dO, dQ), every term in
    int64: ``d * s_d`` can pass int32, and the host's OFFS32 check covers K/V/dK/dV only."""
    return base + b64 * s_b + row64[:, None] * s_s + head[:, None] * s_h + d.to(tl.int64)[None, :] * s_d


@triton.jit
def gather_chunk(start, count, union, rowbits, k_base, v_base, sk_s, sk_d, sv_s, sv_d, d, d_ok, t, row_ok,
                 BLOCK_K: tl.constexpr, EVEN_D: tl.constexpr, OFFS32: tl.constexpr):
    """Union chunk [start, start + BLOCK_K): IDs, K/V rows, the [BLOCK_K, D_PAD] mask of
    the head-dim lanes, and membership.

    Entry u >= ``count`` (only in a union's last chunk, ``start < count``) takes the ID
    at ``u - count``, or at 0 where that is past the union too, with no membership bits.

    * Only rows the program's own rows route to are read: an unrouted K/V row (which may
      hold anything, even inf) never is.
    * The repeats' P and dS are 0, so the backward adds zeros for them. While ``count >=
      BLOCK_K`` they fall on IDs before ``start``, distinct from the chunk's own; in a
      shorter union they may repeat an ID of the chunk (atomics allow it).
    * A non-finite value in a routed V row meets P = 0 in a repeat (0 * inf = NaN), as it
      already did for the tile's non-member rows in the row's own slot: a member row's
      +-inf output lane may then come out NaN. Non-finite stays non-finite.

    So no per-column mask is needed: with ``EVEN_D`` (D == D_PAD) the loads and the
    backward's adds are unmasked (constant-true masks), which removes a predicate per
    16-byte copy and a branch per atomic from the compiled loop.

    ``OFFS32``: every element offset from the K/V/dK/dV base pointers fits int32 (the
    host checks), so the per-element address arithmetic stays 32-bit."""
    u = start + tl.arange(0, BLOCK_K)
    u_ok = u < count
    src = tl.where(u_ok, u, u - count)
    rows = tl.load(union + tl.where(src < count, src, 0))
    bits = tl.load(rowbits + u, mask=u_ok, other=0)
    if not OFFS32:
        rows = rows.to(tl.int64)
        d = d.to(tl.int64)
    k_off = rows[:, None] * sk_s + d[None, :] * sk_d
    v_off = rows[:, None] * sv_s + d[None, :] * sv_d
    if EVEN_D:
        kv_mask = tl.full((BLOCK_K, d.shape[0]), 1, tl.int1)
    else:
        kv_mask = tl.broadcast_to(d_ok[None, :], (BLOCK_K, d.shape[0]))
    k = tl.load(k_base + k_off, mask=kv_mask, other=0.0)
    v = tl.load(v_base + v_off, mask=kv_mask, other=0.0)
    member = (((bits[None, :] >> t[:, None]) & 1) != 0) & row_ok[:, None]
    return rows, kv_mask, k, v, member


@triton.jit
def program_rows(first_pair, PAIRS: tl.constexpr, group):
    """First and last query row (inclusive) that the flat program of (row, head) pairs
    ``[first_pair, first_pair + PAIRS)`` over ``group`` heads touches
    (``qsa_triton.plan.program_rows`` on the host)."""
    return first_pair // group, (first_pair + PAIRS - 1) // group


@triton.jit
def group_routes(ROUTES, group, i, live, sr_b, sr_s, sr_k, s_q, k, kv_length, n_tiles, group_size,
                 T: tl.constexpr, PAIRS: tl.constexpr, FOLD: tl.constexpr):
    """Routes ``i`` (a block of the T * K routes, row-major) of union group ``group``
    (int64; batch row ``group // n_tiles``): rows ``[tile * T, (tile + 1) * T)``, or with
    ``PAIRS`` the rows flat program ``tile`` of PAIRS pairs over ``group_size`` heads
    touches. Returns each route's row within the group (t), its ID (-1 where the row is
    out of range), whether the ID is a valid one in ``[0, kv_length)``, and ``i < T * K``."""
    in_range = i < T * k
    if FOLD > 1:
        in_range = tl.where(live, in_range, False)
    t = i // k
    tile = group % n_tiles
    if PAIRS == 0:
        row = tile * T + t
        row_ok = in_range & (row < s_q)
    else:
        first_row, last_row = program_rows(tile * PAIRS, PAIRS, group_size)
        row = first_row + t
        row_ok = in_range & (row < s_q) & (row <= last_row)
    ptr = ROUTES + (group // n_tiles) * sr_b + row.to(tl.int64) * sr_s + (i % k).to(tl.int64) * sr_k
    ids = tl.load(ptr, mask=row_ok, other=-1)
    # compared in the routes' dtype: huge int64 IDs must not wrap into range
    valid = row_ok & (ids >= 0) & (ids < kv_length)
    return t, ids, valid, in_range


@triton.jit
def fill(ptr, start, end, value: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """``ptr[start:end] = value`` (int32), ``BLOCK`` entries per step."""
    if INTERPRET:
        i = start
        while i < end:
            offs = i + tl.arange(0, BLOCK)
            tl.store(ptr + offs, tl.full([BLOCK], value, tl.int32), mask=offs < end)
            i += BLOCK
    else:
        for i in range(start, end, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(ptr + offs, tl.full([BLOCK], value, tl.int32), mask=offs < end)
