"""Tile unions without a sort: a byte per ID, then each route's rank among the marked IDs.

One program per group (a tile, or a flat program's rows), four passes over its own
scratch, ordered by CTA barriers (docs/design-token-gather.md):

1. zero MARKS, one byte per ID (S_kv rounded up to a multiple of 32);
2. for every valid route, store 1 at its ID's byte (plain stores of one value: repeated
   IDs and rows that share IDs need no atomics);
3. per word of 32 IDs, the marked bytes as a bitmask (PRESENT, bit ``id % 32``) and the
   number of marked IDs before the word (PREFIX, a running count); the union's length
   is the total;
4. for every valid route, its slot ``PREFIX[id // 32] + popcount(PRESENT[id // 32] &
   ((1 << id % 32) - 1))`` (its ID's rank among the group's IDs): UNION[slot] = id (every
   route of an ID writes the same value) and ROWBITS[slot] |= 1 << t (atomic OR into the
   entries the program zeroed before the barrier).

The union is ascending by construction and equals the sort recipe's (``union_keys.py``,
``union_merge.py``) element for element; the entries past the count are written (-1 / 0)
only where the unions leave the library (``FILL``): the kernels read a union up to its
count, and a union that is only cut again needs nothing past it. Work per group: two
reads of its ``T * K`` routes, a store, two gathers and an atomic per route, and a pass
over ``S_kv`` bytes, so the step grows linearly in S_q at S_kv = S_q. What other threads
wrote before a barrier is read at L2 (``.cg``), never from a stale L1 line.

Signature order is the launchers' contract (``qsa_triton.launch``): array inputs, fp32
scalars, outputs, then integers and constexprs (by keyword).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .language import SUM, fill, group_routes


@triton.jit
def popcount(x):
    """Set bits of each uint32 of ``x`` (SWAR: pairs, nibbles, bytes, then a multiply that
    sums the four bytes into the top one); the interpreter has no ``popc``."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _mark_step(start, ROUTES, marks, group, sr_b, sr_s, sr_k, s_q, k, kv_length, n_tiles, group_size,
               T: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr):
    i = start + tl.arange(0, BLOCK)  # [BLOCK]
    _, ids, valid, _ = group_routes(ROUTES, group, i, group >= 0, sr_b, sr_s, sr_k, s_q, k, kv_length, n_tiles,
                                    group_size, T, PAIRS, 1)
    tl.store(marks + tl.where(valid, ids, 0).to(tl.int32), tl.full([BLOCK], 1, tl.int8), mask=valid)


@triton.jit
def _words_step(start, words, marks, present, prefix, carry, WORDS: tl.constexpr):
    w = start + tl.arange(0, WORDS)  # [WORDS]
    ok = w < words
    j = tl.arange(0, 32)  # [32]
    marked = tl.load(marks + w[:, None] * 32 + j[None, :], mask=ok[:, None], other=0,
                     cache_modifier=".cg") != 0  # [WORDS, 32]
    bits = tl.sum(marked.to(tl.uint32) << j[None, :].to(tl.uint32), axis=1)  # [WORDS], distinct bits: sum = OR
    counts = tl.sum(marked.to(tl.int32), axis=1)  # [WORDS]
    tl.store(present + w, bits.to(tl.int32, bitcast=True), mask=ok)
    tl.store(prefix + w, carry + tl.associative_scan(counts, 0, SUM) - counts, mask=ok)
    return carry + tl.reduce(counts, 0, SUM)


@triton.jit
def _place_step(start, ROUTES, present, prefix, union, rowbits, group, sr_b, sr_s, sr_k, s_q, k, kv_length, n_tiles,
                group_size, T: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr):
    i = start + tl.arange(0, BLOCK)  # [BLOCK]
    t, ids, valid, _ = group_routes(ROUTES, group, i, group >= 0, sr_b, sr_s, sr_k, s_q, k, kv_length, n_tiles,
                                    group_size, T, PAIRS, 1)
    id32 = tl.where(valid, ids, 0).to(tl.int32)
    word = tl.load(present + (id32 >> 5), mask=valid, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    below = word & ((tl.full([BLOCK], 1, tl.uint32) << (id32 & 31).to(tl.uint32)) - 1)
    slot = tl.load(prefix + (id32 >> 5), mask=valid, other=0, cache_modifier=".cg") + popcount(below)
    tl.store(union + slot, id32, mask=valid)
    tl.atomic_or(rowbits + slot, tl.full([BLOCK], 1, tl.int32) << t.to(tl.int32), mask=valid, sem="relaxed")


@triton.jit
def union_rank_kernel(
    ROUTES, UNION, ROWBITS, COUNT, PRESENT, PREFIX, MARKS,
    sr_b, sr_s, sr_k,
    s_q, k, kv_length, n_tiles, first_group, width, words, group_size,
    T: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr, INTERPRET: tl.constexpr, FILL: tl.constexpr,
):
    """Program w: the union of group ``first_group + w`` (batch row ``group // n_tiles``;
    tile ``group % n_tiles`` is rows ``[tile * T, (tile + 1) * T)``, or with ``PAIRS`` the
    rows flat program ``tile`` of PAIRS pairs over ``group_size`` heads touches) from
    ROUTES ``[B, S_q, K]`` int32/int64, any strides. Writes row w of UNION / ROWBITS int32
    ``[n_window, width]`` up to the count (the ascending IDs; bit t: the group's row t
    routes to the ID) and, with FILL, every entry past it (-1 / 0), and COUNT int32
    ``[n_window]``. Scratch, any contents on entry:
    PRESENT / PREFIX int32 ``[n_window, words]`` and MARKS int32 ``[n_window, 8 * words]``
    (32 bytes per word of IDs). Grid: ``(n_window,)``."""
    w = tl.program_id(0).to(tl.int64)
    group = first_group + w
    present = PRESENT + w * words
    prefix = PREFIX + w * words
    marks32 = MARKS + w * words * 8  # the marks as int32 words, for zeroing
    marks = marks32.to(tl.pointer_type(tl.int8))
    n_routes = T * k
    fill(marks32, 0, words * 8, 0, BLOCK, INTERPRET)
    tl.debug_barrier()
    if INTERPRET:
        start = 0
        while start < n_routes:
            _mark_step(start, ROUTES, marks, group, sr_b, sr_s, sr_k, s_q, k, kv_length, n_tiles, group_size,
                       T, BLOCK, PAIRS)
            start += BLOCK
    else:
        for start in range(0, n_routes, BLOCK):
            _mark_step(start, ROUTES, marks, group, sr_b, sr_s, sr_k, s_q, k, kv_length, n_tiles, group_size,
                       T, BLOCK, PAIRS)
    tl.debug_barrier()
    carry = tl.reduce(tl.full([1], 0, tl.int32), 0, SUM)
    if INTERPRET:
        start = 0
        while start < words:
            carry = _words_step(start, words, marks, present, prefix, carry, BLOCK // 8)
            start += BLOCK // 8
    else:
        for start in range(0, words, BLOCK // 8):
            carry = _words_step(start, words, marks, present, prefix, carry, BLOCK // 8)
    out = w * width
    if FILL:
        fill(ROWBITS + out, 0, width, 0, BLOCK, INTERPRET)
        fill(UNION + out, carry, width, -1, BLOCK, INTERPRET)
    else:
        fill(ROWBITS + out, 0, carry, 0, BLOCK, INTERPRET)
    tl.debug_barrier()
    if INTERPRET:
        start = 0
        while start < n_routes:
            _place_step(start, ROUTES, present, prefix, UNION + out, ROWBITS + out, group, sr_b, sr_s, sr_k, s_q, k,
                        kv_length, n_tiles, group_size, T, BLOCK, PAIRS)
            start += BLOCK
    else:
        for start in range(0, n_routes, BLOCK):
            _place_step(start, ROUTES, present, prefix, UNION + out, ROWBITS + out, group, sr_b, sr_s, sr_k, s_q, k,
                        kv_length, n_tiles, group_size, T, BLOCK, PAIRS)
    tl.store(COUNT + w + tl.arange(0, 1), tl.full([1], 0, tl.int32) + carry)
