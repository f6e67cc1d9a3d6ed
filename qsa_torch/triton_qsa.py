"""Token-gather QSA in Triton: work proportional to the routes, not to S^2.

The algorithm is the one of ``docs/design-token-gather.md`` (shared with the JAX
Pallas backend). Query rows are grouped in tiles of T consecutive rows; a radix
sort (torch) between two small Triton kernels builds, per tile, the sorted union of
the routes of its rows and a per-ID bitmask of which rows route there
(:func:`build_tile_unions`). One Triton program per (tile, KV head, head chunk) then
walks that union in chunks of ``block_k`` IDs, gathers each K/V row once for all
T * heads matrix rows, and runs an fp32 online softmax (forward, saving the
log-sum-exp) or the fused backward (dQ kept in registers, dK/dV added to fp32
accumulators with one atomic add per union chunk). With ``flatten_heads`` (the
default for 16-bit inputs at D > 128 on SM90+ GPUs with the shared memory for it) a
program takes consecutive (row, head) pairs instead of T rows x padded heads, forward
and backward alike; otherwise the backward's tiles may be shorter than the forward's,
their unions cut out of the forward's, not sorted again.

Triton is imported on the first call only. CUDA tensors are required, except that
CPU tensors are accepted when Triton's interpreter is on (``TRITON_INTERPRET=1``
in the environment before this backend's first call), which is how CPU CI runs
the kernels. Nothing synchronises with the host: the union width is static
(``T * K``, capped at ``S_kv``) and each program reads its tile's union length.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from .routes import check_deterministic_backward, validate_inputs, validate_routes

__all__ = [
    "BlockSizes",
    "DEFAULT_BLOCK_SIZES",
    "SAFE_BLOCK_SIZES",
    "TileUnions",
    "build_tile_unions",
    "default_block_sizes",
    "triton_sparse_gqa_attention",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_ROWS_PER_TILE = 32  # rowbits is an int32 bitmask
_MAX_HEAD_DIM = 256
_MAX_GRID_Y = 65535  # CUDA's limit on grid dimension y

# Code-generation choices of the kernels; the probe script turns them off to measure
# what each buys (H200, S=32k, (24,2), D=256: 32-bit offsets took the backward from
# 78.4 to 73.7 ms), and the tests run both ways.
KERNEL_OPTIONS = {
    "offs32": True,  # 32-bit element offsets where every one fits (checked per call)
    "triton_unions": True,  # union steps after the sort, and splits, as Triton kernels
    "flat_unions_from_tiles": True,  # flat unions cut from tile unions where tiles hold whole programs
    # backward with less register pressure, same results: ptxas (sm_90a, the H200 tiling)
    # spills 556 -> 100 bytes at 64-ID chunks, none at 32-ID chunks, which then fit shared
    # memory (168 KiB); not yet timed on a GPU, so off
    "lean_backward": False,
}


@dataclass(frozen=True)
class BlockSizes:
    """Launch configuration of the two kernels.

    ``block_m``: target matrix rows (query row x head pairs) of a forward program;
    it fixes the tile height T = min(32, block_m // G_pad) (G_pad = Hq/Hkv rounded up
    to a power of two) and so the route unions shared by forward and backward.
    ``block_k``: union IDs gathered per step.
    ``backward_block_m``: matrix rows of a backward program. By default
    (``backward_rows_per_tile`` None) a backward program keeps all G_pad heads of a
    tile and takes T_b = backward_block_m // G_pad of its rows: each forward tile is
    cut into T / T_b backward tiles, whose unions come out of the forward's
    (``_split_tile_unions``, no second sort). ``backward_rows_per_tile`` sets T_b
    instead; heads are split over several programs when T_b * G_pad is more than
    ``backward_block_m``. All block sizes are powers of two >= 16.
    ``flatten_heads``: when G is not a power of two, every program (forward and
    backward) takes ``block_m`` consecutive (query row, head) pairs instead of T rows x
    G_pad heads, so no matrix row is head padding; a program then spans up to
    ``(block_m - 1) // G + 2`` query rows, and the backward takes the forward's
    programs (``backward_block_m`` does not apply). Their unions are cut out of those
    of taller tiles where some tile of <= 32 rows holds whole programs, else sorted per
    program (:func:`build_flat_unions`). On by default for 16-bit inputs at D > 128
    where :func:`default_block_sizes` picks the tuned tiling.
    ``backward_flatten_heads``: the forward keeps its padded tiles; the backward's
    programs take ``backward_block_m`` consecutive pairs each, their unions cut out of
    the unions of tiles of T_u rows (T_u: the smallest power-of-two multiple of T whose
    T_u * G pairs hold whole programs, at most 32; the forward's T-row unions are then
    cut from those too; ``backward_rows_per_tile`` then does not apply). Where no such
    T_u exists the backward stays padded. Ignored with ``flatten_heads`` (already flat).
    """

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2
    backward_block_m: int = 64
    backward_block_k: int = 32
    backward_num_warps: int = 8
    backward_num_stages: int = 1
    backward_rows_per_tile: int | None = None
    flatten_heads: bool = False
    backward_flatten_heads: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_k", "backward_block_m", "backward_block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value!r}")
        for name in ("num_warps", "num_stages", "backward_num_warps", "backward_num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")
        rows = self.backward_rows_per_tile
        if rows is not None and (not isinstance(rows, int) or not 1 <= rows <= _MAX_ROWS_PER_TILE
                                 or rows & (rows - 1)):
            raise ValueError("BlockSizes.backward_rows_per_tile must be None or a power of two "
                             f"in [1, {_MAX_ROWS_PER_TILE}], got {rows!r}")
        for name in ("flatten_heads", "backward_flatten_heads"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"BlockSizes.{name} must be a bool, got {getattr(self, name)!r}")


# H200 at D = 256, S = 32768, (24,2), QSA routes (docs/benchmarks.md, fourth session):
# flat programs of 128 (row, head) pairs forward and backward over 64-ID chunks, 38.4 ms
# forward+backward against 52.8 ms with padded 8-row forward tiles and a flat 64-pair
# backward and 61.1 ms with padded tiles throughout (4 rows x 16 heads backward): twice
# the matrix rows per backward program halve the dK/dV atomic traffic. Where G is a
# power of two flatten_heads changes nothing. Other devices and head dims get lighter tiles.
DEFAULT_BLOCK_SIZES = BlockSizes(num_stages=3, backward_block_k=64, backward_num_stages=1, flatten_heads=True)
SAFE_BLOCK_SIZES = BlockSizes(block_m=64, block_k=32, num_warps=4, num_stages=2,
                              backward_block_m=32, backward_block_k=32,
                              backward_num_warps=4, backward_num_stages=1)


# Shared memory per program of DEFAULT_BLOCK_SIZES at D = 256, 16-bit, compiled for
# sm_90a as a launch specialises it (unit strides along D): forward 197120 bytes (3
# stages), backward 196608. SM90 and SM100 parts allow 227 KiB per block; SM120 ones
# (consumer Blackwell) about 99 KiB.
_TUNED_SHARED_MEMORY = 197120


def default_block_sizes(device: torch.device, head_dim: int, dtype: torch.dtype) -> BlockSizes:
    """The launch configuration used when ``block_sizes`` is None: the tuned one for
    16-bit inputs at D > 128 on SM90+ GPUs whose blocks may take the shared memory it
    needs, else the lighter one (fp32 dots run without tensor cores and need twice the
    shared memory)."""
    if device.type == "cuda" and head_dim > 128 and dtype != torch.float32:
        if torch.cuda.get_device_capability(device) >= (9, 0):
            limit = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
            if limit is None or limit >= _TUNED_SHARED_MEMORY:
                return DEFAULT_BLOCK_SIZES
    return SAFE_BLOCK_SIZES


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class _Plan:
    """Static shape decisions of one call (all Python ints)."""

    rows_per_tile: int  # T (flat: a power of two bounding the rows one program spans)
    group: int  # G = Hq // Hkv
    fwd_heads: int  # HB of the forward programs (flat: the pairs per program)
    bwd_heads: int  # HB of the backward programs (flat: the same)
    head_dim_pad: int  # D_PAD
    blocks: BlockSizes
    flat: bool = False
    bwd_rows: int = 0  # T_b, the backward's rows per tile (0: rows_per_tile)
    union_rows: int = 0  # T_u, rows of the tiles whose unions are sorted (0: rows_per_tile)
    bwd_pairs: int = 0  # > 0: flat backward programs of this many pairs (bwd_heads too)
    bwd_span: int = 0  # with bwd_pairs: power of two bounding the rows one of them spans

    @property
    def backward_rows(self) -> int:
        return self.bwd_rows or self.rows_per_tile

    @property
    def sorted_rows(self) -> int:
        """Rows of the tiles whose unions are sorted and saved (flat plans: the span)."""
        return self.union_rows or self.rows_per_tile

    def n_tiles(self, s_q: int) -> int:
        if self.flat:
            return -(-s_q * self.group // self.fwd_heads)
        return -(-s_q // self.rows_per_tile)

    def n_union_tiles(self, s_q: int) -> int:
        """Rows of the unions that are sorted (and saved for the backward)."""
        if self.flat:
            return self.n_tiles(s_q)
        return -(-s_q // self.sorted_rows)


def _make_plan(group: int, head_dim: int, blocks: BlockSizes) -> _Plan:
    g_pad = _next_pow2(group)
    head_dim_pad = max(16, _next_pow2(head_dim))
    if blocks.flatten_heads and group != g_pad:
        pairs = blocks.block_m
        while pairs > 16 and (pairs - 1) // group + 2 > _MAX_ROWS_PER_TILE:
            pairs //= 2
        span = _next_pow2((pairs - 1) // group + 2)
        return _Plan(span, group, pairs, pairs, head_dim_pad, blocks, flat=True)
    heads = min(g_pad, blocks.block_m)
    rows = max(1, min(_MAX_ROWS_PER_TILE, blocks.block_m // heads))
    # every dot needs M >= 16: a small group simply gets more rows per tile
    if blocks.backward_rows_per_tile is None:  # all heads, as many rows as fit
        bwd_rows = max(1, min(rows, blocks.backward_block_m // heads))
    else:
        bwd_rows = min(rows, blocks.backward_rows_per_tile)
    while bwd_rows * heads < 16 and bwd_rows < rows:
        bwd_rows *= 2
    bwd_heads = max(1, min(heads, blocks.backward_block_m // bwd_rows))
    while bwd_rows * bwd_heads < 16:
        bwd_heads *= 2
    if blocks.backward_flatten_heads and group != g_pad:
        pairs = blocks.backward_block_m
        union_rows = _flat_union_rows(group, pairs, rows)
        span = (pairs - 1) // group + 2
        if union_rows is not None and span <= _MAX_ROWS_PER_TILE:
            return _Plan(rows, group, heads, pairs, head_dim_pad, blocks,
                         union_rows=0 if union_rows == rows else union_rows, bwd_pairs=pairs,
                         bwd_span=_next_pow2(span))
    return _Plan(rows, group, heads, bwd_heads, head_dim_pad, blocks,
                 bwd_rows=0 if bwd_rows == rows else bwd_rows)


@dataclass(frozen=True)
class TileUnions:
    """Per-tile route unions: what both kernels walk.

    ``union`` int32 ``[B, n_tiles, W]``: the distinct valid IDs routed by the tile's
    rows, ascending, then -1 (W = min(T * K, S_kv)). ``count`` int32 ``[B, n_tiles]``:
    how many entries of ``union`` are valid. ``rowbits`` int32 ``[B, n_tiles, W]``:
    bit t set iff row t of the tile routes to ``union[..., u]``.
    """

    union: torch.Tensor
    count: torch.Tensor
    rowbits: torch.Tensor
    rows_per_tile: int


def build_tile_unions(routes: torch.Tensor, kv_length: int, rows_per_tile: int) -> TileUnions:
    """Tile unions of routes as the contract takes them (no host synchronisation).

    ``routes``: int32/int64 ``[B, S_q, K]``, any strides (other dtypes raise TypeError). IDs outside
    ``[0, kv_length)`` (negative, past the end, huge int64) are padding and repeated
    IDs count once, so no :func:`qsa_torch.routes.normalize_routes` pass (a sort of
    every row) is needed first. ``rows_per_tile`` T is a power of two <= 32. The last
    tile is padded with empty rows. Sorting the ``T * K`` keys ``id * T + t`` of each
    tile (flat radix sorts of many tiles at once, the tile's index in the high bits)
    gives the union in order; one pass over the sorted keys (a Triton kernel where
    Triton runs, else torch ops) marks each ID's first key, numbers the slots by a
    prefix count and ORs the row bits.
    """
    _check_union_arguments(routes, kv_length, rows_per_tile)
    bsz, s_q, k = routes.shape
    t = rows_per_tile
    n_tiles = -(-s_q // t)
    triton_unions = _union_kernels(routes.device)
    if triton_unions is not None:  # the keys straight from the routes, in one pass
        kernels, _ = triton_unions
        return _unions_from_routes(kernels, routes, kv_length, n_tiles, t)
    if n_tiles * t != s_q:  # empty rows (IDs -1) complete the last tile
        filler = torch.full((bsz, n_tiles * t - s_q, k), -1, dtype=routes.dtype, device=routes.device)
        routes = torch.cat([routes, filler], dim=1)
    return _unions_of_row_groups(routes.reshape(bsz, n_tiles, t, k), kv_length)


def _unions_from_routes(kernels, routes: torch.Tensor, kv_length: int, n_tiles: int, t: int,
                        pairs: int = 0, group: int = 1) -> TileUnions:
    """Unions of ``n_tiles`` tiles of ``t`` rows per batch row (``pairs``: of flat programs
    of that many (row, head) pairs over ``group`` heads), the sort keys made by a kernel
    straight from the routes."""
    bsz, s_q, k = routes.shape
    keys = _KeyPlan.make(bsz * n_tiles, t, k, kv_length)
    out = torch.empty(bsz * n_tiles * t * k, dtype=keys.dtype, device=routes.device)
    with _on_device(routes.device):
        kernels.union_keys_kernel[(bsz * n_tiles, -(-(t * k) // _UNION_BLOCK))](
            routes, out, s_q, k, kv_length, n_tiles, *routes.stride(), keys.per_sort, keys.sentinel, group,
            T=t, SHIFT=keys.shift, KEY_BITS=keys.key_bits, BLOCK=_UNION_BLOCK, PAIRS=pairs)
    return _unions_from_keys(out, bsz, n_tiles, t, k, kv_length, keys)


def _flat_union_rows(group: int, pairs: int, at_least: int = 1) -> int | None:
    """The fewest rows T_u >= ``at_least`` (a power of two <= 32) whose T_u * G pairs
    hold whole flat programs of ``pairs`` pairs; None if there is none."""
    rows = at_least
    while rows <= _MAX_ROWS_PER_TILE:
        if (rows * group) % pairs == 0:
            return rows
        rows *= 2
    return None


def build_flat_unions(routes: torch.Tensor, kv_length: int, plan: _Plan) -> TileUnions:
    """:func:`build_tile_unions` for a flat plan (``BlockSizes.flatten_heads``): per
    program, the union of the routes of the query rows its (row, head) pairs touch;
    bit t of ``rowbits`` is the program's t-th query row.

    With the Triton union kernels, where tiles of T_u rows hold whole programs
    (:func:`_flat_union_rows`, e.g. 32 rows = 3 programs of 128 pairs at G = 12), the
    unions are cut out of those tiles' (every route sorted once); else each program's
    span of rows is sorted: span * G / pairs times the keys (1.5x at G = 12, 128
    pairs; up to ~2.6x for other groups)."""
    _check_union_arguments(routes, kv_length, plan.rows_per_tile)
    bsz, s_q, k = routes.shape
    n_blocks = plan.n_tiles(s_q)
    triton_unions = _union_kernels(routes.device)
    if triton_unions is not None:
        kernels, _ = triton_unions
        # tiles at least the span tall: the cut unions are as wide as built ones
        tile_rows = _flat_union_rows(plan.group, plan.fwd_heads, plan.rows_per_tile)
        if tile_rows is not None and KERNEL_OPTIONS["flat_unions_from_tiles"]:
            tiles = _unions_from_routes(kernels, routes, kv_length, -(-s_q // tile_rows), tile_rows)
            return _split_flat_unions(tiles, plan.fwd_heads, plan.group, k, s_q, plan.rows_per_tile)
        return _unions_from_routes(kernels, routes, kv_length, n_blocks, plan.rows_per_tile,
                                   pairs=plan.fwd_heads, group=plan.group)
    first_pair = torch.arange(n_blocks, device=routes.device) * plan.fwd_heads
    last_row = torch.clamp((first_pair + plan.fwd_heads - 1) // plan.group, max=s_q - 1)
    rows = (first_pair // plan.group)[:, None] + torch.arange(plan.rows_per_tile, device=routes.device)
    grouped = routes[:, torch.clamp(rows, max=s_q - 1)]  # [B, n_blocks, T, K]
    outside = (rows > last_row[:, None])[None, :, :, None]
    grouped = torch.where(outside, torch.full((), -1, dtype=routes.dtype, device=routes.device), grouped)
    return _unions_of_row_groups(grouped, kv_length)


def _split_tile_unions(unions: TileUnions, rows_per_tile: int, top_k: int, query_length: int) -> TileUnions:
    """The unions of tiles of ``rows_per_tile`` rows, cut out of coarser ones.

    Internal: ``top_k`` must be the K of the routes the unions came from (it sizes
    the result; the kernel never writes past that size, but a smaller K would drop
    IDs). ``unions`` are of tiles of T rows (:func:`build_tile_unions` of ``[B, S_q, K]``
    routes with K = ``top_k`` and S_q = ``query_length``); T' = ``rows_per_tile`` is a
    power of two dividing T. Sub-tile h of a tile keeps, in order, the IDs whose
    ``rowbits`` have a bit among rows ``[h * T', (h + 1) * T')`` and those bits shifted
    down: exactly ``build_tile_unions(routes, kv_length, T')`` (width ``min(T' * K,
    S_kv)``), from a prefix sum instead of a second sort.
    """
    t = unions.rows_per_tile
    if rows_per_tile == t:
        return unions
    if rows_per_tile < 1 or rows_per_tile > t or t % rows_per_tile:
        raise ValueError(f"rows_per_tile must be a power of two dividing {t}, got {rows_per_tile}")
    _check_top_k(unions, top_k)
    windows = [(part * rows_per_tile, rows_per_tile) for part in range(t // rows_per_tile)]
    return _cut_unions(unions, windows, -(-query_length // rows_per_tile),
                       min(rows_per_tile * top_k, unions.union.shape[2]), rows_per_tile, pairs=0, group=1)


def _split_flat_unions(unions: TileUnions, pairs: int, group: int, top_k: int, query_length: int,
                      span: int) -> TileUnions:
    """Flat unions (:func:`build_flat_unions`: programs of ``pairs`` consecutive (query
    row, head) pairs, G = ``group``) cut out of the unions of T-row tiles, when each
    tile's T * G pairs hold a whole number of programs. Program p keeps the IDs with a
    bit among the rows its pairs touch, bits shifted so that bit 0 is its first row.
    ``span``: the power of two bounding those rows (the flat plan's rows_per_tile);
    width ``min(span * K, W)``."""
    t = unions.rows_per_tile
    _check_top_k(unions, top_k)
    if (t * group) % pairs:
        raise ValueError(f"tiles of {t} rows x {group} heads do not hold whole programs of {pairs} pairs")
    windows = []
    for first_pair in range(0, t * group, pairs):
        first_row, last_row = first_pair // group, (first_pair + pairs - 1) // group
        windows.append((first_row, last_row - first_row + 1))
    return _cut_unions(unions, windows, -(-query_length * group // pairs),
                       min(span * top_k, unions.union.shape[2]), span, pairs=pairs, group=group)


def _check_top_k(unions: TileUnions, top_k: int) -> None:
    """Catches a K too small for the unions' width (W = min(T * K, S_kv) >= T * K fails)."""
    if not isinstance(top_k, int) or top_k < 1 or top_k * unions.rows_per_tile < unions.union.shape[2]:
        raise ValueError(f"top_k {top_k!r} is not the K of routes whose {unions.rows_per_tile}-row "
                         f"unions are {unions.union.shape[2]} wide")


def _cut_unions(unions: TileUnions, windows: list[tuple[int, int]], n_sub: int, width: int,
                rows_per_tile: int, *, pairs: int, group: int) -> TileUnions:
    """Sub-unions ``p = tile * len(windows) + h`` (the first ``n_sub``): the entries of
    ``tile`` with a bit among rows ``[first, first + n)`` of ``windows[h] = (first, n)``,
    in order, their bits shifted down by ``first``. The Triton kernel derives the
    windows itself: equal row slices (``pairs`` = 0) or flat programs."""
    bsz, n_tiles, parent_width = unions.union.shape
    device = unions.union.device
    parts = len(windows)
    triton_unions = _union_kernels(device)
    if triton_unions is not None:
        kernels, interpreted = triton_unions
        union, rowbits, count = _blank_unions(bsz, n_sub, width, device)
        with _on_device(device):
            kernels.split_unions_kernel[(n_sub, bsz)](
                unions.union, unions.rowbits, unions.count, union, rowbits, count,
                n_tiles, parent_width, n_sub, width, group,
                SUB_T=windows[0][1] if pairs == 0 else 1, PARTS=parts, PAIRS=pairs,
                BLOCK=_UNION_BLOCK, INTERPRET=interpreted)
        return TileUnions(union, count, rowbits, rows_per_tile)
    valid = torch.arange(parent_width, device=device) < unions.count[..., None]
    union = torch.full((bsz, n_tiles, parts, width + 1), -1, dtype=torch.int32, device=device)
    rowbits = torch.zeros_like(union)
    count = torch.empty((bsz, n_tiles, parts), dtype=torch.int32, device=device)
    for part, (first, n_rows) in enumerate(windows):
        # the arithmetic shift drags int32's sign bit (row 31) down: the mask drops it
        bits = (unions.rowbits >> first) & ((1 << n_rows) - 1)
        keep = valid & (bits != 0)
        slot = torch.cumsum(keep, dim=-1, dtype=torch.int32)
        count[..., part] = slot[..., -1]
        dest = torch.where(keep, slot - 1, width).long()
        union[:, :, part].scatter_(-1, dest, unions.union)
        rowbits[:, :, part].scatter_(-1, dest, bits)
    union = union.reshape(bsz, n_tiles * parts, width + 1)[:, :n_sub, :width]
    rowbits = rowbits.reshape(bsz, n_tiles * parts, width + 1)[:, :n_sub, :width]
    return TileUnions(union.contiguous(), count.reshape(bsz, -1)[:, :n_sub].contiguous(),
                      rowbits.contiguous(), rows_per_tile)


def _unions_for(routes: torch.Tensor, kv_length: int, plan: _Plan) -> TileUnions:
    if plan.flat:
        return build_flat_unions(routes, kv_length, plan)
    return build_tile_unions(routes, kv_length, plan.sorted_rows)


def _check_union_arguments(routes: torch.Tensor, kv_length: int, rows_per_tile: int) -> None:
    validate_routes(routes)
    if routes.dim() != 3:
        raise ValueError(f"routes must have rank 3 [B, S_q, K], got shape {tuple(routes.shape)}")
    if not 0 < kv_length < 2**31:
        raise ValueError(f"kv_length must be in [1, 2**31), got {kv_length}")
    if rows_per_tile < 1 or rows_per_tile > _MAX_ROWS_PER_TILE or rows_per_tile & (rows_per_tile - 1):
        raise ValueError(f"rows_per_tile must be a power of two in [1, 32], got {rows_per_tile}")


@dataclass(frozen=True)
class _KeyPlan:
    """Sort keys of tile unions: ``(group % per_sort) << key_bits | (id << shift | row)``,
    or ``sentinel`` in the low bits for a padding route (it sorts after every real key
    of its group). Each sort takes ``per_sort`` whole groups: at most torch.sort's
    2**31 - 1 elements, and, where that leaves a sort at least _MIN_GROUPS_PER_SORT
    groups, few enough for int32 keys (flat radix sorts of many groups at once instead
    of a segmented sort per group)."""

    shift: int
    sentinel: int
    key_bits: int
    per_sort: int
    dtype: torch.dtype

    @staticmethod
    def make(n_groups: int, t: int, k: int, kv_length: int) -> "_KeyPlan":
        sentinel = kv_length * t
        key_bits = sentinel.bit_length()
        most = max(1, (2**31 - 1) // (t * k))
        int32_groups = 1 << (31 - key_bits) if key_bits < 31 else 0
        if int32_groups >= min(n_groups, _MIN_GROUPS_PER_SORT):
            per_sort, dtype = min(n_groups, most, int32_groups), torch.int32
        else:
            per_sort, dtype = min(n_groups, most), torch.int64
        if key_bits + max(1, (per_sort - 1).bit_length()) > 62:  # pragma: no cover - > 2**62 keys
            raise ValueError(f"tile unions over kv_length {kv_length} need sort keys wider than 62 bits")
        return _KeyPlan(t.bit_length() - 1, sentinel, key_bits, per_sort, dtype)


def _unions_of_row_groups(grouped: torch.Tensor, kv_length: int) -> TileUnions:
    """Unions of ``grouped`` ``[B, n, T, K]`` route rows (T a power of two <= 32)."""
    bsz, n_tiles, t, k = grouped.shape
    device = grouped.device
    plan = _KeyPlan.make(bsz * n_tiles, t, k, kv_length)
    key_dtype = plan.dtype
    # compare in the input dtype: casting huge int64 to int32 first would wrap
    valid = (grouped >= 0) & (grouped < kv_length)
    ids = torch.where(valid, grouped, torch.zeros((), dtype=grouped.dtype, device=device)).to(key_dtype)
    rows = torch.arange(t, device=device, dtype=key_dtype).view(1, 1, t, 1)
    low = torch.where(valid, (ids << plan.shift) + rows,
                      torch.full((), plan.sentinel, dtype=key_dtype, device=device))
    group = (torch.arange(bsz * n_tiles, device=device, dtype=key_dtype) % plan.per_sort).view(bsz, n_tiles, 1, 1)
    return _unions_from_keys(((group << plan.key_bits) | low).reshape(-1), bsz, n_tiles, t, k, kv_length, plan)


def _unions_from_keys(keys: torch.Tensor, bsz: int, n_tiles: int, t: int, k: int, kv_length: int,
                      plan: _KeyPlan) -> TileUnions:
    """Sort the flat ``keys`` (``plan.per_sort`` groups at a time) and make the unions."""
    device = keys.device
    shift, sentinel, key_bits = plan.shift, plan.sentinel, plan.key_bits
    per_group = t * k
    step = plan.per_sort * per_group
    if step >= keys.numel():
        keys = torch.sort(keys).values
    else:
        for start in range(0, keys.numel(), step):
            keys[start:start + step] = torch.sort(keys[start:start + step]).values
    keys = keys.view(bsz, n_tiles, per_group)
    width = min(t * k, kv_length)
    triton_unions = _union_kernels(device)
    if triton_unions is not None:
        kernels, interpreted = triton_unions
        union, rowbits, count = _blank_unions(bsz, n_tiles, width, device)
        with _on_device(device):
            kernels.union_from_sorted_kernel[(bsz * n_tiles,)](
                keys, union, rowbits, count, t * k, width, (1 << key_bits) - 1, sentinel,
                SHIFT=shift, BLOCK=_UNION_BLOCK, INTERPRET=interpreted)
        return TileUnions(union, count, rowbits, t)
    keys = keys & ((1 << key_bits) - 1)
    valid = keys != sentinel
    ids = (keys >> shift).to(torch.int32)
    first = valid.clone()
    first[..., 1:] &= ids[..., 1:] != ids[..., :-1]
    # a repeated (ID, row) pair sets its bit once
    fresh = valid.clone()
    fresh[..., 1:] &= keys[..., 1:] != keys[..., :-1]
    slot = torch.cumsum(first, dim=-1, dtype=torch.int32) - 1
    count = slot[..., -1] + 1
    spare = torch.full((), width, dtype=torch.int64, device=device)
    union = torch.full((bsz, n_tiles, width + 1), -1, dtype=torch.int32, device=device)
    union.scatter_(-1, torch.where(first, slot.long(), spare), ids)
    bit = torch.bitwise_left_shift(
        torch.ones((), dtype=torch.int32, device=device), (keys & (t - 1)).to(torch.int32))
    rowbits = torch.zeros((bsz, n_tiles, width + 1), dtype=torch.int32, device=device)
    rowbits.scatter_add_(-1, torch.where(fresh, slot.long(), spare), torch.where(fresh, bit, 0))
    return TileUnions(union[..., :width].contiguous(), count.contiguous(),
                      rowbits[..., :width].contiguous(), t)


_UNION_BLOCK = 1024  # keys (IDs) per step of the union kernels
_MIN_GROUPS_PER_SORT = 256  # fewer tiles per int32 sort: one int64 sort instead


def _union_kernels(device: torch.device):
    """``(kernels module, interpreted)`` when the union steps run in Triton here (CUDA
    tensors, or the interpreter), else None: then they run as torch ops (same results)."""
    if not KERNEL_OPTIONS["triton_unions"]:
        return None
    try:
        kernels, interpreted = _load_kernels()
    except ImportError:
        return None
    return (kernels, interpreted) if device.type == "cuda" or interpreted else None


def _blank_unions(bsz: int, n_tiles: int, width: int, device: torch.device):
    """What the union kernels fill: union (all -1), rowbits (zeros), count (unset)."""
    union = torch.full((bsz, n_tiles, width), -1, dtype=torch.int32, device=device)
    count = torch.empty((bsz, n_tiles), dtype=torch.int32, device=device)
    return union, torch.zeros_like(union), count


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it ``device``."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def _load_kernels():
    """Import triton and the kernels once; report whether the interpreter is on."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised where triton is absent
        raise ImportError(
            "triton_sparse_gqa_attention needs the 'triton' package (pip install triton)"
        ) from exc
    from . import _triton_kernels as kernels

    interpreted = type(kernels.qsa_forward_kernel).__name__ == "InterpretedFunction"
    return kernels, interpreted


def _new_buffer(shape, dtype, device) -> torch.Tensor:
    """Uninitialised memory the kernels overwrite completely (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


# (kernel, configuration, device) -> (heads, block_k, stages) that fit the device
_LAUNCH_FALLBACKS: dict[tuple, tuple[int, int, int]] = {}


def _launch(kernel, tail_args, constexprs: dict, unions: TileUnions, batch_kv_heads: int, group: int,
            heads: int, block_k: int, num_warps: int, num_stages: int, device: torch.device) -> None:
    """Launch one kernel over (tiles, batch * KV heads * head chunks).

    ``tail_args`` are the positional arguments before the chunk count. If the
    configuration needs more shared memory than the device has (Triton raises
    OutOfResources when loading it), retry with one pipeline stage, narrower union
    chunks, then fewer heads per program (the tile unions do not depend on it); the
    working choice is remembered, so a failing compile is not repeated.
    """
    rows = constexprs["T"]
    flat = constexprs.get("FLAT", False)
    key = (kernel.fn.__name__, tuple(sorted(constexprs.items())), heads, block_k, num_warps,
           num_stages, str(device))
    if key in _LAUNCH_FALLBACKS:
        attempts = [_LAUNCH_FALLBACKS[key]]
    else:
        # flat programs own fixed pair ranges (the unions depend on them): no fewer heads
        head_options = [heads] if flat else [
            h for h in (heads, heads // 2, heads // 4) if h >= 1 and rows * h >= 16]
        chunk_options = [(block_k, num_stages), (block_k, 1)]
        chunk_options += [(bk, 1) for bk in (block_k // 2, block_k // 4) if bk >= 16]
        attempts = list(dict.fromkeys((h, bk, st) for h in head_options for bk, st in chunk_options))
    n_tiles = unions.union.shape[1]
    if flat and n_tiles * heads >= 2**31:
        raise ValueError("triton_qsa's flat tiling indexes (row, head) pairs in int32: "
                         f"S_q * G = {n_tiles * heads} is too many; use flatten_heads=False")
    # batch * KV heads * head chunks go on CUDA grid axis y
    chunks_of = (lambda hb: 1) if flat else (lambda hb: -(-group // hb))  # noqa: E731
    fitting = [a for a in attempts if batch_kv_heads * chunks_of(a[0]) <= _MAX_GRID_Y]
    if not fitting:
        needed = batch_kv_heads * chunks_of(attempts[0][0])
        raise ValueError(
            f"triton_qsa launches batch * kv_heads * head chunks = {needed} programs along "
            f"CUDA grid axis y, more than its limit {_MAX_GRID_Y}: split the batch")
    attempts = fitting
    guard = _on_device(device)
    for i, (hb, bk, stages) in enumerate(attempts):
        chunks = chunks_of(hb)
        try:
            with guard:
                kernel[(n_tiles, batch_kv_heads * chunks)](
                    *tail_args, chunks, **constexprs, HB=hb, BLOCK_K=bk, num_warps=num_warps,
                    num_stages=stages)
        except Exception as exc:  # triton.runtime.errors.OutOfResources (triton is lazy here)
            if type(exc).__name__ != "OutOfResources" or i == len(attempts) - 1:
                raise
            continue
        _LAUNCH_FALLBACKS[key] = (hb, bk, stages)
        return




def _offsets_fit_int32(*extents: tuple[int, torch.Tensor]) -> bool:
    """Whether every element offset ``row * stride(1) + col * stride(3)`` of each
    ``(rows, tensor)`` pair (rows: how many rows along dim 1 are addressed) fits int32."""
    if not KERNEL_OPTIONS["offs32"]:
        return False
    return all((rows - 1) * t.stride(1) + (t.shape[3] - 1) * t.stride(3) <= 2**31 - 1
               for rows, t in extents)


def _forward(q, k, v, unions: TileUnions, scale: float, plan: _Plan, top_k: int | None = None):
    """Forward kernel: out [B,S_q,Hq,D] (q's dtype), natural-log LSE [B,Hq,S_q] fp32.

    ``unions`` are :func:`_unions_for`'s; taller than the forward's tiles (a plan with
    ``union_rows``) they are cut to them first (``top_k``: K of the routes, which only
    sets the width of the cut; None = the parent's width)."""
    kernels, interpreted = _load_kernels()
    bsz, s_q, hq, d = q.shape
    if not plan.flat and unions.rows_per_tile != plan.rows_per_tile:
        unions = _split_tile_unions(unions, plan.rows_per_tile, top_k or unions.union.shape[2], s_q)
    hkv = k.shape[2]
    out = _new_buffer((bsz, s_q, hq, d), q.dtype, q.device)
    lse = _new_buffer((bsz, hq, s_q), torch.float32, q.device)
    n_tiles, width = unions.union.shape[1], unions.union.shape[2]
    args = (
        q, k, v, out, lse, unions.union, unions.count, unions.rowbits,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        s_q, n_tiles, width, hkv, plan.group, d, scale * kernels.LOG2E,
    )
    constexprs = dict(T=1 if plan.flat else plan.rows_per_tile, D_PAD=plan.head_dim_pad,
                      IEEE=interpreted or q.dtype == torch.float32, INTERPRET=interpreted, FLAT=plan.flat,
                      EVEN_D=d == plan.head_dim_pad,
                      OFFS32=_offsets_fit_int32((k.shape[1], k), (v.shape[1], v)))
    b = plan.blocks
    _launch(kernels.qsa_forward_kernel, args, constexprs, unions, bsz * hkv, plan.group,
            plan.fwd_heads, b.block_k, b.num_warps, b.num_stages, q.device)
    return out, lse


def _backward(q, k, v, out, lse, grad_out, unions: TileUnions, scale: float, plan: _Plan, top_k: int,
              skip_dkdv: bool = False):
    """Backward kernel: dq (q's dtype), dk, dv (k's dtype) from fp32 atomic accumulators.

    ``unions`` are the forward's (``top_k`` = K of the routes they came from); a plan
    with shorter backward tiles splits them first. ``skip_dkdv`` (measurement only)
    leaves out the dK/dV atomics: dk, dv come back zero."""
    kernels, interpreted = _load_kernels()
    bsz, s_q, hq, d = q.shape
    if plan.bwd_pairs:
        unions = _split_flat_unions(unions, plan.bwd_pairs, plan.group, top_k, s_q, plan.bwd_span)
    else:
        unions = _split_tile_unions(unions, plan.backward_rows, top_k, s_q)
    s_kv, hkv = k.shape[1], k.shape[2]
    dq = _new_buffer((bsz, s_q, hq, d), q.dtype, q.device)
    dk = torch.zeros((bsz, s_kv, hkv, d), dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    n_tiles, width = unions.union.shape[1], unions.union.shape[2]
    args = (
        q, k, v, out, grad_out, lse, unions.union, unions.count, unions.rowbits, dq, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *grad_out.stride(),
        *lse.stride(), *dq.stride(), *dk.stride()[:3],
        s_q, n_tiles, width, hkv, plan.group, d, scale, scale * kernels.LOG2E,
    )
    flat = plan.flat or plan.bwd_pairs > 0
    constexprs = dict(T=1 if flat else plan.backward_rows, D_PAD=plan.head_dim_pad,
                      IEEE=interpreted or q.dtype == torch.float32, INTERPRET=interpreted,
                      SKIP_DKDV=skip_dkdv, FLAT=flat, EVEN_D=d == plan.head_dim_pad,
                      OFFS32=_offsets_fit_int32((s_kv, k), (s_kv, v), (s_kv, dk)),
                      LEAN_REGISTERS=KERNEL_OPTIONS["lean_backward"])
    b = plan.blocks
    _launch(kernels.qsa_backward_kernel, args, constexprs, unions, bsz * hkv, plan.group,
            plan.bwd_heads, b.backward_block_k, b.backward_num_warps, b.backward_num_stages,
            q.device)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _TritonQSA(torch.autograd.Function):
    """query/key/value -> out; the tile unions and plan are non-differentiable inputs."""

    @staticmethod
    def forward(ctx, query, key, value, union, count, rowbits, scale, plan, top_k):
        unions = TileUnions(union, count, rowbits, plan.sorted_rows)
        out, lse = _forward(query, key, value, unions, scale, plan, top_k)
        ctx.save_for_backward(query, key, value, out, lse, union, count, rowbits)
        ctx.scale, ctx.plan, ctx.top_k = scale, plan, top_k
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse, union, count, rowbits = ctx.saved_tensors
        unions = TileUnions(union, count, rowbits, ctx.plan.sorted_rows)
        dq, dk, dv = _backward(query, key, value, out, lse, grad_out, unions, ctx.scale, ctx.plan,
                               ctx.top_k)
        return dq, dk, dv, None, None, None, None, None, None


def triton_sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    block_sizes: BlockSizes | None = None,
) -> torch.Tensor:
    """Route-sparse GQA with token-gather Triton kernels (forward and backward).

    Args:
        query: ``[B, S_q, Hq, D]`` fp16/bf16/fp32 CUDA tensor (any strides), D <= 256.
        key, value: ``[B, S_kv, Hkv, D]``, same dtype and device; Hq % Hkv == 0.
            S_kv may differ from S_q (context-parallel shards).
        selected_token_ids: ``[B, S_q, K]`` signed int32/int64 IDs into ``[0, S_kv)``;
            anything else is padding and duplicates count once.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        block_sizes: launch configuration, default :func:`default_block_sizes`.

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype. Rows without routes are exactly 0 and
        add nothing to any gradient. Gradients reach query, key and value; dK/dV
        are accumulated with fp32 atomics, so they are not bitwise deterministic.

    Raises:
        TypeError / ValueError: the contract's input checks; ValueError also for D >
            256 and for CPU tensors unless Triton's interpreter is on.
        ImportError: triton is not installed.
        RuntimeError: gradients are needed while ``torch.use_deterministic_algorithms``
            is on (a warning instead in warn-only mode).
    """
    checked, plan = _setup(query, key, value, selected_token_ids, softmax_scale, block_sizes)
    check_deterministic_backward("triton_qsa", query, key, value)
    unions = _unions_for(selected_token_ids, checked.dims.kv_length, plan)
    return _TritonQSA.apply(query, key, value, unions.union, unions.count, unions.rowbits,
                            checked.scale, plan, selected_token_ids.shape[2])


def _setup(query, key, value, selected_token_ids, softmax_scale, block_sizes=None):
    """The contract's checks and this backend's own; returns ``(checked, plan)``."""
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale, dtypes=_DTYPES)
    dims = checked.dims
    if dims.head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"query head dim must be <= {_MAX_HEAD_DIM} for triton_qsa, got {dims.head_dim}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    _, interpreted = _load_kernels()
    if query.device.type != "cuda" and not interpreted:
        raise ValueError(
            f"query is on {query.device}: triton_qsa needs CUDA tensors "
            "(CPU tensors only with TRITON_INTERPRET=1 set before triton is imported)"
        )
    return checked, _default_plan(query, key) if block_sizes is None else _make_plan(
        dims.group_size, dims.head_dim, block_sizes)


def _default_plan(query: torch.Tensor, key: torch.Tensor) -> _Plan:
    head_dim = query.shape[3]
    blocks = default_block_sizes(query.device, head_dim, query.dtype)
    return _make_plan(query.shape[2] // key.shape[2], head_dim, blocks)


# ---------------------------------------------------------------- residual form
# For qsa_torch.api's custom ops: the forward hands back what the backward needs, so
# a backward through the op does not run the forward again. Default block sizes only.
def forward_with_residuals(query, key, value, selected_token_ids, softmax_scale: float):
    """``(out, lse, union, count, rowbits)``: the output and the residuals of
    :func:`backward_from_residuals` (shapes: :func:`residual_shapes`). No autograd."""
    checked, plan = _setup(query, key, value, selected_token_ids, softmax_scale)
    unions = _unions_for(selected_token_ids, checked.dims.kv_length, plan)
    out, lse = _forward(query, key, value, unions, checked.scale, plan, selected_token_ids.shape[2])
    return out, lse, unions.union, unions.count, unions.rowbits


def residual_shapes(query, key, selected_token_ids) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of :func:`forward_with_residuals`'s results, from metadata only."""
    bsz, s_q, hq, _ = query.shape
    plan = _default_plan(query, key)
    n_tiles = plan.n_union_tiles(s_q)
    width = min(plan.sorted_rows * selected_token_ids.shape[2], key.shape[1])
    return [(tuple(query.shape), query.dtype), ((bsz, hq, s_q), torch.float32),
            ((bsz, n_tiles, width), torch.int32), ((bsz, n_tiles), torch.int32),
            ((bsz, n_tiles, width), torch.int32)]


def backward_from_residuals(grad_out, query, key, value, out, lse, union, count, rowbits,
                            softmax_scale: float, top_k: int):
    """``(dq, dk, dv)`` from :func:`forward_with_residuals`'s results (same inputs;
    ``top_k``: K of their ``[B, S_q, K]`` routes)."""
    plan = _default_plan(query, key)
    unions = TileUnions(union, count, rowbits, plan.sorted_rows)
    return _backward(query, key, value, out, lse, grad_out, unions, softmax_scale, plan, top_k)
