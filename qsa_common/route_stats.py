"""Overlap statistics of route sets, in numpy: what the token-gather kernels pay for.

Both token-gather kernels (torch Triton, JAX Pallas; docs/design-token-gather.md)
give each program several query rows and gather, once, the *union* of those rows'
routes; every gathered K/V row is then multiplied against all of the program's
matrix rows (query row x head pairs). Their cost is therefore about

    sum over programs of |union of the program's rows' routes| x matrix rows,

against the useful ``sum over (row, head) of |R(row)|`` of the contract. The ratio
is the *union inflation* (:func:`union_inflation`); it grows as neighbouring rows
share fewer routes, which :func:`adjacent_jaccard` measures.

Everything is computed from one scan over the rows that finds, for every distinct
valid ID of row ``r``, the previous row of the same batch row routing to it
(:func:`_scan`): the union of rows ``a..b`` counts the IDs of those rows whose
previous occurrence is before ``a``, and rows ``r-1, r`` share the IDs whose
previous occurrence is ``r-1``. Memory is O(kv_length + chunk * K), never
O(S_q * S_kv), so S = 131072 with K = 2052 is a few seconds.

Sets follow the contract: IDs outside ``[0, kv_length)`` (-1, past the end, huge
int64) are padding and duplicates count once. Token level: these are sets of K/V
rows, not of four-token blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Tiling",
    "FLAT_128",
    "adjacent_jaccard",
    "mean_adjacent_jaccard",
    "union_inflation",
    "key_tile_inflation",
    "route_stats",
]

_CHUNK_ROWS = 256
_NONE = np.iinfo(np.int64).max  # "previous row" of a padding slot or a repeated ID: never counted


@dataclass(frozen=True)
class Tiling:
    """How a token-gather kernel assigns (query row, head) pairs to programs.

    ``pairs=P``: flat programs. Per batch row and KV head, the S_q * G pairs
    (row i, head h of the group of G query heads) are numbered ``i * G + h`` and
    program j takes pairs ``j*P .. j*P + P - 1`` (the last one fewer); its rows are
    those its pairs touch, and its matrix has P rows (the last program's too: the
    kernel computes a full block). ``rows=T``: tiles of T consecutive query rows
    with all G heads: T * G matrix rows (the last tile's empty rows included; a
    kernel that pads G to a power of two G_pad does G_pad / G times that work).
    Exactly one of the two is set.
    """

    pairs: int | None = None
    rows: int | None = None

    def __post_init__(self):
        if (self.pairs is None) == (self.rows is None):
            raise ValueError("a Tiling has exactly one of pairs= (flat programs) or rows= (row tiles)")
        size = self.pairs if self.pairs is not None else self.rows
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"Tiling size must be a positive int, got {size!r}")

    @property
    def label(self) -> str:
        return f"flat{self.pairs}" if self.pairs is not None else f"tile{self.rows}"

    def programs(self, query_length: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first_row, last_row, matrix_rows)`` of every program of one batch row."""
        if self.rows is not None:
            first = np.arange(0, query_length, self.rows)
            last = np.minimum(first + self.rows, query_length) - 1
            return first, last, np.full(first.shape, self.rows * group, dtype=np.int64)
        total = query_length * group
        start = np.arange(0, total, self.pairs)
        end = np.minimum(start + self.pairs, total)
        return start // group, (end - 1) // group, np.full(start.shape, self.pairs, dtype=np.int64)


FLAT_128 = Tiling(pairs=128)  # the forward and backward programs of both kernels on SM90 at D > 128


def _as_batched(routes: np.ndarray, kv_length: int) -> np.ndarray:
    routes = np.asarray(routes)
    if routes.ndim == 2:
        routes = routes[None]
    if routes.ndim != 3:
        raise ValueError(f"routes must be [S, K] or [B, S, K], got shape {routes.shape}")
    if routes.dtype.kind != "i":
        raise TypeError(f"routes must be signed integers, got {routes.dtype}")
    if not isinstance(kv_length, (int, np.integer)) or kv_length < 1:
        raise ValueError(f"kv_length must be a positive int, got {kv_length!r}")
    if routes.shape[1] == 0:
        raise ValueError("routes have no query rows")
    return routes


def _scan(routes: np.ndarray, kv_length: int) -> Iterator[tuple[int, np.ndarray]]:
    """Per chunk of rows of one batch row ``[S, K]``: ``(first_row, prev [C, K])``.

    ``prev[c, j]`` is the last row before ``first_row + c`` whose routes hold ID
    ``routes[first_row + c, j]`` (-1 if none), or ``_NONE`` for a padding slot or a
    repeat of an ID earlier in the same row. Rows are walked in order with one
    ``last_seen`` table of S_kv entries (repeats within a row are found by a scatter
    of slot numbers: exactly one slot per distinct ID keeps its own number).
    """
    s_q, k = routes.shape
    last_seen = np.full(kv_length + 1, -1, dtype=np.int64)  # entry kv_length: padding
    stamp = np.full(kv_length + 1, -1, dtype=np.int64)
    slots = np.arange(k)
    for start in range(0, s_q, _CHUNK_ROWS):
        chunk = routes[start : start + _CHUNK_ROWS]
        ids = np.where((chunk >= 0) & (chunk < kv_length), chunk, kv_length).astype(np.int64)
        prev = np.empty(ids.shape, dtype=np.int64)
        for c, row in enumerate(ids):
            stamp[row] = slots  # one of the slots holding an ID keeps its number
            first = (stamp[row] == slots) & (row < kv_length)
            prev[c] = np.where(first, last_seen[row], _NONE)
            last_seen[row] = start + c
        yield start, prev


def _row_sizes_and_shared(routes: np.ndarray, kv_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per batch row: ``|R(r)|`` ``[S]`` and ``|R(r-1) & R(r)|`` ``[S]`` (0 for r = 0)."""
    bsz, s_q, _ = routes.shape
    sizes = np.zeros((bsz, s_q), dtype=np.int64)
    shared = np.zeros((bsz, s_q), dtype=np.int64)
    for b in range(bsz):
        for start, prev in _scan(routes[b], kv_length):
            rows = start + np.arange(prev.shape[0])[:, None]
            sizes[b, start : start + prev.shape[0]] = (prev < rows).sum(1)
            shared[b, start : start + prev.shape[0]] = (prev == rows - 1).sum(1)
    return sizes, shared


def _jaccard_from(sizes: np.ndarray, shared: np.ndarray) -> np.ndarray:
    union = sizes[:, 1:] + sizes[:, :-1] - shared[:, 1:]
    return np.where(union > 0, shared[:, 1:] / np.maximum(union, 1), 1.0)


def adjacent_jaccard(routes: np.ndarray, kv_length: int) -> np.ndarray:
    """Jaccard similarity of the route sets of consecutive query rows.

    Args:
        routes: ``[S_q, K]`` or ``[B, S_q, K]`` signed integer route IDs.
        kv_length: S_kv; IDs outside ``[0, S_kv)`` are padding, repeats count once.

    Returns:
        float64 ``[S_q - 1]`` (or ``[B, S_q - 1]``): entry r is
        ``|R(r) & R(r+1)| / |R(r) | R(r+1)|`` over valid IDs (token level), 1.0
        where both sets are empty. Rows of different batch rows are never paired.
    """
    batched = np.asarray(routes).ndim == 3
    sizes, shared = _row_sizes_and_shared(_as_batched(routes, kv_length), kv_length)
    jac = _jaccard_from(sizes, shared)
    return jac if batched else jac[0]


def mean_adjacent_jaccard(routes: np.ndarray, kv_length: int, *, first_row: int = 0) -> float:
    """Mean of :func:`adjacent_jaccard` over the pairs ``(r, r+1)`` with ``r >= first_row``,
    all batch rows together (``first_row`` skips e.g. the QSA identity region, where
    every row selects all visible blocks and neighbours share all but one token)."""
    jac = adjacent_jaccard(_as_batched(routes, kv_length), kv_length)[:, first_row:]
    if jac.size == 0:
        raise ValueError(f"no adjacent row pairs at or after row {first_row}")
    return float(jac.mean())


def _union_sizes(prev: np.ndarray, start: int, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Contribution of the chunk's rows to each program's union size ``[n_programs]``:
    program j gains the IDs of its rows in this chunk first seen at or after its first
    row (a program's union counts each of its IDs once, at its first row)."""
    n_rows = prev.shape[0]
    stop = start + n_rows
    out = np.zeros(first.shape, dtype=np.int64)
    touching = np.nonzero((first < stop) & (last >= start))[0]
    if touching.size == 0:
        return out
    # row-program incidences within the chunk, at most a few per row
    lo = np.maximum(first[touching], start)
    hi = np.minimum(last[touching], stop - 1)
    counts = hi - lo + 1
    program = np.repeat(touching, counts)
    row = np.repeat(lo - start, counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    new = (prev[row] < first[program][:, None]).sum(1)
    np.add.at(out, program, new)
    return out


def union_inflation(routes: np.ndarray, kv_length: int, *, group: int, tiling: Tiling = FLAT_128) -> float:
    """Tile-union inflation of route sets for one kernel tiling.

    ``sum_j |U_j| * M_j  /  (G * sum_r |R(r)|)``, where j runs over the programs of
    ``tiling`` (:class:`Tiling`) in every batch row, ``U_j`` is the union of the
    route sets of the query rows program j touches, ``M_j`` its matrix rows
    ((row, head) pairs, padding included) and ``R(r)`` the route set of row r.
    The numerator is what a token-gather kernel gathers and multiplies (each union
    entry once per matrix row); the denominator is the useful work, the entries the
    contract attends to over all G heads. 1.0 means no waste; a program whose rows
    share nothing pays ``rows touched``-fold. Cost of a token-gather kernel ~
    inflation x useful work.

    Args:
        routes: ``[S_q, K]`` or ``[B, S_q, K]`` signed integer route IDs.
        kv_length: S_kv (IDs outside ``[0, S_kv)`` are padding; repeats count once).
        group: G = Hq / Hkv, the query heads per KV head.
        tiling: flat programs of P pairs or tiles of T rows (default: flat, P = 128).

    Returns:
        The inflation (float); ``nan`` when no row has a valid route.
    """
    return route_stats(routes, kv_length, groups=(group,), tilings=(tiling,))["inflation"][group][tiling.label]


def key_tile_inflation(routes: np.ndarray, kv_length: int, *, keys_per_tile: int) -> float:
    """Inflation of a backward whose programs own tiles of K/V rows instead of query rows.

    ``sum_j |Q_j| * T  /  sum_r |R(r)|``, where j runs over the tiles of ``T =
    keys_per_tile`` consecutive K/V rows of every batch row and ``Q_j`` is the set of
    query rows routing into tile j: such a program gathers those rows (all G heads of
    each, so G cancels) and multiplies each against all T keys of its tile. 1.0 means no
    waste (every gathered row routes to every key of the tile); a row routing to one
    key of a tile pays T-fold for it. The inverse of :func:`union_inflation`'s view:
    that one grows as neighbouring rows share fewer routes, this one as a row's routes
    scatter over the keys.

    Args:
        routes: ``[S_q, K]`` or ``[B, S_q, K]`` signed integer route IDs.
        kv_length: S_kv (IDs outside ``[0, S_kv)`` are padding; repeats count once).
        keys_per_tile: T, a positive int.

    Returns:
        The inflation (float); ``nan`` when no row has a valid route.
    """
    routes = _as_batched(routes, kv_length)
    if not isinstance(keys_per_tile, (int, np.integer)) or keys_per_tile < 1:
        raise ValueError(f"keys_per_tile must be a positive int, got {keys_per_tile!r}")
    useful = int(_row_sizes_and_shared(routes, kv_length)[0].sum())
    # each row's distinct tiles: its valid IDs mapped to tile numbers, the rest padding
    tiles = np.where((routes >= 0) & (routes < kv_length), routes // keys_per_tile, -1)
    touched = int(_row_sizes_and_shared(tiles, -(-kv_length // keys_per_tile))[0].sum())
    return touched * keys_per_tile / useful if useful else float("nan")


def route_stats(
    routes: np.ndarray,
    kv_length: int,
    *,
    groups: Iterable[int] = (12,),
    tilings: Iterable[Tiling] = (FLAT_128,),
    first_row: int = 0,
) -> dict:
    """Jaccard and union inflation of one route set from a single scan.

    Returns ``{"jaccard": mean adjacent-row Jaccard over pairs (r, r+1) with r >=
    first_row, "jaccard_all": the same over all pairs, "useful": sum |R(r)|,
    "inflation": {G: {tiling.label: inflation}}}`` (see :func:`mean_adjacent_jaccard`
    and :func:`union_inflation` for the definitions; ``jaccard`` is ``nan`` when there
    is no pair at or after ``first_row``).
    """
    routes = _as_batched(routes, kv_length)
    groups = tuple(int(g) for g in groups)
    tilings = tuple(tilings)
    if any(g < 1 for g in groups):
        raise ValueError(f"groups must be positive, got {groups}")
    bsz, s_q, _ = routes.shape
    plans = {(g, t.label): t.programs(s_q, g) for g in groups for t in tilings}
    gathered = {key: 0 for key in plans}
    sizes = np.zeros((bsz, s_q), dtype=np.int64)
    shared = np.zeros((bsz, s_q), dtype=np.int64)
    for b in range(bsz):
        unions = {key: np.zeros(plan[0].shape, dtype=np.int64) for key, plan in plans.items()}
        for start, prev in _scan(routes[b], kv_length):
            n = prev.shape[0]
            rows = start + np.arange(n)[:, None]
            sizes[b, start : start + n] = (prev < rows).sum(1)
            shared[b, start : start + n] = (prev == rows - 1).sum(1)
            for key, (first, last, _) in plans.items():
                unions[key] += _union_sizes(prev, start, first, last)
        for key, (_, _, matrix_rows) in plans.items():
            gathered[key] += int((unions[key] * matrix_rows).sum())
    useful = int(sizes.sum())
    jac = _jaccard_from(sizes, shared)
    inflation: dict[int, dict[str, float]] = {g: {} for g in groups}
    for (g, label), total in gathered.items():
        inflation[g][label] = total / (g * useful) if useful else float("nan")
    tail = jac[:, first_row:]
    return {"jaccard": float(tail.mean()) if tail.size else float("nan"),
            "jaccard_all": float(jac.mean()) if jac.size else float("nan"),
            "useful": useful, "inflation": inflation}
