"""The frozen QSA route indexer of Qwen3.8-Flash-Next as a Flax nnx module.

Per token, one fused projection ``index_qk_proj`` gives ``H`` index queries and
one index key of width ``D`` (model dtype). Queries: ``q_layernorm`` then RoPE
at the token's position. Keys: each complete group of ``c`` consecutive raw
keys (``c = indexer_compress_ratio``) is averaged in float32 (summed in order,
then divided by ``c``), cast back to the model dtype, ``k_layernorm``-ed and
rotated at the group's first position. The float32 score of block ``b`` for
query row ``t`` is ``sum_h relu(iq[t, h] . kbar[b]) / sqrt(D)`` (heads summed
in order). Selection (:func:`qsa_jax.indexer.select_routes`): a row at
position ``p`` of its document sees ``v = (p + 1) // c`` complete blocks and
keeps all of them when ``v <= top_k``, else the ``top_k = budget / c`` best
(ties: the earlier block); kept blocks expand to their ``c`` token IDs in
ascending order, then the causal tail ``c*v .. p``; width ``budget + c - 1``,
int32, -1 padding. Padding rows are all -1. (Upstream lists top-k blocks in
score order and breaks ties in an unspecified order; routes are sets, so only
the choice among exactly tied blocks at the cut can differ.)

Layouts: a right-padded batch (binary ``attention_mask``), one packed row
(``cu_seqlens``: blocks restart at every document start, RoPE positions are
the caller's document-relative ``freqs_cis``, IDs are positions in the row),
and context parallelism (:mod:`.context_parallel`: compressed keys gathered
over the mesh axis without gradient). The weights are :class:`FrozenParam`
variables: ``nnx.grad`` and ``nnx.Optimizer(..., wrt=nnx.Param)`` never see
them, and the routes carry no gradient.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qsa_jax.indexer import select_routes
from qsa_jax.layers import apply_rotary, matmul, rms_norm, rounded

from .config import QSAConfig

__all__ = ["FrozenParam", "Layout", "QSAIndexer", "compress_keys", "make_layout"]


class FrozenParam(nnx.Variable):
    """A weight that is loaded, never trained: not an ``nnx.Param``, so the default
    ``nnx.grad`` filter and ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` skip it."""


def _concrete(x):
    """``x`` as a numpy array, or None while it is being traced."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each query row sits: all arrays ``[B, S_q]`` in K/V (global) coordinates.

    Attributes:
        positions: int32 K/V position of each query row.
        doc_starts: int32 first position of the row's document (0 unpadded/padded).
        valid: bool, False on padding rows (their routes are all -1).
        packed: documents share a row (blocks may start anywhere): static.
        kv_length: S_kv, the K/V (global) length: static.
        max_visible: longest document, a bound on a row's valid route count: static.
        cu_seqlens: the packed row's boundaries ``[n_docs + 1]`` (packed only).
    """

    positions: jax.Array
    doc_starts: jax.Array
    valid: jax.Array
    packed: bool
    kv_length: int
    max_visible: int
    cu_seqlens: jax.Array | None = None


def _check_mask(attention_mask, batch, kv_length):
    mask = jnp.asarray(attention_mask)
    if mask.shape != (batch, kv_length):
        raise ValueError(f"attention_mask must be [B, S] = {[batch, kv_length]}, got {list(mask.shape)}")
    host = _concrete(mask)
    if host is not None:
        if not np.isin(host, (0, 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1 (binary right-padding mask)")
        lengths = host.astype(bool).sum(-1)
        if not np.array_equal(host.astype(bool), np.arange(kv_length)[None] < lengths[:, None]):
            raise ValueError("attention_mask must be right-padded (1...1 0...0 per row); "
                             "pass packed documents through cu_seqlens")
    return jnp.sum(mask != 0, axis=-1).astype(jnp.int32)


def _check_cu_seqlens(cu_seqlens, batch, kv_length, *, exact_end: bool):
    if batch != 1:
        raise ValueError(f"cu_seqlens (packed documents) needs a batch of one row, got batch={batch}")
    cu = jnp.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
        raise ValueError(f"cu_seqlens must be a rank-1 integer array of >= 2 boundaries, got "
                         f"shape {list(cu.shape)} dtype {cu.dtype}")
    host = _concrete(cu)
    if host is not None:
        end_ok = host[-1] == kv_length if exact_end else host[-1] <= kv_length
        if host[0] != 0 or not end_ok or (np.diff(host) <= 0).any():
            raise ValueError(
                f"cu_seqlens must start at 0, increase strictly and end at {'' if exact_end else 'or before '}"
                f"the packed length {kv_length}; got {host.tolist()}"
            )
        return cu.astype(jnp.int32), int(np.diff(host).max())
    return cu.astype(jnp.int32), kv_length


def make_layout(batch, seq, *, attention_mask=None, cu_seqlens=None, lengths=None, offset=0, kv_length=None,
                padding_tail: bool = False):
    """The :class:`Layout` of ``seq`` query rows starting at K/V position ``offset``.

    Args:
        batch, seq: B and the number of (local) query rows.
        attention_mask: ``[B, S_kv]`` binary right-padding mask (global), or None.
        cu_seqlens: ``[n_docs + 1]`` packed boundaries (global), or None.
        lengths: ``[B]`` int sequence lengths, instead of ``attention_mask``.
        offset: K/V position of query row 0 (``rank * S_local`` under CP); may be traced.
        kv_length: S_kv (default ``seq``).
        padding_tail: the packed boundaries may end before ``kv_length`` (the
            context-parallel layout pads the row to a multiple of the devices);
            otherwise they must end exactly at it.

    Raises:
        ValueError: both masks, a non-binary or not right-padded mask, bad
            boundaries, or a packed batch of more than one row (checked where
            the arrays are concrete; under tracing they are taken as given).
    """
    kv_length = seq if kv_length is None else kv_length
    if sum(a is not None for a in (attention_mask, cu_seqlens, lengths)) > 1:
        raise ValueError("pass attention_mask (padded batch) or cu_seqlens (packed row), not both")
    pos = jnp.broadcast_to(offset + jnp.arange(seq, dtype=jnp.int32), (batch, seq)).astype(jnp.int32)
    if cu_seqlens is not None:
        cu, longest = _check_cu_seqlens(cu_seqlens, batch, kv_length, exact_end=not padding_tail)
        doc = jnp.clip(jnp.searchsorted(cu, pos, side="right") - 1, 0, cu.shape[0] - 2)
        return Layout(pos, cu[doc], pos < cu[-1], True, kv_length, longest, cu)
    if attention_mask is not None:
        lengths = _check_mask(attention_mask, batch, kv_length)
    valid = jnp.ones((batch, seq), bool) if lengths is None else pos < jnp.asarray(lengths)[:, None]
    return Layout(pos, jnp.zeros_like(pos), valid, False, kv_length, kv_length)


def compress_keys(raw_key, freqs_cis, k_norm, *, ratio: int, step: int, eps: float):
    """Compressed index keys of the blocks starting every ``step`` positions.

    Args:
        raw_key: ``[B, S, D]`` index keys (model dtype).
        freqs_cis: ``[B, S, r]`` rotary table of the same positions.
        k_norm: ``[D]`` ``k_layernorm`` weight.
        ratio: tokens per block; step: ``ratio`` (aligned blocks) or 1 (packed rows).

    Returns:
        ``[B, N, D]`` in ``raw_key``'s dtype, N = ``S // ratio`` (aligned) or
        ``S - ratio + 1`` (every start): float32 mean of the block's keys (summed
        in order, divided by ``ratio``), cast back, normalised, rotated at the
        block's first position.
    """
    bsz, seq, dim = raw_key.shape
    k32 = raw_key.astype(jnp.float32)
    if step == ratio:
        n = seq // ratio
        groups = k32[:, : n * ratio].reshape(bsz, n, ratio, dim)
        parts = [groups[:, :, i] for i in range(ratio)]
        table = freqs_cis[:, : n * ratio : ratio]
    elif step == 1:
        n = max(0, seq - ratio + 1)
        parts = [k32[:, i : i + n] for i in range(ratio)]
        table = freqs_cis[:, :n]
    else:
        raise ValueError(f"step must be 1 or the ratio {ratio}, got {step}")
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    mean = rounded(total / ratio, raw_key.dtype).astype(raw_key.dtype)
    return apply_rotary(rms_norm(mean, k_norm, eps)[:, :, None], table)[:, :, 0]


def _head_sum_score(dim):
    def score(relu_dots):  # [B, c, H, N]: heads summed in order, then / sqrt(D)
        total = relu_dots[:, :, 0]
        for h in range(1, relu_dots.shape[2]):
            total = total + relu_dots[:, :, h]
        return total / math.sqrt(dim)

    return score


class QSAIndexer(nnx.Module):
    """Frozen block indexer: hidden states -> int32 routes ``[B, S, budget + c - 1]``.

    Weights (``[in, out]`` layout; all :class:`FrozenParam`):
    ``index_qk_proj`` ``[M, (H + 1) * D]`` (H query heads head-major, then the
    key), ``q_layernorm`` / ``k_layernorm`` ``[D]`` (float32, zero-centred).
    """

    def __init__(self, config: QSAConfig, *, rngs: nnx.Rngs, dtype=None):
        if not isinstance(config, QSAConfig):
            raise TypeError(f"config must be a QSAConfig, got {type(config).__name__}")
        self.config = config
        dtype = config.compute_dtype if dtype is None else dtype
        width = (config.indexer_n_heads + 1) * config.indexer_head_dim
        init = nnx.initializers.normal(config.initializer_range)
        self.index_qk_proj = FrozenParam(init(rngs.params(), (config.hidden_size, width), dtype))
        self.q_layernorm = FrozenParam(jnp.zeros(config.indexer_head_dim, jnp.float32))
        self.k_layernorm = FrozenParam(jnp.zeros(config.indexer_head_dim, jnp.float32))

    def __call__(self, x, *, freqs_cis, attention_mask=None, cu_seqlens=None):
        """Routes of every row of ``x``.

        Args:
            x: ``[B, S, hidden]`` hidden states.
            freqs_cis: ``[B, S, r]`` rotary table (:func:`rotary_freqs`; document-relative
                positions for a packed row).
            attention_mask: ``[B, S]`` binary right-padding mask, or None.
            cu_seqlens: ``[n_docs + 1]`` boundaries of a packed row (B = 1), or None.

        Returns:
            int32 ``[B, S, indexer_budget + indexer_compress_ratio - 1]``, IDs in
            ``[0, S)``, -1 padding; no gradient.
        """
        self._check_inputs(x, freqs_cis)
        bsz, seq, _ = x.shape
        layout = make_layout(bsz, seq, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        return self.routes(x, freqs_cis, layout)

    def _check_inputs(self, x, freqs_cis):
        cfg = self.config
        if len(getattr(x, "shape", ())) != 3 or x.shape[-1] != cfg.hidden_size or 0 in x.shape:
            raise ValueError(f"x must be [B, S, {cfg.hidden_size}] with S > 0, got {getattr(x, 'shape', None)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"x must be floating, got {x.dtype}")
        want = (x.shape[0], x.shape[1], cfg.rotary_dim)
        if tuple(getattr(freqs_cis, "shape", ())) != want:
            raise ValueError(f"freqs_cis must be [B, S, rotary_dim] = {list(want)}, got "
                             f"{list(getattr(freqs_cis, 'shape', ()))}")

    def project(self, x, freqs_cis):
        """``(index queries [B,S,H,D] normalised and rotated, raw keys [B,S,D])``, model dtype."""
        cfg = self.config
        bsz, seq, _ = x.shape
        heads, dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        projected = matmul(jax.lax.stop_gradient(x), self.index_qk_proj[...])
        query = projected[..., : heads * dim].reshape(bsz, seq, heads, dim)
        query = apply_rotary(rms_norm(query, self.q_layernorm[...], cfg.rms_norm_eps), freqs_cis)
        return query, projected[..., heads * dim :]

    def compress(self, raw_key, freqs_cis, *, packed: bool):
        """:func:`compress_keys` with this indexer's norm (aligned blocks, or every start when packed)."""
        ratio = self.config.indexer_compress_ratio
        return compress_keys(raw_key, freqs_cis, self.k_layernorm[...], ratio=ratio,
                             step=1 if packed else ratio, eps=self.config.rms_norm_eps)

    def routes(self, x, freqs_cis, layout: Layout, *, gather=None):
        """Routes of the query rows of ``x`` placed by ``layout``.

        ``gather`` (context parallelism) maps the local ``(raw keys, freqs_cis)`` to
        the global compressed keys; without it the keys are those of ``x``.
        """
        cfg = self.config
        query, raw_key = self.project(x, freqs_cis)
        if gather is None:
            keys = self.compress(raw_key, freqs_cis, packed=layout.packed)
        else:
            keys = gather(raw_key, freqs_cis)
        keys = jax.lax.stop_gradient(keys)
        ratio = cfg.indexer_compress_ratio
        step = 1 if layout.packed else ratio
        starts = jnp.arange(keys.shape[1], dtype=jnp.int32) * step
        routes = select_routes(
            query.astype(jnp.float32), keys.astype(jnp.float32), starts,
            positions=layout.positions, doc_starts=layout.doc_starts, valid=layout.valid,
            top_k=cfg.top_k, ratio=ratio, width=cfg.route_width,
            score=_head_sum_score(cfg.indexer_head_dim), chunk_rows=cfg.qsa_indexer_query_chunk_size,
        )
        return jax.lax.stop_gradient(routes)
