"""Functional building blocks of the Flax QSA layer (:mod:`qsa_jax.qwen3_8_flash_next`).

* :func:`rms_norm`: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32, cast
  back to ``x``'s dtype (the zero-centred weight of Qwen3-Next).
* :func:`rotary_table` / :func:`apply_rotary`: ``freqs_cis = cat(cos, sin)``
  over the first ``r`` channels, rotate-half on those channels only, in the
  tensor's own dtype with every product and sum rounded to it (16-bit models
  round after each operation, as PyTorch's eager and compiled RoPE do).
* :func:`qsa_attention`: the gated attention block on hidden states and routes
  brought by the caller: interleaved query/gate projection, QK RMSNorm,
  partial RoPE, :func:`qsa_jax.sparse_gqa_attention` (or any
  ``attention_fn``, e.g. the context-parallel shard body), sigmoid output gate,
  output projection.

Arithmetic follows the dtypes of the inputs: projections are matmuls in the
parameter dtype (float32 at ``Precision.HIGHEST``), norm statistics float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from .attention import sparse_gqa_attention
from .routes import prepare_routes

__all__ = ["apply_rotary", "qsa_attention", "rms_norm", "rotary_table", "rounded", "matmul"]


def rounded(x, dtype):
    """float32 ``x`` rounded to ``dtype``'s precision (kept float32); exact for 32/64-bit.

    ``lax.reduce_precision`` survives XLA's excess-precision rewrites, so a
    chain of 16-bit operations rounds after each step on every backend."""
    info = jnp.finfo(dtype)
    if info.bits >= 32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def matmul(x, weight):
    """``x [..., in] @ weight [in, out]`` in the weight's dtype (float32: full precision).

    16-bit weights: float32 accumulation, the product rounded once to the weight's
    dtype (what a 16-bit GEMM stores), guarded by :func:`rounded` so that a consumer
    fused into the GEMM still sees the rounded value."""
    dtype = weight.dtype
    if jnp.finfo(dtype).bits >= 32:
        return jnp.matmul(x.astype(dtype), weight, precision=jax.lax.Precision.HIGHEST)
    product = jnp.matmul(x.astype(dtype), weight, preferred_element_type=jnp.float32)
    return rounded(product, dtype).astype(dtype)


def rms_norm(x, weight, eps: float):
    """Zero-centred RMSNorm over the last axis.

    Args:
        x: ``[..., D]`` float.
        weight: ``[D]``; the scale is ``1 + weight`` (initialised to zeros).
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x``'s dtype; statistics and products in float32.
    """
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return rounded(y * (1.0 + weight.astype(jnp.float32)), x.dtype).astype(x.dtype)


def rotary_table(positions, *, rotary_dim: int, theta: float, dtype=jnp.float32):
    """``freqs_cis`` for integer ``positions``: ``[..., rotary_dim]`` = ``cat(cos, sin)``.

    Angles are ``position * inv_freq`` in float32 with
    ``inv_freq[j] = 1 / theta ** (2j / rotary_dim)``; cos and sin are taken in
    float32 and then cast to ``dtype`` (the model dtype).
    """
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and positive, got {rotary_dim}")
    exponent = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim
    inv_freq = 1.0 / (jnp.float32(theta) ** exponent)
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * inv_freq
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1).astype(dtype)


def apply_rotary(x, freqs_cis):
    """Rotate-half RoPE on the first ``r`` channels of ``x``; the rest pass through.

    Args:
        x: ``[B, S, H, D]`` float.
        freqs_cis: ``[B, S, r]`` (or broadcastable to it) holding ``cat(cos, sin)``,
            ``r`` even and at most ``D``; cast to ``x``'s dtype first.

    Returns:
        ``[B, S, H, D]`` in ``x``'s dtype: ``(x1 cos - x2 sin, x2 cos + x1 sin, x_pass)``
        with ``x1, x2`` the two halves of the rotated channels, each product and
        sum rounded to ``x``'s dtype.
    """
    r = freqs_cis.shape[-1]
    d = x.shape[-1]
    if r < 2 or r % 2 or r > d:
        raise ValueError(f"freqs_cis width {r} must be even, positive and at most the head dim {d}")
    dtype = x.dtype
    half = r // 2
    table = freqs_cis.astype(dtype).astype(jnp.float32)[..., None, :]
    cos, sin = table[..., :half], table[..., half:]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:r]
    o1 = rounded(rounded(x1 * cos, dtype) - rounded(x2 * sin, dtype), dtype)
    o2 = rounded(rounded(x2 * cos, dtype) + rounded(x1 * sin, dtype), dtype)
    return jnp.concatenate([o1.astype(dtype), o2.astype(dtype), x[..., r:]], axis=-1)


_PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def _check_params(x, params, num_heads, num_kv_heads, head_dim):
    if len(getattr(x, "shape", ())) != 3:
        raise ValueError(f"x must be [B, S, hidden], got shape {getattr(x, 'shape', None)}")
    missing = [n for n in _PARAMS if n not in params]
    if missing:
        raise ValueError(f"params is missing {missing} (needs {', '.join(_PARAMS)})")
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    m = x.shape[-1]
    shapes = {"q_proj": (m, 2 * num_heads * head_dim), "k_proj": (m, num_kv_heads * head_dim),
              "v_proj": (m, num_kv_heads * head_dim), "o_proj": (num_heads * head_dim, m),
              "q_norm": (head_dim,), "k_norm": (head_dim,)}
    for name, shape in shapes.items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"params[{name!r}] must have shape {list(shape)}, got {list(params[name].shape)}")


def qsa_attention(
    x,
    params: Mapping[str, jax.Array],
    selected_token_ids,
    *,
    freqs_cis,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float = 1e-6,
    implementation: str | Sequence[str] | None = None,
    attention_fn: Callable | None = None,
):
    """The gated QSA attention block, routes given by the caller.

    Args:
        x: ``[B, S, M]`` hidden states.
        params: ``q_proj`` ``[M, 2*Hq*D]`` (per head: D query columns, then D
            gate columns), ``k_proj`` / ``v_proj`` ``[M, Hkv*D]``, ``o_proj``
            ``[Hq*D, M]`` (``[in, out]`` layout), ``q_norm`` / ``k_norm`` ``[D]``.
            Projections run in ``q_proj``'s dtype.
        selected_token_ids: ``[B, S, K]`` int routes into the K/V rows.
        freqs_cis: ``[B, S, r]`` rotary table (see :func:`apply_rotary`).
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D.
        eps: RMSNorm epsilon.
        implementation: passed to :func:`qsa_jax.sparse_gqa_attention`.
        attention_fn: replaces that call: ``fn(query, key, value, routes, scale)``
            (e.g. a context-parallel body that gathers K/V first).

    Returns:
        ``[B, S, M]`` in the projection dtype; rows without routes are exactly 0.
    """
    _check_params(x, params, num_heads, num_kv_heads, head_dim)
    bsz, seq, _ = x.shape
    dtype = params["q_proj"].dtype
    query_gate = matmul(x, params["q_proj"]).reshape(bsz, seq, num_heads, 2 * head_dim)
    query, gate = query_gate[..., :head_dim], query_gate[..., head_dim:]
    key = matmul(x, params["k_proj"]).reshape(bsz, seq, num_kv_heads, head_dim)
    value = matmul(x, params["v_proj"]).reshape(bsz, seq, num_kv_heads, head_dim)
    query = apply_rotary(rms_norm(query, params["q_norm"], eps), freqs_cis)
    key = apply_rotary(rms_norm(key, params["k_norm"], eps), freqs_cis)
    routes = prepare_routes(selected_token_ids)
    scale = head_dim ** -0.5
    if attention_fn is None:
        out = sparse_gqa_attention(query, key, value, routes, scale, implementation=implementation)
    else:
        out = attention_fn(query, key, value, routes, scale)
    gate32 = rounded(jax.nn.sigmoid(gate.astype(jnp.float32)), dtype)
    gated = rounded(out.astype(jnp.float32).reshape(gate32.shape) * gate32, dtype).astype(dtype)
    return matmul(gated.reshape(bsz, seq, num_heads * head_dim), params["o_proj"])
