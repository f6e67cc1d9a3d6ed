"""Tiling arithmetic of the token-gather kernels: plans, union recipes, grids, sort keys.

Everything a launcher decides before it launches, as plain Python on ints, so that the
torch and JAX launchers make the same decisions from the same shapes (same tiles, same
unions, same grids). The algorithm is docs/design-token-gather.md: query rows are
grouped in tiles (or, with flattened heads, programs of consecutive (row, head) pairs);
each tile walks the sorted union of its rows' routes; ``rowbits[u]`` has bit t set iff
the tile's row t routes to ``union[u]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qsa_common.errors import UnsupportedShape

from .config import MAX_ROWS_PER_TILE, BlockSizes

__all__ = ["MAX_GRID_Y", "MAX_GRID_X", "INT32_MAX", "Plan", "make_plan", "default_plan", "next_pow2", "flat_span",
           "flat_pairs", "flat_union_rows", "program_rows", "KeyPlan", "SortStep", "CutStep", "union_recipe",
           "rank_words", "RANK_IDS_PER_KEY", "rank_recipe", "tile_cut", "backward_cut", "fold_grid",
           "offsets_fit_int32"]

MAX_GRID_Y = 65535  # CUDA's limit on grid dimensions y and z
MAX_GRID_X = 2**31 - 1
INT32_MAX = 2**31 - 1
MIN_GROUPS_PER_SORT = 256  # fewer groups per int32 sort than this: int64 keys, one sort


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class Plan:
    """Static shape decisions of one call (all Python ints).

    Padded plans: tiles of ``rows_per_tile`` (T) query rows x ``fwd_heads`` (HB) heads
    per forward program; the backward takes ``backward_rows`` rows x ``bwd_heads`` heads.
    Flat plans (``flat``): each program takes ``fwd_heads`` consecutive (query row, head)
    pairs of one KV head's group, forward and backward; ``rows_per_tile`` is then the
    power of two bounding the query rows one program spans.

    ``max_grid_y``: the launch grid's limit along y (CUDA's 65535); larger grids are
    folded into x. ``offset_limit``: the largest element offset the kernels address in
    int32 (past it, int64). Both are parameters so that tests can force the folded grid
    and the int64 offsets on small shapes.
    """

    rows_per_tile: int
    group: int
    fwd_heads: int
    bwd_heads: int
    head_dim_pad: int
    blocks: BlockSizes
    flat: bool = False
    bwd_rows: int = 0  # T_b, the backward's rows per tile (0: rows_per_tile)
    max_grid_y: int = MAX_GRID_Y
    offset_limit: int = INT32_MAX

    @property
    def backward_rows(self) -> int:
        return self.bwd_rows or self.rows_per_tile

    def n_tiles(self, s_q: int) -> int:
        """Forward programs along the query axis (flat: programs of pairs)."""
        if self.flat:
            return -(-s_q * self.group // self.fwd_heads)
        return -(-s_q // self.rows_per_tile)

    def pairs_fit(self, s_q: int) -> bool:
        """Whether the kernels can number this plan's (row, head) pairs at ``s_q`` query rows:
        flat programs index them in int32, up to the last program's end; padded tiles
        always can."""
        return not self.flat or self.n_tiles(s_q) * self.fwd_heads <= INT32_MAX


def make_plan(group: int, head_dim: int, blocks: BlockSizes, *, max_grid_y: int = MAX_GRID_Y,
              offset_limit: int = INT32_MAX) -> Plan:
    """The plan of :class:`BlockSizes` ``blocks`` for GQA groups of ``group`` = Hq/Hkv heads."""
    g_pad = next_pow2(group)
    head_dim_pad = max(16, next_pow2(head_dim))
    limits = dict(max_grid_y=max_grid_y, offset_limit=offset_limit)
    if blocks.flatten_heads and group != g_pad:
        pairs = flat_pairs(blocks.block_m, group, MAX_ROWS_PER_TILE)
        _check_backward_chunk(pairs, head_dim, head_dim_pad, blocks.backward_block_k)
        return Plan(next_pow2(flat_span(pairs, group)), group, pairs, pairs, head_dim_pad, blocks, flat=True,
                    **limits)
    heads = min(g_pad, blocks.block_m)
    # every dot needs M >= 16: a small group simply gets more rows per tile
    rows = max(1, min(MAX_ROWS_PER_TILE, blocks.block_m // heads))
    if blocks.backward_rows_per_tile is None:  # all heads, as many rows as fit
        bwd_rows = max(1, min(rows, blocks.backward_block_m // heads))
    else:
        bwd_rows = min(rows, blocks.backward_rows_per_tile)
    while bwd_rows * heads < 16 and bwd_rows < rows:
        bwd_rows *= 2
    bwd_heads = max(1, min(heads, blocks.backward_block_m // bwd_rows))
    while bwd_rows * bwd_heads < 16:
        bwd_heads *= 2
    _check_backward_chunk(bwd_rows * bwd_heads, head_dim, head_dim_pad, blocks.backward_block_k)
    return Plan(rows, group, heads, bwd_heads, head_dim_pad, blocks,
                bwd_rows=0 if bwd_rows == rows else bwd_rows, **limits)


def _check_backward_chunk(matrix_rows: int, head_dim: int, head_dim_pad: int, block_k: int) -> None:
    least = min_backward_block_k(matrix_rows, head_dim_pad)
    if block_k < least:
        raise ValueError(f"backward programs of {matrix_rows} (row, head) pairs at head dim {head_dim} need "
                         f"backward_block_k >= {least}, got {block_k}")


def default_plan(group: int, head_dim: int, blocks: BlockSizes, query_length: int, **limits) -> Plan:
    """:func:`make_plan` for a configuration the caller did not choose: where flat programs
    would index (row, head) pairs past int32 (S_q * G near 2**31, which the launch refuses),
    the same blocks as padded tiles instead. Both frameworks' defaults go through here, so
    they plan alike at every length."""
    plan = make_plan(group, head_dim, blocks, **limits)
    if not plan.pairs_fit(query_length):
        plan = make_plan(group, head_dim, dataclasses.replace(blocks, flatten_heads=False), **limits)
    return plan


def min_backward_block_k(matrix_rows: int, head_dim_pad: int) -> int:
    """The narrowest union chunk a backward program of ``matrix_rows`` (row, head) pairs
    may take: 64 IDs for 64+ pairs at a padded head dim of 256, whose backward over
    narrower chunks reads past its shared memory in a ``tl.dot`` under Triton 3.6
    (compute-sanitizer on the H200: flat programs of 64 and 128 pairs and padded 8 x 8
    programs over 16- and 32-ID chunks; programs of 32 pairs read nothing out of bounds;
    ``scripts/gpu/probe_chunks.py``, docs/benchmarks.md); 16 otherwise."""
    return 64 if matrix_rows >= 64 and head_dim_pad >= 256 else 16


def flat_span(pairs: int, group: int) -> int:
    """The most query rows a run of ``pairs`` consecutive (row, head) pairs over ``group``
    heads can touch (it may start at any head)."""
    return (pairs - 1) // group + 2


def flat_pairs(block_m: int, group: int, max_rows: int) -> int:
    """Pairs per flat program: ``block_m`` halved (not below 16) until a program spans at
    most ``max_rows`` query rows (the kernels' row bitmask bound)."""
    pairs = block_m
    while pairs > 16 and flat_span(pairs, group) > max_rows:
        pairs //= 2
    return pairs


def program_rows(first_pair, pairs: int, group: int):
    """First and last query row (inclusive) of the flat program of (row, head) pairs
    ``[first_pair, first_pair + pairs)`` over ``group`` heads (the kernels' rule too;
    ``first_pair`` may be an int or an integer array)."""
    return first_pair // group, (first_pair + pairs - 1) // group


def flat_union_rows(group: int, pairs: int, at_least: int = 1) -> int | None:
    """The fewest rows T_u >= ``at_least`` (a power of two <= 32) whose T_u * G pairs
    hold whole flat programs of ``pairs`` pairs; None if there is none."""
    rows = at_least
    while rows <= MAX_ROWS_PER_TILE:
        if (rows * group) % pairs == 0:
            return rows
        rows *= 2
    return None


# ----------------------------------------------------------------- union recipes
@dataclass(frozen=True)
class KeyPlan:
    """Sort keys of tile unions: ``(group % per_sort) << key_bits | (id << shift | row)``,
    or ``sentinel`` in the low bits for a padding route (it sorts after every real key
    of its group). Each sort takes ``per_sort`` whole groups: at most 2**31 - 1 keys,
    and, where that leaves a sort at least ``min_groups`` groups, few enough for int32
    keys (flat radix sorts of many groups at once instead of a segmented sort per group).
    ``dtype``: ``"int32"`` or ``"int64"``."""

    shift: int
    sentinel: int
    key_bits: int
    per_sort: int
    dtype: str

    @staticmethod
    def make(n_groups: int, t: int, k: int, kv_length: int, *, wide_keys: bool = True,
             min_groups: int = MIN_GROUPS_PER_SORT) -> KeyPlan:
        """``wide_keys`` False (a framework without int64 arrays): int32 keys always, one
        group per sort where no group bits fit; UnsupportedShape where the low bits
        alone need more than 31."""
        sentinel = kv_length * t
        key_bits = sentinel.bit_length()
        most = max(1, INT32_MAX // (t * k))
        int32_groups = 1 << (31 - key_bits) if key_bits < 31 else 0
        if int32_groups >= min(n_groups, min_groups):
            per_sort, dtype = min(n_groups, most, int32_groups), "int32"
        elif wide_keys:
            per_sort, dtype = min(n_groups, most), "int64"
        elif key_bits <= 31:
            per_sort, dtype = max(1, min(n_groups, most, int32_groups)), "int32"
        else:
            raise UnsupportedShape(f"tile unions over S_kv = {kv_length} with {t}-row tiles need "
                                      "sort keys wider than int32")
        if key_bits + max(1, (per_sort - 1).bit_length()) > 62:  # pragma: no cover - > 2**62 keys
            raise UnsupportedShape(f"tile unions over kv_length {kv_length} need sort keys wider than 62 bits")
        return KeyPlan(t.bit_length() - 1, sentinel, key_bits, per_sort, dtype)


@dataclass(frozen=True)
class SortStep:
    """Sort the routes of groups of ``rows`` query rows (per batch row ``n_groups`` of
    them): group i is rows ``[i * rows, (i + 1) * rows)``, or, with ``pairs``, the rows
    that flat program i of ``pairs`` pairs over ``group`` heads touches. Its unions are
    ``width = min(rows * K, S_kv)`` wide."""

    rows: int
    n_groups: int
    width: int
    keys: KeyPlan
    pairs: int = 0
    group: int = 1


@dataclass(frozen=True)
class CutStep:
    """Cut each parent union into ``parts`` sub-unions (the first ``n_sub`` per batch row
    are kept): equal windows of ``sub_rows`` rows (``pairs`` = 0) or the rows of flat
    programs of ``pairs`` pairs over ``group`` heads. Sub-unions keep the parent's IDs
    with a bit in their window, in order, bits shifted down to the window's first row;
    they are ``width`` wide and describe tiles of ``rows_per_tile`` rows."""

    parts: int
    sub_rows: int
    pairs: int
    group: int
    n_sub: int
    width: int
    rows_per_tile: int


def union_recipe(plan: Plan, s_q: int, k: int, kv_length: int, batch: int = 1, *,
                 wide_keys: bool = True) -> tuple[SortStep, CutStep | None]:
    """How the forward's unions are built: one sort, then at most one cut.

    Padded plans sort tiles of T rows. Flat plans sort tiles of T_u rows and cut them
    into programs where such tiles hold whole programs (:func:`flat_union_rows`; every
    route is then sorted once), else sort each program's span of rows (span * G / pairs
    times the keys); a program's union is ``min(flat_span * K, S_kv)`` wide, the most IDs
    the rows it touches can route to. ``batch`` sizes the sort keys (groups of all batch
    rows share sorts).
    """
    def sort(rows, n_groups, **kw):
        keys = KeyPlan.make(batch * n_groups, rows, k, kv_length, wide_keys=wide_keys)
        return SortStep(rows, n_groups, min(rows * k, kv_length), keys, **kw)

    if not plan.flat:
        return sort(plan.rows_per_tile, -(-s_q // plan.rows_per_tile)), None
    pairs, span = plan.fwd_heads, plan.rows_per_tile
    width = min(flat_span(pairs, plan.group) * k, kv_length)
    tile_rows = flat_union_rows(plan.group, pairs, span)  # tall enough: every program within one tile
    if tile_rows is None:
        return dataclasses.replace(sort(span, plan.n_tiles(s_q), pairs=pairs, group=plan.group), width=width), None
    tiles = sort(tile_rows, -(-s_q // tile_rows))
    return tiles, CutStep(tile_rows * plan.group // pairs, 1, pairs, plan.group, plan.n_tiles(s_q), width, span)


def rank_words(kv_length: int) -> int:
    """Words of 32 IDs in one group's ID marks (``union_rank.py``)."""
    return -(-kv_length // 32)


# The rank recipe passes over S_kv bytes per group where the sort orders rows * K keys; it is
# used while S_kv is at most this many times rows * K (past it, the sort is the faster).
RANK_IDS_PER_KEY = 16


def rank_recipe(step: SortStep, k: int, kv_length: int) -> bool:
    """Whether ``step``'s unions are built by the rank recipe (``union_rank.py``) rather
    than by sorting keys; both give the same unions element for element up to each count."""
    return kv_length <= RANK_IDS_PER_KEY * step.rows * k


def tile_cut(parent_rows: int, parent_width: int, rows: int, top_k: int, s_q: int) -> CutStep | None:
    """The cut of unions of ``parent_rows``-row tiles (``parent_width`` wide, from routes
    ``[B, s_q, top_k]``) into tiles of ``rows`` rows; None where ``rows`` is the parent's.

    Raises:
        ValueError: ``rows`` does not divide ``parent_rows``, or ``top_k`` is too small to
            be the K of routes whose unions are ``parent_width`` wide.
    """
    if not isinstance(top_k, int) or top_k < 1 or top_k * parent_rows < parent_width:
        raise ValueError(f"top_k {top_k!r} is not the K of routes whose {parent_rows}-row "
                         f"unions are {parent_width} wide")
    if rows == parent_rows:
        return None
    if rows < 1 or rows > parent_rows or parent_rows % rows:
        raise ValueError(f"rows_per_tile must be a power of two dividing {parent_rows}, got {rows}")
    return CutStep(parent_rows // rows, rows, 0, 1, -(-s_q // rows), min(rows * top_k, parent_width), rows)


def backward_cut(plan: Plan, s_q: int, top_k: int, parent_rows: int, parent_width: int) -> CutStep | None:
    """The cut from the forward's unions to the backward's shorter tiles; None when the
    backward walks the forward's unions as they are (flat plans, T_b = T)."""
    if plan.flat:
        return None
    return tile_cut(parent_rows, parent_width, plan.backward_rows, top_k, s_q)


# ------------------------------------------------------------------------- grids
def fold_grid(nx: int, ny: int, max_y: int = MAX_GRID_Y) -> tuple[tuple[int, int], int]:
    """A launch grid for ``nx * ny`` programs with at most ``max_y`` along y.

    Returns ``((X, Y), fold)``: program (x, y) of the folded grid is program
    ``(x % nx, x // nx + fold * y)`` of the ``nx x ny`` one (identical when fold is 1:
    the same programs in the same order); where ``fold`` does not divide ``ny`` the last
    programs are dead and the kernels mask them off.
    """
    if nx < 1 or ny < 1:
        raise ValueError(f"a launch grid needs at least one program per axis, got {nx} x {ny}")
    fold = -(-ny // max_y)
    if nx * fold > MAX_GRID_X:
        raise UnsupportedShape(f"{nx} x {ny} programs do not fit a CUDA launch grid")
    return (nx * fold, -(-ny // fold)), fold


def offsets_fit_int32(extents, limit: int = INT32_MAX) -> bool:
    """Whether every element offset ``row * stride_row + col * stride_col`` of each
    ``(rows, stride_row, cols, stride_col)`` in ``extents`` is at most ``limit``."""
    return all((rows - 1) * s_row + (cols - 1) * s_col <= limit for rows, s_row, cols, s_col in extents)
