"""The QSA route indexer in JAX: indexer queries and keys -> QSA-format routes.

Same algorithm as ``qsa_torch.indexer.qsa_indexer_routes``. For a query at
position ``p`` of its document (``p = t - start``) the visible complete blocks
are ``0 .. (p+1)//4 - 1``; block ``b`` has one compressed key, the mean of its
four indexer keys (``((k0 + k1) + (k2 + k3)) * 0.25``), and the score

    score[t, b] = scale * sum_h relu(index_query[t, h] . block_key[b])

in float32 (float64 for float64 input under x64). The ``top_k`` best visible
blocks are kept, equal scores preferring the smaller block id; routes are the
kept blocks ascending (four IDs each), then the causal tail
``start + 4*((p+1)//4) .. t`` padded with -1, then -1 groups (docs/contract.md's QSA
format). A token seeing at most ``top_k`` blocks keeps them all. Padding rows
(``lengths``, or negative ``segment_ids``) are all -1; in packed rows each
maximal run of equal ids is a document and blocks restart at its first token.
Chunked over query rows under ``lax.map``: memory O(B * chunk * H_idx * N),
N = S/4 candidate blocks (S with ``segment_ids``), never O(S^2).

Cross-framework guarantee: the selection is a deterministic function of the
float32 scores (lexicographic order on (score descending, block id
ascending); +0/-0 compare equal and NaN scores count as 0). Given bit-identical
scores, torch and JAX return identical routes. Scores are bit-identical
whenever every product and partial sum in them is exact in float32 (for
example inputs on a coarse dyadic grid, as the tests use); for arbitrary
float inputs the two einsums may round differently in the last bit, and the
routes can then differ only between blocks whose scores are that close at the
top-k boundary.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from qsa_common.contract import check_chunk_rows, resolve_scale
from qsa_common.generators import qsa_width

__all__ = ["qsa_indexer_routes", "block_keys", "document_starts", "select_routes"]

_CHUNK_ELEMENTS = 1 << 24


def _check(index_query, index_key, top_k, lengths, segment_ids):
    for name, t, rank, form in (
        ("index_query", index_query, 4, "[B, S, H_idx, D_idx]"),
        ("index_key", index_key, 3, "[B, S, D_idx]"),
    ):
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(t).__name__}")
        if not jnp.issubdtype(t.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got {t.dtype}")
        if len(t.shape) != rank or 0 in t.shape:
            raise ValueError(f"{name} must be a non-empty {form} array, got shape {tuple(t.shape)}")
    b, s, _, d = index_query.shape
    if tuple(index_key.shape) != (b, s, d):
        raise ValueError(
            f"index_key must be [B, S, D_idx] = {[b, s, d]}, got {list(index_key.shape)}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if lengths is not None and segment_ids is not None:
        raise ValueError("pass lengths (padded layout) or segment_ids (packed layout), not both")
    for name, t, shape in (("lengths", lengths, (b,)), ("segment_ids", segment_ids, (b, s))):
        if t is None:
            continue
        dtype = getattr(t, "dtype", None)
        if dtype is None or np.dtype(dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise TypeError(f"{name} must be an int32/int64 array, got {dtype or type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def document_starts(batch: int, seq_len: int, *, lengths=None, segment_ids=None):
    """``(start [B,S] int32, valid [B,S] bool)``: each row's document start and
    whether it is a real token (not padding). Traceable."""
    pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    if segment_ids is None:
        valid = jnp.ones((batch, seq_len), dtype=bool)
        if lengths is not None:
            valid = pos < jnp.asarray(lengths)[:, None]
        return jnp.zeros_like(pos), valid
    seg = jnp.asarray(segment_ids)
    new_doc = jnp.concatenate(
        [jnp.ones((batch, 1), dtype=bool), seg[:, 1:] != seg[:, :-1]], axis=1
    )
    start = jax.lax.cummax(jnp.where(new_doc, pos, 0), axis=1)
    return start, seg >= 0


def block_keys(index_key, step: int):
    """Mean of four consecutive keys starting at every ``step``-th position:
    ``[B,S,D]`` -> ``[B, N, D]`` (N = len(range(0, S-3, step))), score dtype."""
    k = index_key.astype(jnp.promote_types(index_key.dtype, jnp.float32))
    n = max(0, k.shape[1] - 3)
    pooled = ((k[:, 0:n] + k[:, 1 : n + 1]) + (k[:, 2 : n + 2] + k[:, 3 : n + 3])) * 0.25
    return pooled[:, ::step]


def _chunk_routes(q, kbar, cand, pos, start, valid, *, top_k, ratio, width, score):
    """Routes ``[B, c, width]`` int32 for one chunk of query rows (see :func:`select_routes`)."""
    bsz, c = pos.shape
    local = pos - start
    n_visible = jnp.where(valid, (local + 1) // ratio, 0)
    n_sel = jnp.minimum(n_visible, top_k)
    n_cand = cand.shape[0]
    if n_cand:
        dots = jnp.einsum("bchd,bnd->bchn", q, kbar, precision=jax.lax.Precision.HIGHEST)
        scores = score(jnp.maximum(dots, 0))
        # NaN counts as 0 and -0 as +0, so equal scores tie (lax.top_k orders -0 below +0)
        scores = jnp.where(jnp.isnan(scores) | (scores == 0), 0.0, scores)
        # candidate j is block (j - start) / ratio of the row's document: visible
        # when that is a whole number in [0, n_visible) (n_visible is 0 on padding)
        offset = cand[None, None, :] - start[:, :, None]
        visible = (offset >= 0) & (offset < ratio * n_visible[:, :, None]) & (offset % ratio == 0)
        keys = jnp.where(visible, scores, -jnp.inf)
        # lax.top_k puts the lower index first among equal keys: (score desc, block asc)
        _, order = jax.lax.top_k(keys, min(top_k, n_cand))
        chosen = cand[order]
        if n_cand < top_k:
            chosen = jnp.pad(chosen, ((0, 0), (0, 0), (0, top_k - n_cand)))
    else:
        chosen = jnp.zeros((bsz, c, top_k), jnp.int32)
    slot = jnp.arange(top_k)
    # unselected slots sort last; any value past the row length will do
    chosen = jnp.sort(jnp.where(slot < n_sel[..., None], chosen, 1 << 30), axis=-1)
    group = jnp.arange(top_k + 1)[:, None]
    lane = jnp.arange(ratio)
    firsts = jnp.concatenate([chosen, jnp.zeros((bsz, c, 1), chosen.dtype)], axis=-1)[..., None]
    tail_start = (start + ratio * n_visible)[..., None, None]
    tail_len = jnp.where(valid, local + 1 - ratio * n_visible, 0)[..., None, None]
    ns = n_sel[..., None, None]
    routes = jnp.where(
        group < ns,
        firsts + lane,
        jnp.where((group == ns) & (lane < tail_len), tail_start + lane, -1),
    )
    return routes.reshape(bsz, c, (top_k + 1) * ratio)[..., :width].astype(jnp.int32)


def select_routes(
    index_query,
    block_keys,
    block_starts,
    *,
    positions,
    doc_starts,
    valid,
    top_k: int,
    ratio: int,
    width: int,
    score: Callable,
    chunk_rows: int | None = None,
):
    """The block selection shared by every QSA indexer of this package (traceable).

    Query row ``(b, i)`` sits at K/V position ``p = positions[b, i]`` of a
    document starting at ``s = doc_starts[b, i]``; it sees the
    ``v = (p - s + 1) // ratio`` complete blocks starting at ``s, s + ratio,
    ...`` (none when ``valid`` is False). Candidate ``n`` is the block starting
    at ``block_starts[n]`` with compressed key ``block_keys[:, n]``. The score of
    a candidate is ``score(relu(index_query[b, i, h] . block_keys[b, n]))`` (the
    callable reduces the head axis). The ``min(v, top_k)`` best visible blocks
    are kept (ties: the smaller block start), ``ratio`` IDs each, in ascending
    order, followed by the causal tail ``s + ratio * v .. p`` and -1 padding.

    Args:
        index_query: ``[B, S_q, H, D]`` float, in the score dtype.
        block_keys: ``[B, N, D]`` float, same dtype.
        block_starts: ``[N]`` int32 K/V position of each candidate's first token.
        positions, doc_starts: ``[B, S_q]`` int32; ``valid``: ``[B, S_q]`` bool.
        top_k: blocks kept per row; ratio: tokens per block (both static).
        width: route width (static), at most ``(top_k + 1) * ratio``.
        score: ``[B, c, H, N]`` relu'd per-head dot products -> ``[B, c, N]`` scores.
        chunk_rows: query rows per chunk (default: ~64 MB of scores per chunk).

    Returns:
        int32 ``[B, S_q, width]`` routes in K/V positions.
    """
    bsz, seq, heads, _ = index_query.shape
    n_cand = block_starts.shape[0]
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // max(1, bsz * heads * n_cand))
    body = functools.partial(_chunk_routes, top_k=top_k, ratio=ratio, width=width, score=score)
    if chunk_rows >= seq:
        return body(index_query, block_keys, block_starts, positions, doc_starts, valid)
    n_chunks = -(-seq // chunk_rows)
    pad = n_chunks * chunk_rows - seq

    def split(x, fill):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape((bsz, n_chunks, chunk_rows) + x.shape[2:]).swapaxes(0, 1)

    out = jax.lax.map(
        lambda a: body(a[0], block_keys, block_starts, a[1], a[2], a[3]),
        (split(index_query, 0), split(positions, 0), split(doc_starts, 0), split(valid, False)),
    )
    return out.swapaxes(0, 1).reshape(bsz, n_chunks * chunk_rows, width)[:, :seq]


@functools.partial(jax.jit, static_argnames=("top_k", "scale", "chunk_rows", "packed"))
def _routes(index_query, index_key, lengths, segment_ids, *, top_k, scale, chunk_rows, packed):
    bsz, seq, _, _ = index_query.shape
    start, valid = document_starts(bsz, seq, lengths=lengths, segment_ids=segment_ids)
    step = 1 if packed else 4
    kbar = block_keys(index_key, step)
    cand = jnp.arange(0, max(0, seq - 3), step, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (bsz, seq))
    return select_routes(
        index_query.astype(kbar.dtype), kbar, cand, positions=pos, doc_starts=start, valid=valid,
        top_k=top_k, ratio=4, width=qsa_width(top_k), score=lambda r: jnp.sum(r, axis=2) * scale,
        chunk_rows=chunk_rows,
    )


def qsa_indexer_routes(
    index_query,
    index_key,
    top_k: int,
    *,
    scale: float | None = None,
    lengths=None,
    segment_ids=None,
    chunk_rows: int | None = None,
):
    """Select QSA routes from indexer queries and keys (traceable; no gradient).

    Args:
        index_query: ``[B, S, H_idx, D_idx]`` float indexer queries.
        index_key: ``[B, S, D_idx]`` float indexer keys, one per token.
        top_k: blocks kept per token (the width is ``4 * top_k + 4``); static.
        scale: finite positive score multiplier, default ``1/sqrt(D_idx)``.
        lengths: ``[B]`` int array, dense right-padded layout: rows at or past
            ``lengths[b]`` are padding.
        segment_ids: ``[B, S]`` int array, packed layout (see module docstring).
            Without ``lengths`` and ``segment_ids`` every row is one full document.
        chunk_rows: query rows per chunk (default: ~64 MB of scores per chunk).

    Returns:
        int32 ``[B, S, 4 * top_k + 4]`` routes in absolute row positions, wrapped
        in ``stop_gradient``.

    Raises:
        TypeError: non-floating inputs, non-integer lengths/segment_ids, a
            ``chunk_rows`` that is not an int.
        ValueError: wrong ranks or shapes, bad ``top_k`` or ``scale``, ``chunk_rows``
            < 1, or both ``lengths`` and ``segment_ids``.
    """
    _check(index_query, index_key, top_k, lengths, segment_ids)
    bsz, seq, heads, dim = index_query.shape
    try:
        scale = resolve_scale(scale, dim)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("softmax_scale", "scale")) from None
    n_cand = len(range(0, max(0, seq - 3), 1 if segment_ids is not None else 4))
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // max(1, bsz * heads * n_cand))
    else:
        chunk_rows = check_chunk_rows(chunk_rows)
    routes = _routes(
        jax.lax.stop_gradient(index_query), jax.lax.stop_gradient(index_key), lengths, segment_ids,
        top_k=int(top_k), scale=scale, chunk_rows=int(chunk_rows), packed=segment_ids is not None,
    )
    return jax.lax.stop_gradient(routes)
