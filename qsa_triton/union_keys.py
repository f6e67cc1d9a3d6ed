"""Sort keys of tile unions, straight from the routes (first step of a union).

Key i of group g (batch row ``g // n_tiles``, tile ``g % n_tiles``) is route ``i % K``
of the tile's row ``i // K``: ``(g % per_sort) << KEY_BITS | (id << SHIFT | row)``, or
``sentinel`` in the low bits where the ID is outside [0, kv_length) or the row is past
the tile (``qsa_triton.plan.KeyPlan``). Sorting each group's keys then lists its union
in order (``union_merge.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .language import group_routes, program_xy


@triton.jit
def union_keys_kernel(
    ROUTES,
    KEYS,
    sr_b, sr_s, sr_k,
    s_q, k, kv_length, n_tiles, n_groups, n_chunks, per_sort, sentinel, group_size,
    T: tl.constexpr, SHIFT: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr,
    PAIRS: tl.constexpr, FOLD: tl.constexpr,
):
    """Program (group, chunk): BLOCK of the T * K keys of one group.

    ROUTES ``[B, S_q, K]`` int32/int64, any strides; KEYS ``[n_groups * T * K]`` (int32
    or int64, the key dtype). Tile p is rows ``[p * T, (p + 1) * T)``; with ``PAIRS``,
    the rows that flat program p of PAIRS pairs over ``group_size`` heads touches.
    Grid: ``fold_grid(n_groups, n_chunks)``, n_chunks = ceil(T * K / BLOCK)."""
    group32, chunk, live = program_xy(n_groups, n_chunks, FOLD)
    group = group32.to(tl.int64)
    i = chunk * BLOCK + tl.arange(0, BLOCK)
    t, ids, valid, in_range = group_routes(ROUTES, group, i, live, sr_b, sr_s, sr_k, s_q, k, kv_length, n_tiles,
                                           group_size, T, PAIRS, FOLD)
    key_type = KEYS.dtype.element_ty
    low = tl.where(valid, (tl.where(valid, ids, 0).to(key_type) << SHIFT) + t.to(key_type), sentinel)
    high = (group % per_sort).to(key_type) << KEY_BITS
    tl.store(KEYS + group * (T * k) + i, high | low.to(key_type), mask=in_range)
