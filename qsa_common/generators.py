"""Route generators for one document, in numpy.

Every generator returns document-local routes ``[L, width]`` (int64) for a
document of ``L`` tokens: a valid ID is in ``[0, L)``; anything else (negative,
``>= L``, huge) is padding. :mod:`qsa_common.layouts` places documents into
padded, packed and context-parallel problems. numpy drives all randomness, so
``qsa_torch`` and ``qsa_jax`` see identical routes for the same seed.

Families:

* ``"qsa"``: the Qwen3.8-Flash-Next route format (docs/contract.md): the top_k
  complete four-token blocks a query can causally see, chosen by a score that
  drifts slowly along the sequence (so neighbouring queries share most of their
  blocks), then the query's causal tail, then -1. ``overlap=`` sets how much
  neighbouring queries share: their adjacent-row Jaccard, from that of independent
  rows (~0.2 at S=32768, top_k 512) to ~0.99.
* ``"random"``: arbitrary distinct causal IDs per row, in shuffled slots.
* ``"adversarial"``: random IDs (not causal) plus duplicates, -1, out-of-range,
  huge positive and negative int64 values and empty rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

__all__ = [
    "FAMILIES",
    "qsa_width",
    "qsa_format_routes",
    "random_routes",
    "adversarial_routes",
    "family",
]

FAMILIES = ("qsa", "random", "adversarial")

# Interpolation period (tokens) and amplitude of the per-query score drift of
# the "qsa" family. Tuned so that consecutive tokens past the identity region
# share ~85-90% of their blocks (Jaccard), as measured on the real indexer.
_DRIFT_PERIOD = 8
_DRIFT_SIGMA = 1.0
_ROWS_PER_CHUNK = 128
_POOL_FACTOR = 3


def qsa_width(top_k: int) -> int:
    """Route width of the QSA format: top_k four-slot blocks plus one tail group."""
    return 4 * top_k + 4


def _check_width(width: int, minimum: int) -> int:
    if width < minimum:
        raise ValueError(f"width must be at least {minimum}, got {width}")
    return int(width)


def qsa_format_routes(
    doc_length: int,
    *,
    top_k: int = 512,
    width: int | None = None,
    local_blocks: int = 8,
    overlap: float | None = None,
    rng: np.random.Generator,
) -> np.ndarray:
    """QSA-format routes for one document: ``[doc_length, width]`` int64.

    Token ``p`` sees complete blocks ``0 .. (p+1)//4 - 1``. It keeps all of them
    when there are at most ``top_k`` (the identity region), otherwise ``top_k`` of
    them: always the last ``local_blocks`` visible blocks, then the best-scoring
    others. Blocks are written in ascending order as four consecutive IDs, then the
    causal tail ``4*((p+1)//4) .. p`` padded with -1, then -1 groups.

    The scores: by default (``overlap=None``) ``u[b] + drift(p)[b]``, where ``u``
    is a per-block base score and ``drift`` interpolates between random anchors
    every ``_DRIFT_PERIOD`` tokens (neighbouring rows share ~85-90% of their
    blocks); this output is fixed for a seed, benchmark history depends on it.
    With ``overlap`` the scores follow an AR(1) process along the rows whose
    correlation is set row by row so that the expected Jaccard similarity of the
    selected block sets of adjacent rows is ``overlap`` (see
    :func:`_correlated_selection`); the token-level adjacent-row Jaccard past the
    identity region, as :mod:`qsa_common.route_stats` measures it, then lands
    within ~0.03 of ``overlap`` wherever the target is reachable (with few visible
    blocks even independent rows share many: S=8192, top_k 512 stays above ~0.38,
    S=32768 above ~0.2).

    Args:
        doc_length: L, tokens of the document.
        top_k: blocks selected per row past the identity region (>= 1).
        width: route width, default (and at least) ``4 * top_k + 4``.
        local_blocks: the most recent visible blocks every row keeps (capped at
            ``top_k // 2``).
        overlap: None, or the target adjacent-row Jaccard, a float in (0, 1).
        rng: the only source of randomness.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be positive, got {top_k}")
    width = _check_width(qsa_width(top_k) if width is None else width, qsa_width(top_k))
    if overlap is not None and (isinstance(overlap, bool) or not isinstance(overlap, (float, int, np.floating))
                                or not 0.0 < overlap < 1.0):
        raise ValueError(f"overlap must be None or a float in (0, 1), got {overlap!r}")
    routes = np.full((doc_length, width), -1, dtype=np.int64)
    n_blocks = doc_length // 4
    positions = np.arange(doc_length)
    visible = (positions + 1) // 4
    tail_len = positions + 1 - 4 * visible
    # identity region: every visible block is selected
    ident = visible <= top_k
    slots = np.arange(width)
    in_blocks = (slots // 4)[None, :] < visible[ident][:, None]
    rows = np.nonzero(~ident)[0]
    local = min(local_blocks, top_k // 2)
    if overlap is None:
        selection = _drifting_selection(n_blocks, rng)
    else:
        selection = _correlated_selection(n_blocks, top_k, local, float(overlap), rng)
    routes[ident] = np.where(in_blocks, slots[None, :], -1)
    # selection region, chunked over rows
    for start in range(0, rows.size, _ROWS_PER_CHUNK):
        chunk = rows[start : start + _ROWS_PER_CHUNK]
        top = selection(chunk, visible[chunk], top_k, local)
        top.sort(axis=1)
        routes[chunk, : 4 * top_k] = (4 * top[:, :, None] + np.arange(4)).reshape(len(chunk), -1)
    # causal tail group right after the selected blocks
    tail_group = np.minimum(visible, top_k)
    for j in range(3):
        has = tail_len > j
        routes[positions[has], 4 * tail_group[has] + j] = 4 * visible[has] + j
    return routes


Selection = Callable[[np.ndarray, np.ndarray, int, int], np.ndarray]


def _drifting_selection(n_blocks: int, rng: np.random.Generator) -> Selection:
    """The default score: base score plus a drift interpolated between random anchors.

    Returns ``select(chunk rows, their visible counts, top_k, local) -> [rows, top_k]``
    block IDs (unsorted); chunks must come in ascending order."""
    base = rng.standard_normal(n_blocks).astype(np.float32)
    anchor_seed = int(rng.integers(0, 2**62))
    anchors: dict[int, np.ndarray] = {}

    def anchor(a: int) -> np.ndarray:
        return np.random.default_rng([anchor_seed, a]).standard_normal(n_blocks).astype(np.float32)

    def select(chunk: np.ndarray, visible: np.ndarray, top_k: int, local: int) -> np.ndarray:
        vis = visible[:, None]
        span, low = int(vis.max()), int(vis.min())
        # Candidate pool of the chunk: the blocks with the highest base score
        # among those visible to its first and to its last row (so every row
        # has at least top_k visible candidates), plus every local window.
        pool = np.arange(max(0, low - local), span)
        for seen in (low, span):
            n_pool = min(seen, _POOL_FACTOR * top_k)
            pool = np.union1d(pool, np.argpartition(-base[:seen], n_pool - 1)[:n_pool])
        a_idx = chunk // _DRIFT_PERIOD
        for a in np.unique(np.concatenate([a_idx, a_idx + 1])):
            if a not in anchors:
                anchors[a] = anchor(int(a))
        t = ((chunk % _DRIFT_PERIOD) / _DRIFT_PERIOD).astype(np.float32)[:, None]
        lo = np.stack([anchors[a][pool] for a in a_idx])
        hi = np.stack([anchors[a + 1][pool] for a in a_idx])
        score = base[pool][None, :] + _DRIFT_SIGMA * ((1 - t) * lo + t * hi)
        score = np.where(pool[None, :] >= vis - local, np.inf, score)
        score = np.where(pool[None, :] < vis, score, -np.inf)
        top = pool[np.argpartition(-score, top_k - 1, axis=1)[:, :top_k]]
        for a in [a for a in anchors if a < a_idx.min()]:
            del anchors[a]
        return top

    return select


@functools.cache
def _normal_tail() -> tuple[np.ndarray, np.ndarray]:
    """``(z, Q(z))`` on a fine grid, Q the standard normal upper tail (for np.interp)."""
    z = np.linspace(-12.0, 12.0, 48 * 1024 + 1)
    return z, np.array([0.5 * math.erfc(x / math.sqrt(2.0)) for x in z])


def _kept_fraction(rho: np.ndarray, f: float) -> np.ndarray:
    """E|A & B| / |A| for the top fraction f of exchangeable standard normal scores
    at two rows with correlation ``rho`` (large-pool limit, threshold t = Q^-1(f)):
    P(X > t, X' > t) / f, by quadrature over X."""
    z, tail = _normal_tail()
    t = float(np.interp(f, tail[::-1], z[::-1]))
    x = t + np.linspace(0.0, 10.0, 801)
    density = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    rho = np.asarray(rho, dtype=np.float64)[:, None]
    joint = density * np.interp((t - rho * x) / np.sqrt(1.0 - rho * rho), z, tail)  # * P(X' > t | X = x)
    return (joint[:, 1:] + joint[:, :-1]).sum(1) * (x[1] - x[0]) / 2.0 / f


_RHO_GRID = 1.0 - np.logspace(0.0, -6.0, 257)  # 0 .. 1 - 1e-6, dense near 1


@functools.cache
def _correlation_table(overlap: float, top_k: int, local: int, pool: int) -> tuple[np.ndarray, np.ndarray]:
    """``(log f, rho)`` on a grid of pool fractions f = chosen / candidates: the score
    correlation with the previous row whose expected selected-block Jaccard is
    ``overlap`` when ``top_k - local`` of the candidates are chosen (the ``local``
    forced blocks are shared); 0 where even independent rows overlap more than that.
    Candidates range from ``top_k + 1 - local`` (first selecting row) to ``pool - local``."""
    chosen = top_k - local
    shared = 2.0 * top_k * overlap / (1.0 + overlap)  # |A & B| for that Jaccard
    want = (shared - local) / chosen  # fraction of the scored choices kept
    lowest, highest = chosen / max(pool - local, chosen + 1), chosen / (chosen + 1)
    grid = np.geomspace(min(lowest, highest), highest, 33)
    rho = np.empty(grid.shape)
    for i, f in enumerate(grid):
        kept = np.maximum.accumulate(_kept_fraction(_RHO_GRID, float(f)))  # monotone for interp
        rho[i] = 0.0 if want <= kept[0] else float(np.interp(want, kept, _RHO_GRID))
    return np.log(grid), rho


_POOL_SLOTS = 4  # scored candidate slots per selected block, overlap mode
_KEEP_RANKS = 2  # slots ranked within _KEEP_RANKS * top_k keep their block at a chunk boundary


def _correlated_selection(n_blocks: int, top_k: int, local: int, overlap: float,
                          rng: np.random.Generator) -> Selection:
    """Scores following an AR(1) process along the rows, for the ``overlap`` knob.

    A pool of M = min(4 * top_k, n_blocks) slots, each holding one block and a
    standard normal score; from row to row every score moves as
    ``x' = rho * x + sqrt(1 - rho^2) * noise`` (stationary, correlation rho). A
    row keeps its ``local`` newest visible blocks, then the ``top_k - local``
    best-scoring slots whose block is visible and not among those. rho is set per
    row (:func:`_correlation_table`) from the row's fraction f = chosen / candidates,
    so every row has the same expected Jaccard with its predecessor. While there
    are at most M visible blocks, slot i holds block i: an AR(1) process over all
    blocks. Past that, at each chunk boundary the slots ranked below
    ``2 * top_k`` take new blocks drawn uniformly from the visible blocks outside
    the pool (their scores carry on): a block that drops far out comes back, if
    ever, as another block, so selections spread over the whole visible range
    instead of a fixed pool. Relabelled slots are outside the top_k at the
    boundary, so relabelling leaves adjacent-row Jaccard unchanged. O(rows * M)
    time; O(chunk * M + n_blocks) memory.
    """
    pool = min(_POOL_SLOTS * top_k, n_blocks)
    slot_block = np.arange(pool)
    in_pool = np.zeros(n_blocks, dtype=bool)
    in_pool[:pool] = True
    score = rng.standard_normal(pool, dtype=np.float32)

    def select(chunk: np.ndarray, visible: np.ndarray, top_k: int, local: int) -> np.ndarray:
        nonlocal score
        limit = int(visible[0]) - local  # blocks below it are candidates for every row of the chunk
        if limit > pool:
            ranked = np.argsort(-score)[_KEEP_RANKS * top_k :]
            movable = ranked[slot_block[ranked] < limit]
            free = np.flatnonzero(~in_pool[:limit])
            n = min(movable.size, free.size)
            if n:
                moved = movable[movable.size - n :]  # the lowest-ranked
                in_pool[slot_block[moved]] = False
                slot_block[moved] = rng.choice(free, size=n, replace=False)
                in_pool[slot_block[moved]] = True
        fraction = (top_k - local) / (np.minimum(visible, pool) - local)
        rho = np.interp(np.log(fraction), *_correlation_table(overlap, top_k, local, pool)).astype(np.float32)
        spread = np.sqrt(1.0 - rho * rho)
        scores = rng.standard_normal((chunk.size, pool), dtype=np.float32)
        for i in range(chunk.size):
            score = rho[i] * score + spread[i] * scores[i]
            scores[i] = score
        scores = np.where(slot_block[None, :] < (visible - local)[:, None], scores, -np.inf)
        chosen = top_k - local
        best = slot_block[np.argpartition(-scores, chosen - 1, axis=1)[:, :chosen]]
        recent = (visible - local)[:, None] + np.arange(local)
        return np.concatenate([best, recent], axis=1)

    return select


def random_routes(
    doc_length: int,
    *,
    width: int,
    rng: np.random.Generator,
    causal: bool = True,
) -> np.ndarray:
    """Arbitrary distinct route sets: ``[doc_length, width]`` int64.

    Row ``p`` draws ``width`` IDs uniformly from ``[0, p]`` (``causal``) or
    ``[0, doc_length)``; repeats are replaced by -1 so each row is a set, and the
    slots are shuffled so valid IDs and padding are interleaved.
    """
    width = _check_width(width, 1)
    limit = np.arange(1, doc_length + 1) if causal else np.full(doc_length, doc_length)
    ids = np.floor(rng.random((doc_length, width)) * limit[:, None]).astype(np.int64)
    ids = np.minimum(ids, limit[:, None] - 1)
    order = np.sort(ids, axis=1)
    dup = np.zeros_like(order, dtype=bool)
    dup[:, 1:] = order[:, 1:] == order[:, :-1]
    order[dup] = -1
    shuffle = np.argsort(rng.random((doc_length, width)), axis=1)
    return np.take_along_axis(order, shuffle, axis=1)


_HUGE = np.array(
    [2**31, 2**32 + 5, 2**40, 2**62, np.iinfo(np.int64).max, -(2**31) - 1, -(2**40),
     np.iinfo(np.int64).min],
    dtype=np.int64,
)


def adversarial_routes(
    doc_length: int,
    *,
    width: int,
    rng: np.random.Generator,
    empty_fraction: float = 0.15,
) -> np.ndarray:
    """Hostile route sets: ``[doc_length, width]`` int64.

    Starts from non-causal random IDs and plants, in random slots: duplicates of
    the row's valid IDs, -1, IDs just past the document (``doc_length + j``),
    huge positive and negative int64 values; about ``empty_fraction`` of rows
    (and always the first) are made empty with a mix of those padding values.
    """
    width = _check_width(width, 4)
    routes = random_routes(doc_length, width=width, rng=rng, causal=False)
    kind = rng.integers(0, 6, size=routes.shape)
    src = rng.integers(0, width, size=routes.shape)
    duplicate = np.take_along_axis(routes, src, axis=1)
    routes = np.where((kind == 1) & (duplicate >= 0), duplicate, routes)
    routes = np.where(kind == 2, -1, routes)
    routes = np.where(kind == 3, doc_length + rng.integers(0, 3, size=routes.shape), routes)
    routes = np.where(kind == 4, rng.choice(_HUGE, size=routes.shape), routes)
    empty = rng.random(doc_length) < empty_fraction
    empty[0] = True
    padding = np.stack([np.full(width, -1), doc_length + np.arange(width), rng.choice(_HUGE, width)])
    routes[empty] = padding[rng.integers(0, 3, size=(int(empty.sum()), width)), np.arange(width)]
    return routes


def family(
    name: str,
    *,
    width: int,
    top_k: int | None = None,
    overlap: float | None = None,
    rng: np.random.Generator,
) -> Callable[[int], np.ndarray]:
    """A generator ``doc_length -> [doc_length, width]`` for one route family.

    For ``"qsa"``, ``top_k`` defaults to the largest that fits ``width`` and
    ``overlap`` is :func:`qsa_format_routes`'s adjacent-row Jaccard target (other
    families reject it).
    """
    if overlap is not None and name != "qsa":
        raise ValueError(f"overlap applies to the 'qsa' route family only, not {name!r}")
    if name == "qsa":
        k = (width - 4) // 4 if top_k is None else top_k
        return lambda n: qsa_format_routes(n, top_k=k, width=width, overlap=overlap, rng=rng)
    if name == "random":
        return lambda n: random_routes(n, width=width, rng=rng)
    if name == "adversarial":
        return lambda n: adversarial_routes(n, width=width, rng=rng)
    raise ValueError(f"unknown route family {name!r}; expected one of {FAMILIES}")
