"""Route generators for one document, in numpy.

Every generator returns document-local routes ``[L, width]`` (int64) for a
document of ``L`` tokens: a valid ID is in ``[0, L)``; anything else (negative,
``>= L``, huge) is padding. :mod:`qsa_common.layouts` places documents into
padded, packed and context-parallel problems. numpy drives all randomness, so
``qsa_torch`` and ``qsa_jax`` see identical routes for the same seed.

Families:

* ``"qsa"``: the Qwen3.8-Flash-Next route format (CONTRACT.md): the top_k
  complete four-token blocks a query can causally see, chosen by a score that
  drifts slowly along the sequence (so neighbouring queries share most of their
  blocks), then the query's causal tail, then -1.
* ``"random"``: arbitrary distinct causal IDs per row, in shuffled slots.
* ``"adversarial"``: random IDs (not causal) plus duplicates, -1, out-of-range,
  huge positive and negative int64 values and empty rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = [
    "FAMILIES",
    "qsa_width",
    "qsa_format_routes",
    "random_routes",
    "adversarial_routes",
    "family",
    "neighbour_jaccard",
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
    rng: np.random.Generator,
) -> np.ndarray:
    """QSA-format routes for one document: ``[doc_length, width]`` int64.

    Token ``p`` sees complete blocks ``0 .. (p+1)//4 - 1``. It keeps all of them
    when there are at most ``top_k`` (the identity region), otherwise the
    ``top_k`` with the highest score ``u[b] + drift(p)[b]`` where ``u`` is a
    per-block base score and ``drift`` interpolates between random anchors every
    ``_DRIFT_PERIOD`` tokens; the last ``local_blocks`` visible blocks are always
    kept. Blocks are written in ascending order as four consecutive IDs, then the
    causal tail ``4*((p+1)//4) .. p`` padded with -1, then -1 groups.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be positive, got {top_k}")
    width = _check_width(qsa_width(top_k) if width is None else width, qsa_width(top_k))
    routes = np.full((doc_length, width), -1, dtype=np.int64)
    n_blocks = doc_length // 4
    base = rng.standard_normal(n_blocks).astype(np.float32)
    anchor_seed = int(rng.integers(0, 2**62))

    def anchor(a: int) -> np.ndarray:
        return np.random.default_rng([anchor_seed, a]).standard_normal(n_blocks).astype(
            np.float32
        )

    positions = np.arange(doc_length)
    visible = (positions + 1) // 4
    tail_len = positions + 1 - 4 * visible
    # identity region: every visible block is selected
    ident = visible <= top_k
    slots = np.arange(width)
    block_of_slot = slots // 4
    in_blocks = block_of_slot[None, :] < visible[:, None]
    ident_rows = np.where(ident[:, None] & in_blocks, slots[None, :], -1)
    routes[ident] = ident_rows[ident]
    # selection region, chunked over rows
    anchors: dict[int, np.ndarray] = {}
    rows = np.nonzero(~ident)[0]
    local = min(local_blocks, top_k // 2)
    for start in range(0, rows.size, _ROWS_PER_CHUNK):
        chunk = rows[start : start + _ROWS_PER_CHUNK]
        vis = visible[chunk][:, None]
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
        top.sort(axis=1)
        routes[chunk, : 4 * top_k] = (4 * top[:, :, None] + np.arange(4)).reshape(len(chunk), -1)
        for a in [a for a in anchors if a < a_idx.min()]:
            del anchors[a]
    # causal tail group right after the selected blocks
    tail_group = np.minimum(visible, top_k)
    for j in range(3):
        has = tail_len > j
        routes[positions[has], 4 * tail_group[has] + j] = 4 * visible[has] + j
    return routes


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
    rng: np.random.Generator,
) -> Callable[[int], np.ndarray]:
    """A generator ``doc_length -> [doc_length, width]`` for one route family.

    For ``"qsa"``, ``top_k`` defaults to the largest that fits ``width``.
    """
    if name == "qsa":
        k = (width - 4) // 4 if top_k is None else top_k
        return lambda n: qsa_format_routes(n, top_k=k, width=width, rng=rng)
    if name == "random":
        return lambda n: random_routes(n, width=width, rng=rng)
    if name == "adversarial":
        return lambda n: adversarial_routes(n, width=width, rng=rng)
    raise ValueError(f"unknown route family {name!r}; expected one of {FAMILIES}")


def neighbour_jaccard(routes: np.ndarray, kv_length: int) -> np.ndarray:
    """Jaccard similarity of the route sets of consecutive rows: ``[S-1]``.

    ``routes`` is ``[S, K]``; invalid IDs are ignored. Rows where both sets are
    empty count as 1.
    """
    member = np.zeros((routes.shape[0], kv_length + 1), dtype=bool)
    ids = np.where((routes >= 0) & (routes < kv_length), routes, kv_length)
    np.put_along_axis(member, ids, True, axis=1)
    member = member[:, :kv_length]
    inter = (member[1:] & member[:-1]).sum(1)
    union = (member[1:] | member[:-1]).sum(1)
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)
