"""Framework-neutral half of the QSA input contract.

Both ``qsa_torch.routes`` and ``qsa_jax.routes`` validate inputs through
:func:`check_dtypes`, :func:`check_shapes` and :func:`resolve_scale` (with
:func:`not_an_array` and :func:`device_mismatch` for the errors that need framework
objects). Everything here works on dtype names, plain tuples and Python numbers, so
the two frameworks raise the same exception classes of :mod:`qsa_common.errors` with
the same messages for the same bad input: :class:`~qsa_common.errors.InvalidInput`
(a ``ValueError``) for sizes, devices and scale values, and
:class:`~qsa_common.errors.InvalidDtype` (a ``TypeError``) for dtypes and types.

The checks run in one order in both frameworks: arrays, dtypes, shapes, devices, scale.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .errors import InvalidDtype, InvalidInput

__all__ = [
    "FLOAT_DTYPES",
    "ROUTE_DTYPES",
    "SCALE_MAX",
    "SCALE_MIN",
    "ProblemDims",
    "check_bool_or_none",
    "check_chunk_rows",
    "check_dtypes",
    "check_route_dtype",
    "check_shapes",
    "device_mismatch",
    "not_an_array",
    "resolve_scale",
]

# dtype names (numpy's spelling; torch's without the "torch." prefix)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
ROUTE_DTYPES = ("int32", "int64")

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
        InvalidInput: naming the offending argument, for a wrong rank, an empty
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
            raise InvalidInput(f"{name} must have rank {rank} {form}, got shape {tuple(shape)}")
        if any(int(d) == 0 for d in shape):
            raise InvalidInput(f"{name} has an empty dimension: shape {tuple(shape)} {form}")
    batch, query_length, query_heads, head_dim = (int(d) for d in query_shape)
    if tuple(key_shape) != tuple(value_shape):
        raise InvalidInput(
            f"value must have key's shape {tuple(key_shape)}, got {tuple(value_shape)}"
        )
    kv_batch, kv_length, kv_heads, kv_dim = (int(d) for d in key_shape)
    if kv_batch != batch:
        raise InvalidInput(f"key batch size {kv_batch} differs from query batch size {batch}")
    if kv_dim != head_dim:
        raise InvalidInput(f"key head dim {kv_dim} differs from query head dim {head_dim}")
    if query_heads % kv_heads:
        raise InvalidInput(
            f"query heads ({query_heads}) must be a multiple of key/value heads ({kv_heads})"
        )
    route_batch, route_rows, routes_per_query = (int(d) for d in routes_shape)
    if (route_batch, route_rows) != (batch, query_length):
        raise InvalidInput(
            f"selected_token_ids must be [B, S_q, K] = [{batch}, {query_length}, K], "
            f"got {tuple(routes_shape)}"
        )
    return ProblemDims(
        batch, query_length, kv_length, query_heads, kv_heads, head_dim, routes_per_query
    )


def resolve_scale(softmax_scale: object, head_dim: int) -> float:
    """Return the softmax scale as a Python float, defaulting to 1/sqrt(head_dim).

    Raises:
        InvalidDtype: if ``softmax_scale`` is not a real number (bools included).
        InvalidInput: if it is not finite or not positive, or outside
            ``[SCALE_MIN, SCALE_MAX]``: fp32 scores are multiplied by it and by it times
            log2(e), which must neither round to zero nor overflow in float32.
    """
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise InvalidDtype(
            f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}"
        )
    try:
        scale = float(softmax_scale)
    except OverflowError:  # an int past float64's range
        raise InvalidInput("softmax_scale must be finite and positive, got a value past float64's range") from None
    if not math.isfinite(scale) or scale <= 0.0:
        raise InvalidInput(f"softmax_scale must be finite and positive, got {scale!r}")
    if not SCALE_MIN <= scale <= SCALE_MAX:
        raise InvalidInput(f"softmax_scale must lie in [{SCALE_MIN!r}, {SCALE_MAX!r}] (float32 must hold it and it "
                         f"times log2(e)), got {scale!r}")
    return scale


def check_chunk_rows(chunk_rows: object) -> int:
    """A references' ``chunk_rows``: a positive int (bools refused).

    Raises:
        InvalidDtype: not an int. InvalidInput: not positive.
    """
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral):
        raise InvalidDtype(f"chunk_rows must be a positive int or None, got {type(chunk_rows).__name__}")
    if chunk_rows < 1:
        raise InvalidInput(f"chunk_rows must be a positive int, got {chunk_rows}")
    return int(chunk_rows)


def not_an_array(name: str, obj: object) -> InvalidDtype:
    """The error for an argument that is not an array (a ``torch.Tensor`` in torch, an
    array with ``dtype`` and ``shape`` in JAX)."""
    return InvalidDtype(f"{name} must be an array (torch.Tensor or jax.Array), got {type(obj).__name__}")


def device_mismatch(name: str, where: str, query_where: str) -> InvalidInput:
    """The error for ``name`` living on other devices than query (``where`` and
    ``query_where`` spelled by the framework)."""
    return InvalidInput(f"{name} is on {where} but query is on {query_where}")


def check_dtypes(query: str, key: str, value: str, selected_token_ids: str,
                 allowed: tuple[str, ...] = FLOAT_DTYPES) -> None:
    """Check the dtype names of the four inputs: query/key/value floating (in
    ``allowed``) and all one dtype, routes signed int32/int64.

    Raises:
        InvalidDtype: naming the first offending argument.
    """
    for name, dtype in (("query", query), ("key", key), ("value", value)):
        if dtype not in allowed:
            raise InvalidDtype(f"{name} must have a floating dtype in ({', '.join(allowed)}), got {dtype}")
    for name, dtype in (("key", key), ("value", value)):
        if dtype != query:
            raise InvalidDtype(f"{name} dtype {dtype} differs from query dtype {query}")
    check_route_dtype(selected_token_ids)


def check_route_dtype(dtype: str) -> None:
    """Raise :class:`InvalidDtype` unless ``dtype`` names signed int32 or int64."""
    if dtype not in ROUTE_DTYPES:
        raise InvalidDtype(f"selected_token_ids must be signed int32 or int64, got {dtype}")


def check_bool_or_none(name: str, flag: object) -> bool | None:
    """``flag`` if it is a bool or None (the dispatchers' ``deterministic``).

    Raises:
        InvalidDtype: anything else (ints included).
    """
    if flag is not None and not isinstance(flag, bool):
        raise InvalidDtype(f"{name} must be a bool or None, got {flag!r}")
    return flag
