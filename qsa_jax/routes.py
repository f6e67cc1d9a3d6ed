"""Route handling and input validation shared by every ``qsa_jax`` implementation.

* :func:`prepare_routes`: host-side guard for int64 routes when JAX runs
  without x64 (JAX would otherwise wrap huge IDs into valid int32 ones).
* :func:`validate_inputs`: the contract's checks with its exception types.
* :class:`UnsupportedDtype` / :class:`UnsupportedShape`: the classes of
  :mod:`qsa_common.errors` under their old import path (an implementation declining
  valid inputs it does not run; :func:`qsa_jax.sparse_gqa_attention` moves on after any
  :class:`~qsa_common.errors.BackendDeclined`).
* :func:`normalize_routes`: canonical routes (invalid -> -1, duplicates -> -1,
  optionally sorted), int32, traceable under ``jit``.
* :func:`generate_problem`: the numpy generators of :mod:`qsa_common` as JAX
  arrays (identical to ``qsa_torch`` for one seed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qsa_common import layouts as _layouts
from qsa_common import route_check as _route_check
from qsa_common.contract import (
    ProblemDims,
    check_bool_or_none,
    check_dtypes,
    check_route_dtype,
    check_shapes,
    device_mismatch,
    not_an_array,
    resolve_scale,
)
from qsa_common.errors import InvalidInput, UnsupportedDtype, UnsupportedShape

__all__ = [
    "ProblemDims",
    "UnsupportedDtype",
    "UnsupportedShape",
    "DETERMINISTIC_XLA_FLAGS",
    "Validated",
    "check_routes",
    "dtype_name",
    "resolve_deterministic",
    "xla_gpu_deterministic",
    "on_gpu",
    "prepare_routes",
    "validate_inputs",
    "normalize_routes",
    "membership_table",
    "generate_problem",
]

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class Validated:
    """What :func:`validate_inputs` established: the sizes and the scale."""

    dims: ProblemDims
    scale: float


def dtype_name(dtype: Any) -> str:
    """A dtype as the contract names it (numpy's spelling: ``float32``, ``bfloat16``)."""
    return np.dtype(dtype).name


def _check_route_dtype(dtype: Any) -> None:
    check_route_dtype(dtype_name(dtype))


def _is_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape")


def resolve_deterministic(deterministic: bool | None) -> bool:
    """The dispatchers' ``deterministic``: a bool as given; None means True where
    ``XLA_FLAGS`` asks XLA:GPU for deterministic ops (:func:`xla_gpu_deterministic`, the
    JAX counterpart of ``torch.use_deterministic_algorithms``), else False.

    Raises:
        InvalidDtype: neither a bool nor None.
    """
    if check_bool_or_none("deterministic", deterministic) is None:
        return xla_gpu_deterministic()
    return deterministic


# XLA flags under which XLA:GPU's scatter-add (the reference's backward) is deterministic
DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_exclude_nondeterministic_ops=true")


def xla_gpu_deterministic() -> bool:
    """Whether ``XLA_FLAGS`` (in this process's environment, read at the call; XLA itself
    reads it once, when its GPU backend starts) asks XLA:GPU for deterministic ops."""
    flags = os.environ.get("XLA_FLAGS", "").lower().split()
    return any(flag in flags for flag in DETERMINISTIC_XLA_FLAGS)


def prepare_routes(selected_token_ids: Any) -> Any:
    """Return routes safe to hand to JAX, keeping the route set unchanged.

    numpy (or other host) int64 routes hold values past int32 that JAX without
    x64 would wrap (``2**32 + 5`` would become the valid ID 5). Those values are
    padding anyway, so they are replaced by -1 here, on the host, before any
    conversion. JAX arrays pass through (they cannot hold such values unless x64
    is on, in which case they are compared in int64).

    Raises:
        InvalidDtype: for non-arrays and unsigned, floating or boolean routes.
    """
    if isinstance(selected_token_ids, jax.Array):
        _check_route_dtype(selected_token_ids.dtype)
        return selected_token_ids
    if not _is_array(selected_token_ids):
        raise not_an_array("selected_token_ids", selected_token_ids)
    host = np.asarray(selected_token_ids)
    _check_route_dtype(host.dtype)
    if host.dtype == np.int64 and not jax.config.jax_enable_x64:
        host = np.where((host < _INT32.min) | (host > _INT32.max), -1, host).astype(np.int32)
    return host


def _devices(x: Any) -> frozenset | None:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        try:
            return frozenset(x.devices())
        except Exception:  # deleted or otherwise unavailable arrays
            return None
    return None


_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _default_devices() -> tuple:
    """Where JAX runs work whose inputs do not say (tracers, host arrays):
    ``jax.default_device``'s device or platform where one is set, else the default
    backend's devices."""
    device = jax.config.jax_default_device
    if device is None:
        return tuple(jax.devices())
    if isinstance(device, str):  # a platform name: JAX uses its first local device
        return tuple(jax.local_devices(backend=device))
    return (device,)


def on_gpu(x: Any) -> bool:
    """Whether ``x`` lives on GPUs: its devices for a concrete ``jax.Array``, else
    (tracers, host arrays) those of :func:`_default_devices`."""
    devices = _devices(x) or _default_devices()
    return all(d.platform in _GPU_PLATFORMS for d in devices)


def gpu_capability(x: Any) -> tuple[int, int] | None:
    """CUDA compute capability ``(major, minor)`` of the GPU ``x`` lives on (for
    tracers and host arrays, of :func:`_default_devices`' first), or None where that
    is not a CUDA GPU or does not say."""
    device = next(iter(_devices(x) or _default_devices()))
    text = getattr(device, "compute_capability", None)
    if device.platform not in _GPU_PLATFORMS or not isinstance(text, str):
        return None
    try:
        major, minor = text.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def validate_inputs(
    query: Any,
    key: Any,
    value: Any,
    selected_token_ids: Any,
    softmax_scale: float | None = None,
    *,
    dtypes: tuple[Any, ...] = _FLOAT_DTYPES,
) -> Validated:
    """Check query ``[B,S_q,Hq,D]``, key/value ``[B,S_kv,Hkv,D]``, routes ``[B,S_q,K]``.

    Works on concrete arrays and on tracers (device checks apply to concrete
    ``jax.Array`` inputs only).

    The checks and messages are :mod:`qsa_common.contract`'s, in its order (arrays,
    dtypes, shapes, devices, scale), so ``qsa_torch.validate_inputs`` raises the same
    error for the same bad input.

    Raises:
        InvalidDtype: (a TypeError) a non-array, non-floating compute arrays, key/value
            dtypes differing from query's, routes not signed int32/int64.
        InvalidInput: (a ValueError) wrong ranks or sizes, Hq % Hkv != 0, empty
            dimensions, arrays committed to different devices, or a bad scale.
        UnsupportedDtype: (a TypeError) a floating dtype outside ``dtypes``.
    """
    for name, t in (("query", query), ("key", key), ("value", value),
                    ("selected_token_ids", selected_token_ids)):
        if not _is_array(t):
            raise not_an_array(name, t)
    check_dtypes(*(dtype_name(t.dtype) for t in (query, key, value, selected_token_ids)))
    allowed = tuple(dtype_name(d) for d in dtypes)
    if dtype_name(query.dtype) not in allowed:
        raise UnsupportedDtype(f"this backend computes in {', '.join(allowed)} only, got {dtype_name(query.dtype)}")
    dims = check_shapes(
        tuple(query.shape), tuple(key.shape), tuple(value.shape), tuple(selected_token_ids.shape)
    )
    query_devices = _devices(query)
    for name, t in (("key", key), ("value", value), ("selected_token_ids", selected_token_ids)):
        devices = _devices(t)
        if query_devices is not None and devices is not None and devices != query_devices:
            raise device_mismatch(name, str(sorted(map(str, devices))), str(sorted(map(str, query_devices))))
    return Validated(dims, resolve_scale(softmax_scale, dims.head_dim))


def normalize_routes(selected_token_ids: jax.Array, kv_length: int, *, sort: bool = False) -> jax.Array:
    """Canonical int32 routes of the same shape (traceable).

    IDs outside ``[0, kv_length)`` become -1; of repeated IDs in a row the first
    (lowest slot) is kept and the others become -1. With ``sort=True`` rows are
    ascending with -1 first; otherwise valid IDs keep their slots.
    """
    if not 0 < kv_length < 2**31:
        raise InvalidInput(f"kv_length must be in [1, 2**31), got {kv_length}")
    routes = jnp.asarray(selected_token_ids)
    _check_route_dtype(routes.dtype)
    valid = (routes >= 0) & (routes < kv_length)
    ids = jnp.where(valid, routes, -1).astype(jnp.int32)
    slots = jax.lax.broadcasted_iota(jnp.int32, ids.shape, ids.ndim - 1)
    ordered, order = jax.lax.sort((ids, slots), dimension=ids.ndim - 1, num_keys=1, is_stable=True)
    repeat = jnp.concatenate(
        [jnp.zeros_like(ordered[..., :1], dtype=bool),
         (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)],
        axis=-1,
    )
    ordered = jnp.where(repeat, -1, ordered)
    if sort:
        return jnp.sort(ordered, axis=-1)
    # undo the sort: slot order[j] receives ordered[j]
    _, restored = jax.lax.sort((order, ordered), dimension=ids.ndim - 1, num_keys=1)
    return restored


def membership_table(selected_token_ids: jax.Array, kv_length: int) -> jax.Array:
    """Boolean ``[B, S_q, kv_length]`` table of the valid routes of each row."""
    routes = jnp.asarray(selected_token_ids)
    valid = (routes >= 0) & (routes < kv_length)
    ids = jnp.where(valid, routes, kv_length).astype(jnp.int32)
    table = jnp.zeros(routes.shape[:2] + (kv_length + 1,), dtype=bool)
    b, s, k = routes.shape
    bi = jnp.broadcast_to(jnp.arange(b)[:, None, None], (b, s, k))
    si = jnp.broadcast_to(jnp.arange(s)[None, :, None], (b, s, k))
    return table.at[bi, si, ids].set(True)[..., :kv_length]


def generate_problem(
    layout: str,
    route_family: str,
    *,
    seed: int,
    seq_len: int,
    **kwargs,
) -> tuple[jax.Array, _layouts.RouteProblem]:
    """Routes of one layout and family as a JAX int32 array, with their description.

    Thin wrapper of :func:`qsa_common.layouts.make_problem`; the routes are the
    same set as ``qsa_torch.routes.generate_problem``'s for the same seed.
    """
    problem = _layouts.make_problem(layout, route_family, seed=seed, seq_len=seq_len, **kwargs)
    return jnp.asarray(prepare_routes(problem.routes)), problem


def check_routes(routes: Any, *, causal: bool = True, documents: Any = None, kv_length: int | None = None,
                 query_offset: int | None = None) -> _route_check.RouteReport:
    """Report out-of-range IDs (other than -1), routes to future tokens and routes crossing
    documents: :func:`qsa_common.route_check.check_routes` on the host copies of
    ``routes`` ``[B, S_q, K]`` and ``documents`` (per-token document ids ``[B, S_kv]`` or
    ``[S_kv]``). A debugging aid: it copies device arrays to the host (not traceable
    under ``jax.jit``); the attention functions never need it (out-of-range IDs are
    padding there)."""
    return _route_check.check_routes(np.asarray(routes), causal=causal,
                                     documents=None if documents is None else np.asarray(documents),
                                     kv_length=kv_length, query_offset=query_offset)
