"""The gather-based torch reference of route-sparse GQA (any device, CPU included).

For each chunk of query rows it gathers the routed K/V rows, computes masked
scores and an fp32 softmax, and contracts with the gathered values. Memory is
O(B * chunk * K * Hkv * D) per chunk, never O(S^2); under autograd every chunk
is recomputed in the backward (activation checkpointing), so what is kept is
the inputs and the canonical routes. Gradients come from torch autograd.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from qsa_common.contract import check_chunk_rows

from .routes import normalize_routes, validate_inputs

__all__ = ["reference_sparse_gqa_attention", "supports"]


def supports(query, key, value, selected_token_ids, *, softmax_scale=None, deterministic=False):
    """Why the reference cannot take these (valid) inputs: never (any device, every
    floating dtype of the contract, a deterministic backward); returns None."""
    del query, key, value, selected_token_ids, softmax_scale, deterministic

# Gathered elements per chunk (K * Hkv * D * rows * batch); ~64 M fp32 = 256 MB
# for each of K and V.
_CHUNK_ELEMENTS = 1 << 26


def _attend_chunk(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, routes: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [B,c,Hq,D], key/value [B,S_kv,Hkv,D] (all in the compute dtype), canonical
    routes [B,c,K] -> [B,c,Hq,D]."""
    bsz, rows, hq, d = query.shape
    hkv = key.shape[2]
    valid = routes >= 0
    idx = routes.clamp_min(0).long()
    batch_idx = torch.arange(bsz, device=query.device)[:, None, None]
    # padding slots read row 0: zero them so a non-finite row 0 cannot leak in (0 * NaN)
    pad = ~valid[..., None, None]
    k = key[batch_idx, idx].masked_fill(pad, 0)  # [B,c,K,Hkv,D]
    v = value[batch_idx, idx].masked_fill(pad, 0)
    q = query.reshape(bsz, rows, hkv, hq // hkv, d)
    scores = torch.einsum("bchgd,bckhd->bchgk", q, k) * scale
    mask = valid[:, :, None, None, :]
    row_max = scores.masked_fill(~mask, float("-inf")).amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp((scores - row_max.detach()).masked_fill(~mask, float("-inf")))
    denom = weights.sum(-1, keepdim=True)
    probs = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("bchgk,bckhd->bchgd", probs, v)
    return out.reshape(bsz, rows, hq, d)


def reference_sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Route-sparse GQA by gathering each row's routed keys and values.

    Args:
        query: ``[B, S_q, Hq, D]`` float tensor (fp16/bf16/fp32/fp64).
        key: ``[B, S_kv, Hkv, D]``, same dtype and device; Hq % Hkv == 0.
        value: same shape, dtype and device as ``key``.
        selected_token_ids: ``[B, S_q, K]`` signed int32/int64 route IDs into
            ``[0, S_kv)``; anything else is padding, duplicates count once.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        chunk_rows: query rows per chunk (default: sized to ~256 MB of gathers).

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype; rows without routes are exactly 0
        and contribute nothing to any gradient. Accumulation is fp32 (fp64 for
        fp64 input).
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    dims = checked.dims
    routes = normalize_routes(selected_token_ids, dims.kv_length)
    if chunk_rows is None:
        per_row = dims.batch * dims.routes_per_query * dims.kv_heads * dims.head_dim
        chunk_rows = max(1, _CHUNK_ELEMENTS // per_row)
    chunk_rows = check_chunk_rows(chunk_rows)
    # Gather from fp32 copies: the gather's backward then sums the ~K
    # contributions per key row in fp32 (summing them in bf16 loses ~3e-2).
    compute = torch.promote_types(query.dtype, torch.float32)
    out_dtype = query.dtype
    query, key, value = query.to(compute), key.to(compute), value.to(compute)
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value)
    )
    outputs = []
    for start in range(0, dims.query_length, chunk_rows):
        rows = slice(start, start + chunk_rows)
        args = (query[:, rows], key, value, routes[:, rows], checked.scale)
        if needs_grad and chunk_rows < dims.query_length:
            outputs.append(checkpoint(_attend_chunk, *args, use_reentrant=False))
        else:
            outputs.append(_attend_chunk(*args))
    out = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    return out.to(out_dtype)
