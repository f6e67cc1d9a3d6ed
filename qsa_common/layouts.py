"""Training layouts, in numpy: every one reduces to routes ``[B, S_q, K]``.

* :func:`padded_batch`: B documents right-padded to ``seq_len``; padding query
  rows have all routes -1.
* :func:`packed_rows`: documents concatenated in one row (THD, B = 1); routes
  are absolute positions in the row and never cross a document boundary.
* :func:`context_parallel_shard`: rank ``r`` of ``world_size`` keeps a
  contiguous slice of the query rows, with routes still in global K/V
  coordinates (S_kv = the global length).

:func:`make_problem` builds any of them from a route family and a seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .generators import FAMILIES, family, qsa_width

__all__ = [
    "LAYOUTS",
    "RouteProblem",
    "padded_batch",
    "packed_rows",
    "context_parallel_shard",
    "make_problem",
]

LAYOUTS = ("padded", "packed", "cp")

# Doc-local padding IDs at or past the document end are moved past the row end
# (so they stay out of range); values this large are already out of any range.
_FAR = 2**40

DocRoutes = Callable[[int], np.ndarray]


@dataclass(frozen=True)
class RouteProblem:
    """Routes of one layout and what is needed to interpret them.

    ``routes``: ``[B, S_q, K]`` int64, global K/V coordinates of each row.
    ``kv_length``: S_kv. ``query_offset``: global position of local query row 0
    (non-zero only for a context-parallel shard). ``doc_starts`` / ``doc_lengths``:
    per batch row, the documents it holds (padding rows belong to none).
    """

    routes: np.ndarray
    kv_length: int
    layout: str
    query_offset: int = 0
    doc_starts: tuple[tuple[int, ...], ...] = field(default=())
    doc_lengths: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def query_length(self) -> int:
        return int(self.routes.shape[1])

    def segment_ids(self) -> np.ndarray:
        """``[B, S_kv]`` int32 document index of every K/V row, -1 for padding."""
        seg = np.full((self.routes.shape[0], self.kv_length), -1, dtype=np.int32)
        for b, (starts, lengths) in enumerate(zip(self.doc_starts, self.doc_lengths)):
            for d, (s, n) in enumerate(zip(starts, lengths)):
                seg[b, s : s + n] = d
        return seg


def _place(local: np.ndarray, start: int, doc_length: int, row_length: int) -> np.ndarray:
    """Shift doc-local routes to row coordinates; keep padding out of range."""
    valid = (local >= 0) & (local < doc_length)
    past_end = (local >= doc_length) & (local < _FAR)
    placed = np.where(valid, local + start, local)
    return np.where(past_end, local - doc_length + row_length, placed)


def padded_batch(lengths: Sequence[int], seq_len: int, doc_routes: DocRoutes) -> RouteProblem:
    """B right-padded sequences of the given lengths in rows of ``seq_len``."""
    lengths = [int(n) for n in lengths]
    if not lengths or any(n < 1 or n > seq_len for n in lengths):
        raise ValueError(f"lengths must be in [1, {seq_len}], got {lengths}")
    per_doc = [doc_routes(n) for n in lengths]
    width = per_doc[0].shape[1]
    routes = np.full((len(lengths), seq_len, width), -1, dtype=np.int64)
    for b, (n, local) in enumerate(zip(lengths, per_doc)):
        routes[b, :n] = _place(local, 0, n, seq_len)
    return RouteProblem(
        routes, seq_len, "padded",
        doc_starts=tuple((0,) for _ in lengths), doc_lengths=tuple((n,) for n in lengths),
    )


def packed_rows(doc_lengths: Sequence[int], doc_routes: DocRoutes) -> RouteProblem:
    """Documents of ``doc_lengths`` packed back to back in one row (B = 1)."""
    doc_lengths = [int(n) for n in doc_lengths]
    if not doc_lengths or any(n < 1 for n in doc_lengths):
        raise ValueError(f"doc_lengths must be positive, got {doc_lengths}")
    total = sum(doc_lengths)
    starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(int)
    parts = [_place(doc_routes(n), int(s), n, total) for s, n in zip(starts, doc_lengths)]
    routes = np.concatenate(parts, axis=0)[None]
    return RouteProblem(
        routes, total, "packed",
        doc_starts=(tuple(int(s) for s in starts),), doc_lengths=(tuple(doc_lengths),),
    )


def context_parallel_shard(problem: RouteProblem, world_size: int, rank: int) -> RouteProblem:
    """Rank ``rank``'s contiguous slice of the query rows; K/V stay global."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    rows = problem.query_length
    if rows % world_size:
        raise ValueError(f"query length {rows} is not divisible by world_size {world_size}")
    local = rows // world_size
    return RouteProblem(
        problem.routes[:, rank * local : (rank + 1) * local],
        problem.kv_length,
        "cp",
        query_offset=problem.query_offset + rank * local,
        doc_starts=problem.doc_starts,
        doc_lengths=problem.doc_lengths,
    )


def make_problem(
    layout: str,
    route_family: str,
    *,
    seed: int,
    seq_len: int,
    width: int | None = None,
    top_k: int | None = None,
    batch: int = 2,
    world_size: int = 2,
    rank: int = 0,
    overlap: float | None = None,
) -> RouteProblem:
    """Build one problem of ``layout`` with routes of ``route_family``.

    ``seq_len`` is the row length (the global length for ``"cp"``). Document
    lengths are drawn from ``seed``: padded rows get lengths in
    ``[seq_len/2, seq_len]`` (the first row full), packed rows 1-4 documents
    summing to ``seq_len``, and ``"cp"`` shards a packed problem. ``width``
    defaults to the QSA width of ``top_k`` (default ``top_k`` 512). ``overlap``
    (``"qsa"`` only): the target adjacent-row Jaccard of
    :func:`qsa_common.generators.qsa_format_routes`; None keeps its default routes.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if route_family not in FAMILIES:
        raise ValueError(f"unknown route family {route_family!r}; expected one of {FAMILIES}")
    rng = np.random.default_rng(seed)
    if width is None:
        width = qsa_width(512 if top_k is None else top_k)
    doc_routes = family(route_family, width=width, top_k=top_k, overlap=overlap, rng=rng)
    if layout == "padded":
        lengths = [seq_len] + [int(rng.integers(seq_len // 2, seq_len + 1)) for _ in range(batch - 1)]
        return padded_batch(lengths, seq_len, doc_routes)
    n_docs = int(rng.integers(1, 5)) if seq_len >= 8 else 1
    cuts = np.sort(rng.choice(np.arange(1, seq_len), size=n_docs - 1, replace=False))
    doc_lengths = np.diff(np.concatenate([[0], cuts, [seq_len]])).tolist()
    packed = packed_rows(doc_lengths, doc_routes)
    if layout == "packed":
        return packed
    return context_parallel_shard(packed, world_size, rank)
