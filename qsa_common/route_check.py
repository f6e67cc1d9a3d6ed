"""A route checker for users debugging their own route builders (numpy).

:func:`check_routes` reports, for routes ``[B, S_q, K]``, the entries a route builder
most often gets wrong: IDs out of range other than -1, routes to future tokens, and
routes crossing documents. The attention functions themselves keep the contract
(CONTRACT.md): every ID outside ``[0, S_kv)`` is padding, any route set is allowed, so
they never raise for these; the checker says where routes differ from what a causal,
document-masked model usually means. ``qsa_torch.check_routes`` and
``qsa_jax.check_routes`` are thin wrappers that copy their arrays to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidDtype, InvalidInput

__all__ = ["RouteReport", "check_routes"]

# offending entries kept per kind in a report
FIRST = 5


@dataclass(frozen=True)
class RouteReport:
    """What :func:`check_routes` found.

    Counts are of route entries (slots), the ``first_*`` tuples hold the first offending
    entries in row-major order as ``(batch, row, slot, id)`` (at most :data:`FIRST`).
    ``ok`` is True when no entry is out of range, in the future or across documents;
    ``empty_rows`` (rows without any valid route, which give exact zeros) is reported but
    is not an error.
    """

    shape: tuple[int, int, int]
    kv_length: int
    query_offset: int
    causal: bool
    checked_documents: bool
    out_of_range: int
    future: int
    cross_document: int
    empty_rows: int
    first_out_of_range: tuple[tuple[int, int, int, int], ...]
    first_future: tuple[tuple[int, int, int, int], ...]
    first_cross_document: tuple[tuple[int, int, int, int], ...]

    @property
    def ok(self) -> bool:
        """No out-of-range, future or cross-document entry."""
        return not (self.out_of_range or self.future or self.cross_document)

    def __str__(self) -> str:
        b, s_q, k = self.shape
        verdict = "ok" if self.ok else "PROBLEMS"
        lines = [f"routes [B={b}, S_q={s_q}, K={k}] over S_kv={self.kv_length} keys "
                 + f"(query row 0 at position {self.query_offset}): {verdict}"]

        def kind(label: str, count: int, first, checked: bool = True) -> None:
            if not checked:
                lines.append(f"  {label}: not checked")
                return
            lines.append(f"  {label}: {count}")
            for batch, row, slot, value in first:
                lines.append(f"    batch {batch}, row {row}, slot {slot}: id {value}")

        kind("out-of-range ids (other than -1)", self.out_of_range, self.first_out_of_range)
        kind("routes to future tokens", self.future, self.first_future, self.causal)
        kind("routes crossing documents", self.cross_document, self.first_cross_document, self.checked_documents)
        lines.append(f"  rows without any valid route (exact zeros): {self.empty_rows}")
        return "\n".join(lines)


def _first(mask: np.ndarray, routes: np.ndarray) -> tuple[tuple[int, int, int, int], ...]:
    where = np.argwhere(mask)[:FIRST]
    return tuple((int(b), int(i), int(j), int(routes[b, i, j])) for b, i, j in where)


def check_routes(routes, *, causal: bool = True, documents=None, kv_length: int | None = None,
                 query_offset: int | None = None) -> RouteReport:
    """Report out-of-range IDs, routes to future tokens and routes crossing documents.

    Args:
        routes: ``[B, S_q, K]`` signed integer route IDs (a numpy array or anything
            ``np.asarray`` takes).
        causal: check that no row routes to a token after its own position.
        documents: per-token document ids, ``[B, S_kv]`` (or ``[S_kv]``, shared by every
            batch row): tokens with equal ids belong to one document (padding may use
            -1, its own "document"). A route whose key token has another id than the
            query's token crosses documents. None: not checked. (Per-token ids, not
            ``cu_seqlens``, so that right-padded batches and packed rows are said alike;
            ``qsa_common.layouts.RouteProblem.segment_ids`` gives them.)
        kv_length: S_kv; default: ``documents``' length, else S_q.
        query_offset: the position of query row 0 among the S_kv tokens (a
            context-parallel shard's start); default ``S_kv - S_q`` (the queries are the
            last S_q tokens, 0 when S_q == S_kv).

    Returns:
        A :class:`RouteReport`; ``print`` it, or read ``ok`` and the counts.

    Raises:
        InvalidDtype: routes or documents that are not signed integers; a non-bool ``causal``.
        InvalidInput: wrong ranks or sizes, a query offset that does not fit.
    """
    routes = np.asarray(routes)
    if routes.dtype.kind != "i":
        raise InvalidDtype(f"selected_token_ids must be signed integers, got {routes.dtype}")
    if routes.ndim != 3:
        raise InvalidInput(f"selected_token_ids must have rank 3 [B, S_q, K], got shape {routes.shape}")
    if not isinstance(causal, bool):
        raise InvalidDtype(f"causal must be a bool, got {causal!r}")
    batch, s_q, _ = routes.shape
    docs = None
    if documents is not None:
        docs = np.asarray(documents)
        if docs.dtype.kind != "i":
            raise InvalidDtype(f"documents must be signed integers, got {docs.dtype}")
        if docs.ndim == 1:
            docs = np.broadcast_to(docs, (batch, docs.shape[0]))
        if docs.ndim != 2 or docs.shape[0] != batch:
            raise InvalidInput(f"documents must be [B, S_kv] or [S_kv] with B = {batch}, got shape {docs.shape}")
        if kv_length is None:
            kv_length = docs.shape[1]
        elif docs.shape[1] != kv_length:
            raise InvalidInput(f"documents cover {docs.shape[1]} tokens but kv_length is {kv_length}")
    kv_length = s_q if kv_length is None else int(kv_length)
    if kv_length < 1:
        raise InvalidInput(f"kv_length must be positive, got {kv_length}")
    query_offset = kv_length - s_q if query_offset is None else int(query_offset)
    if (causal or docs is not None) and not 0 <= query_offset <= kv_length - s_q:
        raise InvalidInput(f"query rows at positions {query_offset}..{query_offset + s_q - 1} do not fit "
                           f"S_kv = {kv_length} tokens")
    valid = (routes >= 0) & (routes < kv_length)
    bad = ~valid & (routes != -1)
    positions = query_offset + np.arange(s_q)[None, :, None]
    future = valid & (routes > positions) if causal else np.zeros_like(valid)
    crossing = np.zeros_like(valid)
    if docs is not None:
        keys = np.take_along_axis(docs, np.where(valid, routes, 0).reshape(batch, -1), axis=1).reshape(routes.shape)
        own = docs[:, query_offset:query_offset + s_q][:, :, None]
        crossing = valid & (keys != own)
    return RouteReport(
        shape=tuple(int(d) for d in routes.shape), kv_length=kv_length, query_offset=query_offset,
        causal=causal, checked_documents=docs is not None,
        out_of_range=int(bad.sum()), future=int(future.sum()), cross_document=int(crossing.sum()),
        empty_rows=int((~valid.any(axis=-1)).sum()),
        first_out_of_range=_first(bad, routes), first_future=_first(future, routes),
        first_cross_document=_first(crossing, routes),
    )
