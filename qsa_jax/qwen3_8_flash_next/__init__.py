"""Qwen3.8-Flash-Next's QSA attention layer in Flax nnx, weight for weight with the
upstream PyTorch layer (nemo-automodel 0.7.0).

* :class:`QSAConfig`: the layer's fields of the upstream text config.
* :class:`QSAAttention`: gated GQA attention over routes from the frozen
  :class:`QSAIndexer`; ``layer(x, freqs_cis=..., attention_mask=..., cu_seqlens=...)``.
* :func:`rotary_freqs`: ``freqs_cis`` for text positions, as the model builds them.
* :func:`load_torch_state_dict` / :func:`to_torch_state_dict`: the upstream
  state dict (torch ``[out, in]`` layout, optional checkpoint prefix).
* :func:`context_parallel_qsa_attention` / :func:`context_parallel_qsa_indexer`:
  the sequence split over a mesh axis with ``shard_map``.
* :func:`save_routes_policy`: a remat policy under which the backward reuses
  the forward's routes.

Importing this package needs jax, flax and numpy only (never torch).
"""

from .attention import ROUTES_NAME, QSAAttention, rotary_freqs, save_routes_policy
from .config import QSAConfig
from .context_parallel import context_parallel_qsa_attention, context_parallel_qsa_indexer
from .indexer import FrozenParam, QSAIndexer, compress_keys, make_layout
from .weights import load_torch_state_dict, to_torch_state_dict

__all__ = [
    "FrozenParam",
    "QSAAttention",
    "QSAConfig",
    "QSAIndexer",
    "ROUTES_NAME",
    "compress_keys",
    "context_parallel_qsa_attention",
    "context_parallel_qsa_indexer",
    "load_torch_state_dict",
    "make_layout",
    "rotary_freqs",
    "save_routes_policy",
    "to_torch_state_dict",
]
