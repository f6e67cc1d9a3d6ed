"""Framework-neutral half of the QSA input contract.

Both ``qsa_torch.routes`` and ``qsa_jax.routes`` validate inputs through
:func:`check_shapes` and :func:`resolve_scale`; they add the checks that need
framework objects (dtypes, devices). Everything here works on plain tuples and
Python numbers, so the two frameworks raise the same exceptions with the same
messages for the same bad input.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["ProblemDims", "check_chunk_rows", "check_shapes", "resolve_scale"]

# the softmax scales every backend can use: kernels scale fp32 scores by the scale times
# log2(e) (which must stay finite in fp32), and by the scale itself (which must not round
# to zero in fp32)
SCALE_MAX = 3.4028234663852886e38 / 1.4426950408889634
SCALE_MIN = 2.0**-149  # the smallest positive float32


@dataclass(frozen=True)
class ProblemDims:
    """The sizes of one QSA call.

    ``batch`` B, ``query_length`` S_q, ``kv_length`` S_kv, ``query_heads`` Hq,
    ``kv_heads`` Hkv, ``head_dim`` D and ``routes_per_query`` K.
    """

    batch: int
    query_length: int
    kv_length: int
    query_heads: int
    kv_heads: int
    head_dim: int
    routes_per_query: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (Hq // Hkv)."""
        return self.query_heads // self.kv_heads


def check_shapes(
    query_shape: tuple[int, ...],
    key_shape: tuple[int, ...],
    value_shape: tuple[int, ...],
    routes_shape: tuple[int, ...],
) -> ProblemDims:
    """Check the ranks and sizes of query [B,S_q,Hq,D], key/value [B,S_kv,Hkv,D]
    and selected_token_ids [B,S_q,K]; return the problem's dimensions.

    Raises:
        ValueError: naming the offending argument, for a wrong rank, an empty
            dimension, mismatched sizes, or Hq not a positive multiple of Hkv.
    """
    named = (
        ("query", query_shape, 4, "[B, S_q, Hq, D]"),
        ("key", key_shape, 4, "[B, S_kv, Hkv, D]"),
        ("value", value_shape, 4, "[B, S_kv, Hkv, D]"),
        ("selected_token_ids", routes_shape, 3, "[B, S_q, K]"),
    )
    for name, shape, rank, form in named:
        if len(shape) != rank:
            raise ValueError(f"{name} must have rank {rank} {form}, got shape {tuple(shape)}")
        if any(int(d) == 0 for d in shape):
            raise ValueError(f"{name} has an empty dimension: shape {tuple(shape)} {form}")
    batch, query_length, query_heads, head_dim = (int(d) for d in query_shape)
    if tuple(key_shape) != tuple(value_shape):
        raise ValueError(
            f"value must have key's shape {tuple(key_shape)}, got {tuple(value_shape)}"
        )
    kv_batch, kv_length, kv_heads, kv_dim = (int(d) for d in key_shape)
    if kv_batch != batch:
        raise ValueError(f"key batch size {kv_batch} differs from query batch size {batch}")
    if kv_dim != head_dim:
        raise ValueError(f"key head dim {kv_dim} differs from query head dim {head_dim}")
    if query_heads % kv_heads:
        raise ValueError(
            f"query heads ({query_heads}) must be a multiple of key/value heads ({kv_heads})"
        )
    route_batch, route_rows, routes_per_query = (int(d) for d in routes_shape)
    if (route_batch, route_rows) != (batch, query_length):
        raise ValueError(
            f"selected_token_ids must be [B, S_q, K] = [{batch}, {query_length}, K], "
            f"got {tuple(routes_shape)}"
        )
    return ProblemDims(
        batch, query_length, kv_length, query_heads, kv_heads, head_dim, routes_per_query
    )


def resolve_scale(softmax_scale: object, head_dim: int) -> float:
    """Return the softmax scale as a Python float, defaulting to 1/sqrt(head_dim).

    Raises:
        TypeError: if ``softmax_scale`` is not a real number (bools included).
        ValueError: if it is not finite or not positive, or outside
            ``[SCALE_MIN, SCALE_MAX]``: fp32 scores are multiplied by it and by it times
            log2(e), which must neither round to zero nor overflow in float32.
    """
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}"
        )
    try:
        scale = float(softmax_scale)
    except OverflowError:  # an int past float64's range
        raise ValueError("softmax_scale must be finite and positive, got a value past float64's range") from None
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale must be finite and positive, got {scale!r}")
    if not SCALE_MIN <= scale <= SCALE_MAX:
        raise ValueError(f"softmax_scale must lie in [{SCALE_MIN!r}, {SCALE_MAX!r}] (float32 must hold it and it "
                         f"times log2(e)), got {scale!r}")
    return scale


def check_chunk_rows(chunk_rows: object) -> int:
    """A references' ``chunk_rows``: a positive int (bools refused).

    Raises:
        TypeError: not an int. ValueError: not positive.
    """
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral):
        raise TypeError(f"chunk_rows must be a positive int or None, got {type(chunk_rows).__name__}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows}")
    return int(chunk_rows)
