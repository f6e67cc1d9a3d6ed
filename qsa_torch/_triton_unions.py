"""Route unions for the Triton kernels, built through torch.

The recipe is ``qsa_triton.plan.union_recipe`` (shared with ``qsa_jax``), per group of
query rows one of two that give the same unions (``qsa_triton.plan.rank_recipe``
picks): one kernel marks each group's IDs, a byte per K/V row, and places each route at
its ID's rank among them (``qsa_triton.union_rank``); or a Triton kernel writes one sort
key per route straight from the routes (any strides, int32 or int64), ``torch.sort``
orders them (flat radix sorts of many groups at once), and a second kernel turns the
sorted keys into the union, its length and the row bits. Coarser unions are cut into finer ones by a third
kernel instead of being built again.
Nothing synchronises with the host: union widths are static (``T * K`` capped at S_kv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qsa_triton import launch as spec
from qsa_triton.config import MAX_ROWS_PER_TILE
from qsa_triton.plan import (MAX_GRID_Y, CutStep, KeyPlan, Plan, SortStep, backward_cut, rank_recipe, tile_cut,
                             union_recipe)

from . import _triton_launch as launcher
from .routes import validate_routes


@dataclass(frozen=True)
class TileUnions:
    """Per-tile route unions: what the kernels walk.

    ``union`` int32 ``[B, n_tiles, W]``: the distinct valid IDs routed by the tile's
    rows, ascending, then -1 (W = min(T * K, S_kv); a flat program's rows times K).
    ``count`` int32 ``[B, n_tiles]``: how many entries of ``union`` are valid. ``rowbits``
    int32 ``[B, n_tiles, W]``: bit t set iff row t of the tile routes to ``union[..., u]``
    (0 past the count). Unpadded unions (``build_unions(..., padded=False)``, which only
    the kernels read, up to each count) leave the entries past each count unwritten.
    ``rows_per_tile``: T (for flat programs, the power of two bounding their rows).
    """

    union: torch.Tensor
    count: torch.Tensor
    rowbits: torch.Tensor
    rows_per_tile: int


def check_union_arguments(routes: torch.Tensor, kv_length: int, rows_per_tile: int) -> None:
    validate_routes(routes)
    if routes.dim() != 3:
        raise ValueError(f"routes must have rank 3 [B, S_q, K], got shape {tuple(routes.shape)}")
    if not 0 < kv_length < 2**31:
        raise ValueError(f"kv_length must be in [1, 2**31), got {kv_length}")
    if rows_per_tile < 1 or rows_per_tile > MAX_ROWS_PER_TILE or rows_per_tile & (rows_per_tile - 1):
        raise ValueError(f"rows_per_tile must be a power of two in [1, {MAX_ROWS_PER_TILE}], got {rows_per_tile}")
    interpreted = launcher.interpreted()
    if routes.device.type != "cuda" and not interpreted:
        raise ValueError(f"routes are on {routes.device}: the Triton union kernels need CUDA tensors "
                         "(CPU tensors only with TRITON_INTERPRET=1 set before triton is imported)")


def sorted_unions(routes: torch.Tensor, kv_length: int, step: SortStep,
                  max_grid_y: int = MAX_GRID_Y) -> TileUnions:
    """The unions of ``step``'s groups of rows: keys kernel, ``torch.sort``, merge kernel."""
    bsz, _, k = routes.shape
    device = routes.device
    keys = launcher.run(spec.keys_launch(step, (tuple(routes.shape), routes.stride()), kv_length, max_grid_y),
                        {"ROUTES": routes}, device)["KEYS"]
    chunk = step.keys.per_sort * step.rows * k  # whole groups per sort
    if chunk >= keys.numel():
        keys = torch.sort(keys).values
    else:
        for start in range(0, keys.numel(), chunk):
            keys[start:start + chunk] = torch.sort(keys[start:start + chunk]).values
    merged = launcher.run(spec.merge_launch(step, bsz, k, interpreted=launcher.interpreted()), {"KEYS": keys},
                          device)
    return TileUnions(merged["UNION"], merged["COUNT"], merged["ROWBITS"], step.rows)


def rank_unions(routes: torch.Tensor, kv_length: int, step: SortStep, *, padded: bool = True) -> TileUnions:
    """:func:`sorted_unions` without the sort (``qsa_triton.union_rank``): the same
    unions element for element (with ``padded`` False, up to each count only), from each
    route's rank among its group's IDs, window by window (``qsa_triton.launch.rank_window``:
    the kernel's scratch no larger than the sort's int32 keys; the grid is one-dimensional)."""
    bsz, _, k = routes.shape
    groups = bsz * step.n_groups
    window = spec.rank_window(step, bsz, k, kv_length)
    operand = (tuple(routes.shape), routes.stride())
    interpreted = launcher.interpreted()
    parts = []
    for first in range(0, groups, window):
        launch = spec.rank_launch(step, operand, kv_length, first, min(window, groups - first),
                                  interpreted=interpreted, fill=padded)
        ranked = launcher.run(launch, {"ROUTES": routes}, routes.device)
        parts.append({name: ranked[name] for name in ("UNION", "ROWBITS", "COUNT")})
        del ranked  # the scratch
    union, rowbits, count = (parts[0][name] if len(parts) == 1 else torch.cat([p[name] for p in parts])
                             for name in ("UNION", "ROWBITS", "COUNT"))
    shape = (bsz, step.n_groups, step.width)
    return TileUnions(union.view(shape), count.view(shape[:2]), rowbits.view(shape), step.rows)


def step_unions(routes: torch.Tensor, kv_length: int, step: SortStep,
                max_grid_y: int = MAX_GRID_Y, *, padded: bool = True) -> TileUnions:
    """``step``'s unions by the recipe ``qsa_triton.plan.rank_recipe`` picks (the sort
    recipe's are always padded)."""
    if rank_recipe(step, routes.shape[2], kv_length):
        return rank_unions(routes, kv_length, step, padded=padded)
    return sorted_unions(routes, kv_length, step, max_grid_y)


def cut_unions(unions: TileUnions, step: CutStep, max_grid_y: int = MAX_GRID_Y, *,
               padded: bool = True) -> TileUnions:
    """``step``'s sub-unions of ``unions`` (no sort; ``unions`` are read up to their
    counts)."""
    launch = spec.cut_launch(step, tuple(unions.union.shape), max_grid_y, interpreted=launcher.interpreted(),
                             fill=padded)
    cut = launcher.run(launch, {"UNION": unions.union, "ROWBITS": unions.rowbits, "COUNT": unions.count},
                       unions.union.device)
    return TileUnions(cut["SUB_UNION"], cut["SUB_COUNT"], cut["SUB_ROWBITS"], step.rows_per_tile)


def build_tile_unions(routes: torch.Tensor, kv_length: int, rows_per_tile: int) -> TileUnions:
    """Unions of tiles of ``rows_per_tile`` (T, a power of two <= 32) consecutive rows.

    ``routes``: int32/int64 ``[B, S_q, K]``, any strides (other dtypes raise TypeError),
    CUDA tensors (CPU ones under Triton's interpreter). IDs outside ``[0, kv_length)``
    (negative, past the end, huge int64) are padding and repeated IDs count once, so no
    :func:`qsa_torch.routes.normalize_routes` pass is needed first. The last tile is
    padded with empty rows.
    """
    check_union_arguments(routes, kv_length, rows_per_tile)
    bsz, s_q, k = routes.shape
    n_tiles = -(-s_q // rows_per_tile)
    keys = KeyPlan.make(bsz * n_tiles, rows_per_tile, k, kv_length)
    step = SortStep(rows_per_tile, n_tiles, min(rows_per_tile * k, kv_length), keys)
    return sorted_unions(routes, kv_length, step)


def build_unions(routes: torch.Tensor, kv_length: int, plan: Plan, *, padded: bool = True) -> TileUnions:
    """The forward's unions of ``plan`` (``qsa_triton.plan.union_recipe``): tile unions
    for padded plans; for flat plans (``BlockSizes.flatten_heads``), per program, the
    union of the routes of the query rows its (row, head) pairs touch, bit t of
    ``rowbits`` being the program's t-th query row. ``padded`` False: the entries past
    each count are left unwritten (unions only the kernels read; a caller who receives
    unions gets them padded, every element determined)."""
    check_union_arguments(routes, kv_length, plan.rows_per_tile)
    bsz, s_q, k = routes.shape
    step, cut = union_recipe(plan, s_q, k, kv_length, bsz)
    unions = step_unions(routes, kv_length, step, plan.max_grid_y, padded=padded and cut is None)
    return unions if cut is None else cut_unions(unions, cut, plan.max_grid_y, padded=padded)


def build_flat_unions(routes: torch.Tensor, kv_length: int, plan: Plan) -> TileUnions:
    """:func:`build_unions` for a flat plan."""
    if not plan.flat:
        raise ValueError("build_flat_unions takes a flat plan (BlockSizes(flatten_heads=True), G not a power of two)")
    return build_unions(routes, kv_length, plan)


def backward_unions(unions: TileUnions, plan: Plan, top_k: int, query_length: int) -> TileUnions:
    """The backward's unions: the forward's, or cut into the backward's shorter tiles
    (``top_k``: K of the routes they came from)."""
    cut = backward_cut(plan, query_length, top_k, unions.rows_per_tile, unions.union.shape[2])
    return unions if cut is None else cut_unions(unions, cut, plan.max_grid_y, padded=False)


def split_tile_unions(unions: TileUnions, rows_per_tile: int, top_k: int, query_length: int) -> TileUnions:
    """Tile unions cut into tiles of ``rows_per_tile`` rows (a power of two dividing
    theirs): exactly what :func:`build_tile_unions` gives at that height, without a sort.
    ``top_k`` and ``query_length``: K and S_q of the ``[B, S_q, K]`` routes they came from."""
    cut = tile_cut(unions.rows_per_tile, unions.union.shape[2], rows_per_tile, top_k, query_length)
    return unions if cut is None else cut_unions(unions, cut)
