"""Tile unions without a sort: a bitmap of row bits per group, then a compaction.

An alternative to the keys / sort / merge recipe (``union_keys.py``, ``union_merge.py``)
that gives the same unions element for element. For a window of groups (tiles, or flat
programs' rows) the mark kernel ORs ``1 << t`` into ``BITS[group, id]`` for every valid
route ``id`` of the group's row t (relaxed atomics; OR is idempotent, so repeated IDs need
no care) into a zeroed scratch; the compact kernel then walks each group's ``BITS`` row in
ascending ID order, writing the IDs with a nonzero word and their words (a prefix count
gives each its slot). The union is sorted by construction. Work: one atomic per route plus
a scan of ``S_kv`` words per group; scratch: ``window * S_kv`` int32. Both kernels write
only outputs (no buffer is updated in place), so JAX launches them as torch does.

Signature order is the launchers' contract (``qsa_triton.launch``): array inputs, fp32
scalars, outputs, then integers and constexprs (by keyword).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .language import SUM, fill, group_routes, program_xy


@triton.jit
def union_mark_kernel(
    ROUTES, BITS,
    sr_b, sr_s, sr_k,
    s_q, k, kv_length, n_tiles, first_group, n_window, n_chunks, group_size,
    T: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr, FOLD: tl.constexpr,
):
    """Program (w, chunk): BLOCK of the T * K routes of group ``first_group + w`` (batch
    row ``group // n_tiles``); ORs bit t (the route's row within the group) into
    BITS[w, id] for each ID in [0, kv_length). ROUTES ``[B, S_q, K]`` int32/int64, any
    strides; BITS int32 ``[n_window, kv_length]``, zero on entry. Grid:
    ``fold_grid(n_window, n_chunks)``."""
    w32, chunk, live = program_xy(n_window, n_chunks, FOLD)
    w = w32.to(tl.int64)
    group = first_group + w
    i = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    t, ids, valid, _ = group_routes(ROUTES, group, i, live, sr_b, sr_s, sr_k, s_q, k, kv_length, n_tiles,
                                    group_size, T, PAIRS, FOLD)
    word = BITS + w * kv_length + tl.where(valid, ids, 0).to(tl.int64)
    tl.atomic_or(word, tl.full([BLOCK], 1, tl.int32) << t.to(tl.int32), mask=valid, sem="relaxed")


@triton.jit
def _compact_step(start, kv_length, bits, union, rowbits, carry, BLOCK: tl.constexpr):
    ids = start + tl.arange(0, BLOCK)  # [BLOCK]
    ok = ids < kv_length
    word = tl.load(bits + ids, mask=ok, other=0)
    hit = word != 0
    slot = carry + tl.associative_scan(hit.to(tl.int32), 0, SUM) - 1
    tl.store(union + slot, ids, mask=hit)
    tl.store(rowbits + slot, word, mask=hit)
    return carry + tl.reduce(hit.to(tl.int32), 0, SUM)


@triton.jit
def union_compact_kernel(
    BITS, UNION, ROWBITS, COUNT,
    kv_length, width,
    BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One program per group of the window: from BITS int32 ``[n_window, kv_length]`` as
    the mark kernel left it, writes row w of UNION / ROWBITS int32 ``[n_window, width]``
    (the IDs with a nonzero word, ascending, and their words; then -1 / 0) and COUNT int32
    ``[n_window]``. Grid: ``(n_window,)``."""
    w = tl.program_id(0).to(tl.int64)
    bits = BITS + w * kv_length
    out = w * width
    carry = tl.reduce(tl.full([1], 0, tl.int32), 0, SUM)
    if INTERPRET:
        start = 0
        while start < kv_length:
            carry = _compact_step(start, kv_length, bits, UNION + out, ROWBITS + out, carry, BLOCK)
            start += BLOCK
    else:
        for start in range(0, kv_length, BLOCK):
            carry = _compact_step(start, kv_length, bits, UNION + out, ROWBITS + out, carry, BLOCK)
    fill(UNION + out, carry, width, -1, BLOCK, INTERPRET)
    fill(ROWBITS + out, carry, width, 0, BLOCK, INTERPRET)
    tl.store(COUNT + w + tl.arange(0, 1), tl.full([1], 0, tl.int32) + carry)
