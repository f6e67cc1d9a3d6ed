"""Flax (nnx) QSA attention: projections, GQA, RoPE, QK-norm, indexer, sparse attention.

* :func:`qsa_attention`: the functional form. Hidden states, a dict of weights
  and routes you bring yourself -> attention output.
* :class:`QSAAttention`: an ``nnx.Module`` owning those weights plus a small
  route indexer (:func:`qsa_jax.indexer.qsa_indexer_routes`); it picks the
  routes and then calls :func:`qsa_attention`. Works under ``nnx.jit``,
  ``nnx.grad`` and an ``optax`` step through ``nnx.Optimizer``.

Both end in ``qsa_jax.sparse_gqa_attention(..., implementation=...)``
(``implementation=None`` picks the default for the device) or in any
``attention_fn(query, key, value, routes, scale)`` you pass, for example a
context-parallel wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import sparse_gqa_attention
from .routes import prepare_routes
from .indexer import document_starts, qsa_indexer_routes

__all__ = ["QSAAttention", "qsa_attention", "apply_rope", "rms_norm"]


def rms_norm(x, weight, eps: float = 1e-6):
    """RMS norm over the last axis (float32 statistics), times ``weight`` [D]."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x, positions, theta: float):
    """Rotary embedding (rotate-half form) of ``x`` [B,S,H,D] at ``positions`` [B,S]."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE needs an even head dim, got {d}")
    freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angle = positions.astype(jnp.float32)[..., None, None] * freq  # [B,S,1,D/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _check_params(x, params, num_heads, num_kv_heads):
    if len(getattr(x, "shape", ())) != 3:
        raise ValueError(f"x must be [B, S, model_dim], got shape {getattr(x, 'shape', None)}")
    missing = [n for n in ("q", "k", "v", "o") if n not in params]
    if missing:
        raise ValueError(f"params is missing {missing} (needs q, k, v, o)")
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    model_dim = x.shape[-1]
    q_out = params["q"].shape[-1]
    if params["q"].shape[0] != model_dim or q_out % num_heads:
        raise ValueError(f"params['q'] must be [{model_dim}, num_heads * D], got {params['q'].shape}")
    head_dim = q_out // num_heads
    for name, shape in (("k", (model_dim, num_kv_heads * head_dim)),
                        ("v", (model_dim, num_kv_heads * head_dim)),
                        ("o", (num_heads * head_dim, model_dim)),
                        ("q_norm", (head_dim,)), ("k_norm", (head_dim,))):
        if name in params and params[name] is not None and tuple(params[name].shape) != shape:
            raise ValueError(f"params[{name!r}] must have shape {list(shape)}, got {params[name].shape}")
    return head_dim


def qsa_attention(
    x,
    params: Mapping[str, jax.Array],
    selected_token_ids,
    *,
    num_heads: int,
    num_kv_heads: int,
    positions=None,
    rope_theta: float | None = None,
    norm_eps: float = 1e-6,
    softmax_scale: float | None = None,
    implementation: str | Sequence[str] | None = None,
    attention_fn: Callable | None = None,
):
    """QSA attention block on hidden states, with routes given by the caller.

    Args:
        x: ``[B, S, M]`` hidden states.
        params: ``"q"`` ``[M, Hq*D]``, ``"k"`` and ``"v"`` ``[M, Hkv*D]``, ``"o"``
            ``[Hq*D, M]``; optional ``"q_norm"`` / ``"k_norm"`` ``[D]`` RMS-norm
            weights (QK-norm, applied per head before RoPE).
        selected_token_ids: ``[B, S, K]`` int routes into ``[0, S)`` (any
            contract-valid routes; the QSA format is not required).
        num_heads, num_kv_heads: Hq and Hkv (GQA: Hq a multiple of Hkv).
        positions: ``[B, S]`` RoPE positions (default ``arange(S)``).
        rope_theta: RoPE base; ``None`` disables RoPE.
        norm_eps: QK-norm epsilon.
        softmax_scale: attention scale, default ``1/sqrt(D)``.
        implementation: passed to :func:`qsa_jax.sparse_gqa_attention`.
        attention_fn: replaces that call: ``fn(query, key, value, routes, scale)``.

    Returns:
        ``[B, S, M]``; rows without routes (padding) are exactly zero.
    """
    head_dim = _check_params(x, params, num_heads, num_kv_heads)
    bsz, seq, _ = x.shape
    dtype = jnp.result_type(x, params["q"])
    x = x.astype(dtype)
    q = (x @ params["q"].astype(dtype)).reshape(bsz, seq, num_heads, head_dim)
    k = (x @ params["k"].astype(dtype)).reshape(bsz, seq, num_kv_heads, head_dim)
    v = (x @ params["v"].astype(dtype)).reshape(bsz, seq, num_kv_heads, head_dim)
    if params.get("q_norm") is not None:
        q = rms_norm(q, params["q_norm"], norm_eps)
    if params.get("k_norm") is not None:
        k = rms_norm(k, params["k_norm"], norm_eps)
    if rope_theta is not None:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq), (bsz, seq))
        q, k = apply_rope(q, positions, rope_theta), apply_rope(k, positions, rope_theta)
    # on the host, before JAX sees them: int64 IDs past int32 are padding, not wrapped
    routes = prepare_routes(selected_token_ids)
    if attention_fn is None:
        out = sparse_gqa_attention(q, k, v, routes, softmax_scale, implementation=implementation)
    else:
        out = attention_fn(q, k, v, routes, softmax_scale)
    return out.reshape(bsz, seq, num_heads * head_dim) @ params["o"].astype(dtype)


class QSAAttention(nnx.Module):
    """QSA attention layer: Q/K/V/O projections, GQA, optional RoPE and QK-norm,
    a route indexer, and route-sparse attention.

    The indexer has its own projections: ``index_heads`` queries of
    ``index_dim`` per token and one key per token; it keeps ``top_k`` four-token
    blocks per token (routes of width ``4 * top_k + 4``, CONTRACT.md's QSA format).

    Training the indexer: top-k selection is discrete, so the routes are under
    ``stop_gradient`` and the loss gives the indexer projections an exact zero
    gradient. They keep their initial (or loaded) values unless you train them
    with an objective of your own on :meth:`index_projections` (for instance a
    distillation loss towards the attention's block weights); an optimizer with
    weight decay would shrink them, so exclude them from ``wrt`` if you want them
    frozen. The Q/K/V/O and norm weights train normally.

    Call with ``lengths`` (padded rows) or ``segment_ids`` (packed documents;
    RoPE positions then restart at each document), or pass
    ``selected_token_ids`` to bypass the indexer.
    """

    def __init__(
        self,
        model_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        top_k: int,
        index_heads: int = 4,
        index_dim: int = 32,
        rope_theta: float | None = 10000.0,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        softmax_scale: float | None = None,
        implementation: str | Sequence[str] | None = None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if top_k < 1:
            raise ValueError(f"top_k must be positive, got {top_k}")

        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=False, param_dtype=param_dtype, rngs=rngs)

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.top_k, self.index_heads, self.index_dim = int(top_k), index_heads, index_dim
        self.rope_theta, self.norm_eps, self.softmax_scale = rope_theta, norm_eps, softmax_scale
        self.implementation = (
            tuple(implementation) if isinstance(implementation, (list, tuple)) else implementation
        )
        self.q_proj = linear(model_dim, num_heads * head_dim)
        self.k_proj = linear(model_dim, num_kv_heads * head_dim)
        self.v_proj = linear(model_dim, num_kv_heads * head_dim)
        self.o_proj = linear(num_heads * head_dim, model_dim)
        self.q_norm = nnx.Param(jnp.ones(head_dim, param_dtype)) if qk_norm else None
        self.k_norm = nnx.Param(jnp.ones(head_dim, param_dtype)) if qk_norm else None
        self.index_q = linear(model_dim, index_heads * index_dim)
        self.index_k = linear(model_dim, index_dim)

    def projection_params(self) -> dict[str, jax.Array]:
        """The weights :func:`qsa_attention` takes, as a dict of arrays."""
        params = {name: getattr(self, f"{name}_proj").kernel[...] for name in "qkvo"}
        if self.q_norm is not None:
            params["q_norm"], params["k_norm"] = self.q_norm[...], self.k_norm[...]
        return params

    def index_projections(self, x):
        """Indexer queries ``[B,S,index_heads,index_dim]`` and keys ``[B,S,index_dim]``
        (differentiable: the hook for an auxiliary indexer loss)."""
        bsz, seq, _ = x.shape
        return (self.index_q(x).reshape(bsz, seq, self.index_heads, self.index_dim),
                self.index_k(x))

    def routes(self, x, *, lengths=None, segment_ids=None):
        """int32 ``[B, S, 4 * top_k + 4]`` QSA routes picked by the indexer (no gradient)."""
        qi, ki = self.index_projections(x)
        return qsa_indexer_routes(qi, ki, self.top_k, lengths=lengths, segment_ids=segment_ids)

    def __call__(self, x, *, lengths=None, segment_ids=None, positions=None, selected_token_ids=None):
        """``x`` [B, S, model_dim] -> [B, S, model_dim].

        ``positions`` defaults to the position within the row (within the
        document when ``segment_ids`` is given).
        """
        if selected_token_ids is None:
            selected_token_ids = self.routes(x, lengths=lengths, segment_ids=segment_ids)
        if positions is None and self.rope_theta is not None:
            bsz, seq, _ = x.shape
            start, _ = document_starts(bsz, seq, segment_ids=segment_ids)
            positions = jnp.arange(seq)[None, :] - start
        return qsa_attention(
            x, self.projection_params(), selected_token_ids,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, positions=positions,
            rope_theta=self.rope_theta, norm_eps=self.norm_eps,
            softmax_scale=self.softmax_scale, implementation=self.implementation,
        )
