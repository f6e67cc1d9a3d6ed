"""The QSA route indexer in PyTorch: indexer queries and keys -> QSA-format routes.

For a query token at position ``p`` of its document (``p = t - start``), the
visible complete four-token blocks are ``0 .. (p+1)//4 - 1``. Block ``b`` gets
one compressed key, the mean of its four indexer keys, and the score

    score[t, b] = scale * sum_h relu(index_query[t, h] . block_key[b])

computed in float32 (float64 for float64 input). The ``top_k`` highest-scoring
visible blocks are kept; equal scores prefer the smaller block id, so the
selection is a deterministic function of the scores. The routes follow
docs/contract.md's QSA format: the kept blocks in ascending order, four IDs each,
then the causal tail ``start + 4*((p+1)//4) .. t`` padded with -1, then -1
groups. A token that sees at most ``top_k`` blocks keeps them all.

Layouts: dense right-padded rows (``lengths``; padding rows are all -1) and
packed rows (``segment_ids``: each maximal run of equal non-negative ids is a
document whose blocks restart at its first token; negative ids are padding).
Routes are absolute row positions, never crossing a document.

Work is chunked over query rows: memory is O(B * chunk * H_idx * N) with N the
number of candidate block starts (S/4 without segments, S with them), never
O(S^2). ``qsa_jax.indexer.qsa_indexer_routes`` implements the same algorithm;
see its module docstring for the cross-framework guarantee.
"""

from __future__ import annotations

import numbers

import torch

from qsa_common.contract import check_chunk_rows, resolve_scale
from qsa_common.generators import qsa_width

__all__ = ["qsa_indexer_routes", "block_keys", "document_starts"]

# Elements of the per-chunk score tensor [B, chunk, H_idx, N]: 16 M fp32 = 64 MB.
_CHUNK_ELEMENTS = 1 << 24
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(index_query, index_key, top_k, lengths, segment_ids):
    for name, t, rank, form in (
        ("index_query", index_query, 4, "[B, S, H_idx, D_idx]"),
        ("index_key", index_key, 3, "[B, S, D_idx]"),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
        if t.dim() != rank or 0 in t.shape:
            raise ValueError(f"{name} must be a non-empty {form} tensor, got shape {tuple(t.shape)}")
    b, s, _, d = index_query.shape
    if tuple(index_key.shape) != (b, s, d):
        raise ValueError(
            f"index_key must be [B, S, D_idx] = {[b, s, d]}, got {list(index_key.shape)}"
        )
    if index_key.device != index_query.device:
        raise ValueError(f"index_key is on {index_key.device} but index_query is on {index_query.device}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if lengths is not None and segment_ids is not None:
        raise ValueError("pass lengths (padded layout) or segment_ids (packed layout), not both")
    for name, t, shape in (("lengths", lengths, (b,)), ("segment_ids", segment_ids, (b, s))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32/int64 tensor, got {getattr(t, 'dtype', type(t))}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
        if t.device != index_query.device:
            raise ValueError(f"{name} is on {t.device} but index_query is on {index_query.device}")


def document_starts(
    batch: int,
    seq_len: int,
    *,
    lengths: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start [B,S] int64, valid [B,S] bool)``: each row's document start and
    whether it is a real token (not padding)."""
    pos = torch.arange(seq_len, device=device).expand(batch, seq_len)
    if segment_ids is None:
        valid = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
        if lengths is not None:
            valid = pos < lengths.to(device)[:, None]
        return torch.zeros_like(pos), valid
    seg = segment_ids.to(device)
    new_doc = torch.ones_like(seg, dtype=torch.bool)
    new_doc[:, 1:] = seg[:, 1:] != seg[:, :-1]
    start = torch.cummax(torch.where(new_doc, pos, torch.zeros_like(pos)), dim=1).values
    return start, seg >= 0


def block_keys(index_key: torch.Tensor, step: int) -> torch.Tensor:
    """Mean of four consecutive keys starting at every ``step``-th position.

    ``index_key`` [B,S,D] -> [B, N, D] in the score dtype, N = len(range(0, S-3, step)).
    The sum is written as ``((k0 + k1) + (k2 + k3)) * 0.25`` so that both
    frameworks round identically.
    """
    k = index_key.to(torch.promote_types(index_key.dtype, torch.float32))
    n = max(0, k.shape[1] - 3)
    pooled = ((k[:, 0:n] + k[:, 1 : n + 1]) + (k[:, 2 : n + 2] + k[:, 3 : n + 3])) * 0.25
    return pooled[:, ::step]


def _chunk_routes(q, kbar, cand, pos, start, valid, top_k, scale, aligned):
    """Routes [B,c,4*top_k+4] for one chunk of rows (all index tensors int64)."""
    bsz, c = pos.shape
    width = qsa_width(top_k)
    local = pos - start
    n_visible = torch.where(valid, (local + 1) // 4, torch.zeros_like(local))
    n_sel = n_visible.clamp(max=top_k)
    if cand.numel():
        scores = torch.einsum("bchd,bnd->bchn", q, kbar).clamp_min(0).sum(2) * scale
        scores = torch.where(scores.isnan(), torch.zeros_like(scores), scores)
        # candidate j is block (j - start) / 4 of the row's document: visible
        # when that is a whole number in [0, n_visible) (n_visible is 0 on padding)
        offset = cand[None, None, :] - start[:, :, None]
        visible = (offset >= 0) & (offset < 4 * n_visible[:, :, None])
        if not aligned:
            visible = visible & (offset % 4 == 0)
        keys = torch.where(visible, scores, torch.full_like(scores, -1.0))
        order = torch.sort(keys, dim=-1, descending=True, stable=True).indices[..., :top_k]
        chosen = cand[order]  # [B,c,min(top_k,N)]
        if chosen.shape[-1] < top_k:
            pad = chosen.new_zeros(bsz, c, top_k - chosen.shape[-1])
            chosen = torch.cat([chosen, pad], dim=-1)
    else:
        chosen = torch.zeros(bsz, c, top_k, dtype=torch.int64, device=pos.device)
    slot = torch.arange(top_k, device=pos.device)
    # unselected slots sort last; any value past the row length will do
    chosen = torch.where(slot < n_sel[..., None], chosen, torch.full_like(chosen, 1 << 40))
    chosen = torch.sort(chosen, dim=-1).values
    group = torch.arange(top_k + 1, device=pos.device)[:, None]  # [G,1]
    lane = torch.arange(4, device=pos.device)  # [4]
    firsts = torch.cat([chosen, chosen.new_zeros(bsz, c, 1)], dim=-1)[..., None]  # [B,c,G,1]
    tail_start = (start + 4 * n_visible)[..., None, None]
    tail_len = torch.where(valid, local + 1 - 4 * n_visible, torch.zeros_like(local))[..., None, None]
    ns = n_sel[..., None, None]
    routes = torch.where(
        group < ns,
        firsts + lane,
        torch.where((group == ns) & (lane < tail_len), tail_start + lane, torch.full_like(firsts, -1)),
    )
    return routes.reshape(bsz, c, width).to(torch.int32)


@torch.no_grad()
def qsa_indexer_routes(
    index_query: torch.Tensor,
    index_key: torch.Tensor,
    top_k: int,
    *,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Select QSA routes from indexer queries and keys (no gradient).

    Args:
        index_query: ``[B, S, H_idx, D_idx]`` float indexer queries.
        index_key: ``[B, S, D_idx]`` float indexer keys (one per token, shared by
            the indexer heads), same device.
        top_k: blocks kept per token (the width is ``4 * top_k + 4``).
        scale: finite positive score multiplier, default ``1/sqrt(D_idx)``.
        lengths: ``[B]`` int tensor, dense right-padded layout: rows at or past
            ``lengths[b]`` are padding.
        segment_ids: ``[B, S]`` int tensor, packed layout (see module docstring).
            Without ``lengths`` and ``segment_ids`` every row is one full document.
        chunk_rows: query rows per chunk (default: ~64 MB of scores per chunk).

    Returns:
        int32 ``[B, S, 4 * top_k + 4]`` routes in absolute row positions.

    Raises:
        TypeError: non-tensor or non-floating inputs, non-integer lengths/segment_ids,
            a ``chunk_rows`` that is not an int.
        ValueError: wrong ranks or shapes, devices differ, bad ``top_k`` or
            ``scale``, ``chunk_rows`` < 1, or both ``lengths`` and ``segment_ids``.
    """
    _check(index_query, index_key, top_k, lengths, segment_ids)
    bsz, seq, heads, dim = index_query.shape
    try:
        scale = resolve_scale(scale, dim)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("softmax_scale", "scale")) from None
    if chunk_rows is not None:
        chunk_rows = check_chunk_rows(chunk_rows)
    device = index_query.device
    start, valid = document_starts(bsz, seq, lengths=lengths, segment_ids=segment_ids, device=device)
    step = 1 if segment_ids is not None else 4
    kbar = block_keys(index_key, step)
    cand = torch.arange(0, max(0, seq - 3), step, device=device)
    q = index_query.to(kbar.dtype)
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // max(1, bsz * heads * cand.numel()))
    pos = torch.arange(seq, device=device).expand(bsz, seq)
    parts = []
    for lo in range(0, seq, chunk_rows):
        rows = slice(lo, lo + chunk_rows)
        parts.append(
            _chunk_routes(q[:, rows], kbar, cand, pos[:, rows], start[:, rows], valid[:, rows],
                          int(top_k), scale, aligned=segment_ids is None)
        )
    return torch.cat(parts, dim=1)
