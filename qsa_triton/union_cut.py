"""Sub-unions cut out of coarser unions, without a second sort.

A sub-union keeps, in order, the parent's IDs with a bit in its row window, those bits
shifted down so that the window's first row is bit 0: exactly the union a sort of the
window's rows would give (docs/design-token-gather.md). Windows are equal slices of a
tile (shorter backward tiles) or the rows of flat programs (flattened heads).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .language import SUM, fill, load_count, program_rows, program_xy


@triton.jit
def _cut_step(start, count, union, rowbits, sub_union, sub_rowbits, sub_width, shift, mask, carry,
              BLOCK: tl.constexpr):
    u = start + tl.arange(0, BLOCK)
    u_ok = u < count
    ids = tl.load(union + u, mask=u_ok, other=-1)
    # the arithmetic shift drags int32's sign bit (row 31) down: the mask drops it
    bits = (tl.load(rowbits + u, mask=u_ok, other=0) >> shift) & mask
    keep = u_ok & (bits != 0)
    slot = carry + tl.associative_scan(keep.to(tl.int32), 0, SUM) - 1
    # the host sizes sub-unions from K; the bound only keeps a wrong K inside memory
    tl.store(sub_union + slot, ids, mask=keep & (slot < sub_width))
    tl.store(sub_rowbits + slot, bits, mask=keep & (slot < sub_width))
    return carry + tl.reduce(keep.to(tl.int32), 0, SUM)


@triton.jit
def union_cut_kernel(
    UNION, ROWBITS, COUNT,
    SUB_UNION, SUB_ROWBITS, SUB_COUNT,
    B, n_tiles, width, n_sub, sub_width, group,
    SUB_T: tl.constexpr, PARTS: tl.constexpr, PAIRS: tl.constexpr, BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr, FOLD: tl.constexpr, FILL: tl.constexpr,
):
    """Program (sub-union, batch row). Sub-union s is part ``s % PARTS`` of parent tile
    ``s // PARTS``; its window is rows ``[part * SUB_T, (part + 1) * SUB_T)``
    (``PAIRS`` = 0) or, for flat programs of PAIRS (row, head) pairs over ``group``
    heads, the rows those pairs touch. Parents are int32 [B, n_tiles, width] (COUNT
    [B, n_tiles]), read up to their counts; writes SUB_UNION / SUB_ROWBITS [B, n_sub,
    sub_width] up to the sub-union's count and, with FILL, every entry past it (-1 / 0),
    and SUB_COUNT [B, n_sub]. Grid: ``fold_grid(n_sub, B)``."""
    sub, b32, live = program_xy(n_sub, B, FOLD)
    b = b32.to(tl.int64)
    parent = b * n_tiles + sub // PARTS
    if PAIRS == 0:
        shift = (sub % PARTS) * SUB_T
        mask = (1 << SUB_T) - 1
    else:
        shift, last_row = program_rows((sub % PARTS) * PAIRS, PAIRS, group)
        mask = (1 << (last_row - shift + 1)) - 1
    count = load_count(COUNT, parent)
    end = sub_width
    if FOLD > 1:  # dead programs write nothing
        count = tl.where(live, count, 0)
        end = tl.where(live, sub_width, 0)
    out = (b * n_sub + sub) * sub_width
    carry = tl.reduce(tl.full([1], 0, tl.int32), 0, SUM)
    if INTERPRET:
        start = 0
        while start < count:
            carry = _cut_step(start, count, UNION + parent * width, ROWBITS + parent * width,
                              SUB_UNION + out, SUB_ROWBITS + out, sub_width, shift, mask, carry, BLOCK)
            start += BLOCK
    else:
        for start in range(0, count, BLOCK):
            carry = _cut_step(start, count, UNION + parent * width, ROWBITS + parent * width,
                              SUB_UNION + out, SUB_ROWBITS + out, sub_width, shift, mask, carry, BLOCK)
    if FILL:
        filled = tl.minimum(carry, sub_width)
        fill(SUB_UNION + out, filled, end, -1, BLOCK, INTERPRET)
        fill(SUB_ROWBITS + out, filled, end, 0, BLOCK, INTERPRET)
    count_ptr = SUB_COUNT + b * n_sub + sub + tl.arange(0, 1)
    if FOLD > 1:
        first = tl.where(live, tl.arange(0, 1) == 0, False)
        tl.store(count_ptr, tl.full([1], 0, tl.int32) + carry, mask=first)
    else:
        tl.store(count_ptr, tl.full([1], 0, tl.int32) + carry)
