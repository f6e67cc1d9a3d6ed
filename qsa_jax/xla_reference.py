"""The gather-based JAX reference of route-sparse GQA (``implementation="xla"``).

Chunks of query rows run through ``lax.map``; each chunk gathers its routed
K/V rows, applies an fp32 masked softmax and contracts with the gathered
values. Each chunk is wrapped in ``jax.checkpoint`` so the backward recomputes
it instead of storing gathers: memory is O(B * chunk * K * Hkv * D) plus the
inputs, never O(S^2). ``jax.grad`` gives dq, dk and dv.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qsa_common.contract import check_chunk_rows
from qsa_common.errors import BackendDeclined, DeterminismUnavailable

from .routes import (
    DETERMINISTIC_XLA_FLAGS,
    normalize_routes,
    on_gpu,
    prepare_routes,
    validate_inputs,
    xla_gpu_deterministic,
)

__all__ = ["reference_sparse_gqa_attention", "supports"]


def supports(query, key, value, selected_token_ids, *, softmax_scale=None,
             deterministic: bool = False) -> BackendDeclined | None:
    """Why the reference cannot take these (valid) inputs, or None: it takes every
    input of the contract; ``deterministic=True`` on GPUs needs XLA's deterministic
    scatter-add (:data:`~qsa_jax.routes.DETERMINISTIC_XLA_FLAGS` in ``XLA_FLAGS``), as
    its backward scatter-adds the gather's gradient there. Deterministic on CPU."""
    del key, value, selected_token_ids, softmax_scale
    if deterministic and on_gpu(query) and not xla_gpu_deterministic():
        return DeterminismUnavailable(
            "deterministic=True: the reference's backward scatter-adds on the GPU, which XLA makes deterministic "
            f"only with {' or '.join(DETERMINISTIC_XLA_FLAGS)} in XLA_FLAGS")
    return None

_CHUNK_ELEMENTS = 1 << 25


def _attend_chunk(query, key, value, routes, scale):
    """query [B,c,Hq,D], key/value [B,S_kv,Hkv,D] (all in the compute dtype), canonical
    routes [B,c,K] -> [B,c,Hq,D]."""
    bsz, rows, hq, d = query.shape
    hkv = key.shape[2]
    valid = routes >= 0
    idx = jnp.maximum(routes, 0)
    gather = jax.vmap(lambda kv, i: kv[i])
    # padding slots read row 0: zero them so a non-finite row 0 cannot leak in (0 * NaN)
    keep = valid[..., None, None]
    k = jnp.where(keep, gather(key, idx), 0)  # [B,c,K,Hkv,D]
    v = jnp.where(keep, gather(value, idx), 0)
    q = query.reshape(bsz, rows, hkv, hq // hkv, d)
    scores = jnp.einsum("bchgd,bckhd->bchgk", q, k) * scale
    mask = valid[:, :, None, None, :]
    row_max = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = jnp.exp(jnp.where(mask, scores - row_max, -jnp.inf))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bchgk,bckhd->bchgd", probs, v)
    return out.reshape(bsz, rows, hq, d)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_rows"))
def _reference(query, key, value, routes, *, scale: float, chunk_rows: int):
    bsz, s_q, hq, d = query.shape
    routes = normalize_routes(routes, key.shape[1])
    # Gather from fp32 copies: the gather's transpose then sums the ~K
    # contributions per key row in fp32 (summing them in bf16 loses ~3e-2).
    out_dtype = query.dtype
    compute = jnp.promote_types(query.dtype, jnp.float32)
    query, key, value = query.astype(compute), key.astype(compute), value.astype(compute)
    return _chunked(query, key, value, routes, scale, chunk_rows).astype(out_dtype)


def _chunked(query, key, value, routes, scale, chunk_rows):
    bsz, s_q, hq, d = query.shape
    if chunk_rows >= s_q:
        return _attend_chunk(query, key, value, routes, scale)
    n_chunks = -(-s_q // chunk_rows)
    pad = n_chunks * chunk_rows - s_q
    q = jnp.pad(query, ((0, 0), (0, pad), (0, 0), (0, 0)))
    r = jnp.pad(routes, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
    q = q.reshape(bsz, n_chunks, chunk_rows, hq, d).swapaxes(0, 1)
    r = r.reshape(bsz, n_chunks, chunk_rows, -1).swapaxes(0, 1)
    body = jax.checkpoint(lambda qr: _attend_chunk(qr[0], key, value, qr[1], scale))
    out = jax.lax.map(body, (q, r))  # [n_chunks, B, c, Hq, D]
    return out.swapaxes(0, 1).reshape(bsz, n_chunks * chunk_rows, hq, d)[:, :s_q]


def reference_sparse_gqa_attention(
    query,
    key,
    value,
    selected_token_ids,
    softmax_scale: float | None = None,
    *,
    chunk_rows: int | None = None,
):
    """Route-sparse GQA by gathering each row's routed keys and values.

    Args:
        query: ``[B, S_q, Hq, D]`` float array (f16/bf16/f32/f64).
        key: ``[B, S_kv, Hkv, D]``, same dtype; Hq % Hkv == 0.
        value: same shape and dtype as ``key``.
        selected_token_ids: ``[B, S_q, K]`` signed int32/int64 IDs into
            ``[0, S_kv)``; anything else is padding, duplicates count once.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        chunk_rows: query rows per chunk (default: ~128 MB of gathers).

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype; rows without routes are exactly 0
        and add nothing to any gradient. Accumulation is fp32 (f64 for f64).
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    routes = prepare_routes(selected_token_ids)
    dims = checked.dims
    if chunk_rows is None:
        per_row = dims.batch * dims.routes_per_query * dims.kv_heads * dims.head_dim
        chunk_rows = max(1, _CHUNK_ELEMENTS // per_row)
    chunk_rows = check_chunk_rows(chunk_rows)
    return _reference(query, key, value, routes, scale=checked.scale, chunk_rows=chunk_rows)
