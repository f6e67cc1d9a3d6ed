"""``QSAConfig``: the attention-layer fields of the Qwen3.8-Flash-Next text config.

Field names and defaults are those of the upstream text config (nemo-automodel
0.7.0, ``Qwen3_8_FlashNextTextConfig``), restricted to what one QSA attention
layer reads, so a checkpoint's ``config.json`` maps onto it key for key
(:meth:`QSAConfig.from_dict`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

__all__ = ["QSAConfig"]

_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class QSAConfig:
    """Sizes of one QSA attention layer (upstream names and defaults).

    Attributes:
        hidden_size: model width M.
        num_attention_heads, num_key_value_heads: Hq and Hkv (Hq % Hkv == 0).
        head_dim: D of the main attention; scale ``D ** -0.5``.
        rms_norm_eps: epsilon of every RMSNorm of the layer.
        initializer_range: std of the projections' normal initialisation.
        rope_theta: RoPE base.
        partial_rotary_factor: the first ``int(head_dim * factor)`` channels
            rotate (the rotary width r, even, at most ``indexer_head_dim``).
        max_position_embeddings: longest position the model was built for.
        indexer_n_heads, indexer_head_dim: index query heads and their width.
        indexer_kv_heads: index key heads; the model has exactly one.
        indexer_budget: tokens contributed by complete blocks (top-k =
            ``indexer_budget // indexer_compress_ratio`` blocks).
        indexer_compress_ratio: tokens per block (> 1, divides the budget).
        qsa_indexer_query_chunk_size: query rows scored together (None: ~64 MB
            of fp32 scores per chunk); memory only, never the result.
        dtype: parameter and compute dtype of the projections ("bfloat16",
            "float16" or "float32"); norms keep float32 weights.
    """

    hidden_size: int = 2560
    num_attention_heads: int = 24
    num_key_value_heads: int = 2
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    indexer_n_heads: int = 4
    indexer_head_dim: int = 128
    indexer_kv_heads: int = 1
    indexer_budget: int = 2048
    indexer_compress_ratio: int = 4
    qsa_indexer_query_chunk_size: int | None = None
    dtype: str = "bfloat16"

    def __post_init__(self):
        positive = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "indexer_n_heads", "indexer_head_dim", "indexer_budget", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"QSAConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.indexer_kv_heads != 1:
            raise ValueError(f"the QSA indexer has exactly one key head, got indexer_kv_heads={self.indexer_kv_heads}")
        ratio = self.indexer_compress_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 2 or self.indexer_budget % ratio:
            raise ValueError(
                "indexer_budget must be divisible by an integer indexer_compress_ratio > 1, got "
                f"budget={self.indexer_budget}, ratio={ratio!r}"
            )
        chunk = self.qsa_indexer_query_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"qsa_indexer_query_chunk_size must be a positive int or None, got {chunk!r}")
        for name in ("rms_norm_eps", "initializer_range", "rope_theta", "partial_rotary_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"QSAConfig.{name} must be finite and positive, got {value!r}")
        r = self.rotary_dim
        if r < 2 or r % 2 or r > min(self.head_dim, self.indexer_head_dim):
            raise ValueError(
                f"rotary width int(head_dim * partial_rotary_factor) = {r} must be even, positive and at most "
                f"head_dim ({self.head_dim}) and indexer_head_dim ({self.indexer_head_dim})"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"QSAConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def rotary_dim(self) -> int:
        """r: channels that rotate (the width of ``freqs_cis``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def top_k(self) -> int:
        """Complete blocks kept per query row."""
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def route_width(self) -> int:
        """Width of the indexer's routes: the budget plus ``ratio - 1`` tail slots."""
        return self.indexer_budget + self.indexer_compress_ratio - 1

    @property
    def compute_dtype(self):
        """The jnp dtype named by :attr:`dtype`."""
        return _DTYPES[self.dtype]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> QSAConfig:
        """The layer's fields from an upstream text config dict (``config.json``'s
        ``text_config``, or ``PretrainedConfig.to_dict()``); other keys are ignored.
        ``rope_theta`` and ``partial_rotary_factor`` come from ``rope_parameters``
        (or ``rope_scaling``) where it has them, as upstream's rotary embedding reads
        them, else from the top level.

        Raises:
            TypeError: ``config`` is not a mapping.
            ValueError: a ``rope_type`` other than ``"default"`` (scaled rotary
                embeddings are not ported), or fields :class:`QSAConfig` refuses.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in (None, "default"):
            raise ValueError(f"rope_type {rope_type!r} is not implemented by the port (only 'default' rotary "
                             "embeddings are)")
        for key in ("rope_theta", "partial_rotary_factor"):
            if rope.get(key) is not None:
                values[key] = rope[key]
        for key in ("rope_theta", "partial_rotary_factor", "rms_norm_eps", "initializer_range"):
            if key in values:
                values[key] = float(values[key])
        dtype = values.get("dtype", config.get("torch_dtype"))
        if dtype is not None:
            values["dtype"] = str(dtype).removeprefix("torch.")
        return cls(**values)
