"""Context parallelism for the Qwen3.8-Flash-Next QSA layer with ``shard_map``.

The sequence is split into contiguous shards over one mesh axis (device ``i``
holds rows ``i*S_local .. (i+1)*S_local - 1``), as upstream's contiguous CP
layout. On each device:

* index queries are computed for the local rows; compressed index keys are
  computed from the local shard (``S_local % ratio == 0``, so no block
  straddles two devices) and all-gathered without gradient. A packed row's
  blocks start at document boundaries anywhere in the row, so there the raw
  index keys and ``freqs_cis`` are gathered instead and compressed globally;
* routes are selected for the local rows in global coordinates;
* Q/K/V are projected locally, K and V all-gathered with gradient (their
  transpose reduce-scatters dK/dV) by :func:`qsa_jax.context_parallel.sparse_gqa_attention_shard`.

Layer weights are replicated (``PartitionSpec()``); their gradients are summed
over the axis by the map's transpose.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from qsa_jax.context_parallel import shard_map, sparse_gqa_attention_shard
from qsa_jax.routes import prepare_routes

from .attention import QSAAttention
from .indexer import QSAIndexer, make_layout

__all__ = ["context_parallel_qsa_attention", "context_parallel_qsa_indexer"]


def _run(module, indexer, x, freqs_cis, *, mesh, axis_name, attention_mask, cu_seqlens, routes, body):
    """shard_map ``body(local_module, x, freqs_cis, layout, routes)`` over the sequence."""
    indexer._check_inputs(x, freqs_cis)
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    n = mesh.shape[axis_name]
    bsz, seq, _ = x.shape
    ratio = indexer.config.indexer_compress_ratio
    packed = cu_seqlens is not None
    if seq % n or (not packed and (seq // n) % ratio):
        raise ValueError(
            f"context parallelism needs S = {seq} divisible by the {n} devices of axis {axis_name!r}"
            + ("" if packed else f", in shards divisible by indexer_compress_ratio {ratio}")
        )
    # checked on the global arrays; each device rebuilds its rows' layout from the replicated metadata
    whole = make_layout(bsz, seq, attention_mask=attention_mask, cu_seqlens=cu_seqlens, padding_tail=True)
    meta = whole.cu_seqlens if packed else jnp.sum(whole.valid, axis=-1, dtype=jnp.int32)
    graphdef, state = nnx.split(module)
    seq_spec, rep = PartitionSpec(None, axis_name), PartitionSpec()

    def mapped(state, x, freqs_cis, meta, *routes):
        s_local = x.shape[1]
        offset = jax.lax.axis_index(axis_name) * s_local
        layout = make_layout(bsz, s_local, offset=offset, kv_length=seq, padding_tail=True,
                             **({"cu_seqlens": meta} if packed else {"lengths": meta}))
        layout = dataclasses.replace(layout, max_visible=whole.max_visible)
        return body(nnx.merge(graphdef, state), x, freqs_cis, layout, routes[0] if routes else None)

    args = (state, x, freqs_cis, meta) + (() if routes is None else (routes,))
    fn = shard_map(mapped, mesh=mesh, in_specs=(rep, seq_spec, seq_spec, rep) + (seq_spec,) * (len(args) - 4),
                   out_specs=seq_spec)
    return fn(*args)


def _key_gather(indexer, packed, axis_name):
    """Local (raw index keys, freqs_cis) -> the global compressed keys (no gradient)."""
    def gather(raw_key, freqs_cis):
        if packed:
            raw_key = jax.lax.all_gather(raw_key, axis_name, axis=1, tiled=True)
            freqs_cis = jax.lax.all_gather(freqs_cis, axis_name, axis=1, tiled=True)
            return jax.lax.stop_gradient(indexer.compress(raw_key, freqs_cis, packed=True))
        keys = jax.lax.stop_gradient(indexer.compress(raw_key, freqs_cis, packed=False))
        return jax.lax.all_gather(keys, axis_name, axis=1, tiled=True)

    return gather


def context_parallel_qsa_attention(
    layer: QSAAttention,
    x,
    *,
    freqs_cis,
    mesh: Mesh,
    axis_name: str = "cp",
    attention_mask=None,
    cu_seqlens=None,
    selected_token_ids=None,
):
    """The layer with the sequence split over mesh axis ``axis_name``.

    Args:
        layer: the :class:`QSAAttention` (weights replicated on every device).
        x: ``[B, S, hidden]`` global hidden states; S divisible by the axis size,
            and (unpacked) each shard by ``indexer_compress_ratio``.
        freqs_cis: ``[B, S, r]`` global rotary table.
        mesh, axis_name: the device mesh and the axis that splits S.
        attention_mask: ``[B, S]`` global right-padding mask, or None.
        cu_seqlens: global boundaries of one packed row (B = 1); the last may
            end before S (the tail is padding).
        selected_token_ids: ``[B, S, K]`` global routes to use instead of the indexer's.

    Returns:
        ``[B, S, hidden]``, sequence-sharded like the inputs; equal to ``layer(x, ...)``.

    Raises:
        ValueError: shapes, layouts, or S not divisible as required.
    """
    if not isinstance(layer, QSAAttention):
        raise TypeError(f"layer must be a QSAAttention, got {type(layer).__name__}")
    packed = cu_seqlens is not None

    def body(local, x, freqs_cis, layout, routes):
        attention_fn = functools.partial(sparse_gqa_attention_shard, axis_name=axis_name,
                                         implementation=local.implementation)
        return local.attend(x, freqs_cis, layout, selected_token_ids=routes,
                            gather=_key_gather(local.indexer, packed, axis_name), attention_fn=attention_fn)

    routes = None if selected_token_ids is None else prepare_routes(selected_token_ids)
    return _run(layer, layer.indexer, x, freqs_cis, mesh=mesh, axis_name=axis_name,
                attention_mask=attention_mask, cu_seqlens=cu_seqlens, routes=routes, body=body)


def context_parallel_qsa_indexer(
    indexer: QSAIndexer,
    x,
    *,
    freqs_cis,
    mesh: Mesh,
    axis_name: str = "cp",
    attention_mask=None,
    cu_seqlens=None,
):
    """The indexer's routes ``[B, S, budget + ratio - 1]`` with the sequence split
    over ``axis_name`` (arguments as :func:`context_parallel_qsa_attention`);
    equal to ``indexer(x, ...)``."""
    if not isinstance(indexer, QSAIndexer):
        raise TypeError(f"indexer must be a QSAIndexer, got {type(indexer).__name__}")
    packed = cu_seqlens is not None

    def body(local, x, freqs_cis, layout, routes):
        del routes
        return local.routes(x, freqs_cis, layout, gather=_key_gather(local, packed, axis_name))

    return _run(indexer, indexer, x, freqs_cis, mesh=mesh, axis_name=axis_name,
                attention_mask=attention_mask, cu_seqlens=cu_seqlens, routes=None, body=body)
