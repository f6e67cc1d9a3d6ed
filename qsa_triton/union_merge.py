"""Tile unions from sorted keys (second step of a union).

The sorted (ID, row) keys of a group give its union in one pass: an ID starts a new
union slot where it differs from the previous key's ID, the slot is a running count of
those starts (a prefix sum per chunk plus the count carried from earlier chunks), and
the row bits of each run of equal IDs within a chunk are ORed together by a segmented scan
and the run's last key adds them to its slot with one atomic OR (a run that crosses a chunk
boundary ORs once per chunk; OR is idempotent, so repeated (ID, row) keys need no care).
Slots past the count are filled with -1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .language import SUM, fill


@triton.jit
def _or_within_slot(slot_a, bits_a, slot_b, bits_b):
    """Segmented OR over non-decreasing slots: b's bits, plus a's where a is the same slot."""
    return slot_b, tl.where(slot_a == slot_b, bits_a | bits_b, bits_b)


@triton.jit
def _merge_step(start, n_keys, keys, union, rowbits, low_mask, sentinel, carry,
                SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    offs = start + lane
    in_range = offs < n_keys
    low = tl.load(keys + offs, mask=in_range, other=sentinel) & low_mask
    prev = tl.load(keys + offs - 1, mask=in_range & (offs > 0), other=-1) & low_mask
    after = tl.load(keys + offs + 1, mask=offs + 1 < n_keys, other=sentinel) & low_mask
    valid = low != sentinel
    ids = low >> SHIFT
    first = valid & (ids != (prev >> SHIFT))
    slot = carry + tl.associative_scan(first.to(tl.int32), 0, SUM) - 1
    tl.store(union + slot, ids.to(tl.int32), mask=first)
    bit = tl.where(valid, tl.full([BLOCK], 1, tl.int32) << (low & ((1 << SHIFT) - 1)).to(tl.int32), 0)
    _, run_bits = tl.associative_scan((slot, bit), 0, _or_within_slot)
    # a run's last key in this chunk: the chunk ends, or the next key is another ID or padding
    last = (lane == BLOCK - 1) | (after == sentinel) | ((after >> SHIFT) != ids)
    tl.atomic_or(rowbits + slot, run_bits, mask=valid & last, sem="relaxed")
    return carry + tl.reduce(first.to(tl.int32), 0, SUM)


@triton.jit
def union_merge_kernel(
    KEYS,
    UNION, ROWBITS, COUNT,
    n_keys, width, low_mask, sentinel,
    SHIFT: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One program per group: KEYS [n_groups, n_keys] ascending per group, each
    ``(group bits) << b | (id << SHIFT | row)`` or ``sentinel`` in the low bits (no
    route); writes UNION [n_groups, width] (the IDs, then -1) and COUNT [n_groups]
    (int32), and ORs row bits into ROWBITS [n_groups, width], which must be zero on
    entry. Grid: ``(n_groups,)``."""
    group = tl.program_id(0).to(tl.int64)
    keys = KEYS + group * n_keys
    out = group * width
    carry = tl.reduce(tl.full([1], 0, tl.int32), 0, SUM)
    if INTERPRET:
        start = 0
        while start < n_keys:
            carry = _merge_step(start, n_keys, keys, UNION + out, ROWBITS + out, low_mask, sentinel, carry,
                                SHIFT, BLOCK)
            start += BLOCK
    else:
        for start in range(0, n_keys, BLOCK):
            carry = _merge_step(start, n_keys, keys, UNION + out, ROWBITS + out, low_mask, sentinel, carry,
                                SHIFT, BLOCK)
    fill(UNION + out, carry, width, -1, BLOCK, INTERPRET)
    tl.store(COUNT + group + tl.arange(0, 1), tl.full([1], 0, tl.int32) + carry)
