"""The Qwen3.8-Flash-Next QSA attention layer as a Flax nnx module.

``QSAAttention(config, rngs=...)(x, freqs_cis=..., attention_mask=..., cu_seqlens=...)``
computes what the upstream PyTorch layer computes: the frozen
:class:`~.indexer.QSAIndexer` picks each row's routes, then
:func:`qsa_jax.layers.qsa_attention` runs the gated attention over them through
:func:`qsa_jax.sparse_gqa_attention` (``implementation=`` picks the kernel).

Activation checkpointing: the routes are tagged with
``checkpoint_name(..., ROUTES_NAME)``; remat with :func:`save_routes_policy`
keeps them, so the backward replays the forward's routes instead of rerunning
the indexer (the upstream model replays them the same way).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from qsa_jax.layers import qsa_attention, rotary_table

from .config import QSAConfig
from .indexer import Layout, QSAIndexer, make_layout

__all__ = ["QSAAttention", "ROUTES_NAME", "rotary_freqs", "save_routes_policy"]

ROUTES_NAME = "qsa_routes"


def rotary_freqs(config: QSAConfig, positions, dtype=None):
    """``freqs_cis`` ``[..., r]`` for integer text ``positions`` ``[...]`` (e.g. ``[B, S]``).

    As the upstream model builds it for text (its three mRoPE position streams
    are equal): ``cat(cos, sin)`` of ``position * inv_freq`` over the rotary
    width ``r = int(head_dim * partial_rotary_factor)``, float32, cast to
    ``dtype`` (default ``config.dtype``). A packed row takes positions that
    restart at every document.
    """
    dtype = config.compute_dtype if dtype is None else dtype
    return rotary_table(positions, rotary_dim=config.rotary_dim, theta=config.rope_theta, dtype=dtype)


def save_routes_policy(base=None):
    """A remat policy that saves the layer's routes (plus what ``base`` saves).

    Use with ``jax.checkpoint(f, policy=save_routes_policy())`` or ``nnx.remat``.
    """
    names = jax.checkpoint_policies.save_only_these_names(ROUTES_NAME)
    return names if base is None else jax.checkpoint_policies.save_from_both_policies(base, names)


class QSAAttention(nnx.Module):
    """Gated GQA attention over routes picked by a frozen block indexer.

    Trainable weights (``nnx.Param``, ``[in, out]`` layout; torch's are the
    transposes): ``q_proj.kernel`` ``[M, 2*Hq*D]`` (per head: D query columns
    then D gate columns), ``k_proj.kernel`` / ``v_proj.kernel`` ``[M, Hkv*D]``,
    ``o_proj.kernel`` ``[Hq*D, M]`` in ``dtype``; ``q_norm`` / ``k_norm``
    ``[D]`` float32 (zero-centred RMSNorm weights). The indexer's weights are
    frozen (see :class:`~.indexer.QSAIndexer`).

    Args:
        config: the layer's sizes.
        rngs: initialisers' keys (projections ~ N(0, initializer_range), norms 0).
        dtype: parameter and compute dtype (default ``config.dtype``).
        implementation: passed to :func:`qsa_jax.sparse_gqa_attention`.
        head_axis: a mesh axis name to annotate the projections for tensor parallelism
            (``nnx.with_partitioning``): the output columns of ``q_proj``, ``k_proj`` and
            ``v_proj`` and the input rows of ``o_proj`` are split over it, whole heads
            per device (the axis size must divide Hkv, so query heads go with their KV
            heads). ``nnx.get_named_sharding(nnx.state(layer), mesh)`` then gives the
            weights' shardings; under ``nnx.jit`` the attention runs on each device's
            heads (docs/sharding.md). None (the default): no annotation.
    """

    def __init__(self, config: QSAConfig, *, rngs: nnx.Rngs, dtype=None,
                 implementation: str | Sequence[str] | None = None, head_axis: str | None = None):
        if not isinstance(config, QSAConfig):
            raise TypeError(f"config must be a QSAConfig, got {type(config).__name__}")
        self.config = config
        dtype = config.compute_dtype if dtype is None else dtype
        self.implementation = (
            tuple(implementation) if isinstance(implementation, (list, tuple)) else implementation
        )
        m, hq, hkv, d = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         config.head_dim)

        def linear(n_in, n_out, split=None):
            init = nnx.initializers.normal(config.initializer_range)
            if head_axis is not None:  # [in, out] kernels: split the head-major dim
                init = nnx.with_partitioning(init, (None, head_axis) if split == "out" else (head_axis, None))
            return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=dtype,
                              kernel_init=init, rngs=rngs)

        self.q_proj = linear(m, 2 * hq * d, "out")
        self.k_proj = linear(m, hkv * d, "out")
        self.v_proj = linear(m, hkv * d, "out")
        self.o_proj = linear(hq * d, m, "in")
        self.q_norm = nnx.Param(jnp.zeros(d, jnp.float32))
        self.k_norm = nnx.Param(jnp.zeros(d, jnp.float32))
        self.indexer = QSAIndexer(config, rngs=rngs, dtype=dtype)

    def params(self) -> dict[str, jax.Array]:
        """The trainable weights as :func:`qsa_jax.layers.qsa_attention` takes them."""
        out = {name: getattr(self, name).kernel[...] for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        out["q_norm"], out["k_norm"] = self.q_norm[...], self.k_norm[...]
        return out

    def __call__(self, x, *, freqs_cis, attention_mask=None, cu_seqlens=None, selected_token_ids=None):
        """``x`` ``[B, S, hidden]`` -> ``[B, S, hidden]``.

        Args:
            x: hidden states.
            freqs_cis: ``[B, S, r]`` (:func:`rotary_freqs`; document-relative for packed rows).
            attention_mask: ``[B, S]`` binary right-padding mask; padding rows give 0.
            cu_seqlens: ``[n_docs + 1]`` document boundaries of one packed row (B = 1).
            selected_token_ids: ``[B, S, K]`` routes to use instead of the indexer's.

        Raises:
            ValueError: bad shapes or layouts (see :func:`~.indexer.make_layout`).
        """
        self.indexer._check_inputs(x, freqs_cis)
        bsz, seq, _ = x.shape
        layout = make_layout(bsz, seq, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        return self.attend(x, freqs_cis, layout, selected_token_ids=selected_token_ids)

    def attend(self, x, freqs_cis, layout: Layout, *, selected_token_ids=None, gather=None,
               attention_fn=None):
        """The layer on the query rows placed by ``layout`` (shared by the CP path).

        ``gather`` is passed to :meth:`QSAIndexer.routes`; ``attention_fn`` to
        :func:`qsa_jax.layers.qsa_attention`.
        """
        cfg = self.config
        if selected_token_ids is None:
            routes = self.indexer.routes(x, freqs_cis, layout, gather=gather)
            # valid IDs come first and never exceed the longest document: trim the -1 tail
            routes = checkpoint_name(routes[..., : min(cfg.route_width, layout.max_visible)], ROUTES_NAME)
        else:
            routes = selected_token_ids
        return qsa_attention(
            x, self.params(), routes, freqs_cis=freqs_cis, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
            implementation=self.implementation, attention_fn=attention_fn,
        )
