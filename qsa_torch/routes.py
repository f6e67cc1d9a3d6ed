"""Route handling and input validation shared by every ``qsa_torch`` backend.

* :func:`validate_inputs`: the contract's checks, once, with its exception types.
* :func:`normalize_routes`: canonical routes (invalid -> -1, duplicates -> -1,
  optionally sorted), int32, for int32 and int64 input including huge values.
* :func:`membership_table`: boolean ``[B, S_q, S_kv]`` table of the route sets.
* :func:`generate_problem` and friends: the numpy generators of
  :mod:`qsa_common` as torch tensors (identical to ``qsa_jax`` for one seed).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

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
from qsa_common.errors import DeterminismUnavailable, InvalidInput, UnsupportedDtype

__all__ = [
    "ProblemDims",
    "UnverifiedBackendWarning",
    "Validated",
    "available_device_bytes",
    "check_deterministic_backward",
    "check_routes",
    "dense_aligned",
    "dtype_name",
    "needs_grad",
    "resolve_deterministic",
    "validate_inputs",
    "validate_routes",
    "normalize_routes",
    "membership_table",
    "generate_problem",
    "to_torch_routes",
    "warn_unverified",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as the contract names it (numpy's spelling: ``float32``, ``uint8``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Validated:
    """What :func:`validate_inputs` established: the sizes and the scale."""

    dims: ProblemDims
    scale: float


def validate_routes(selected_token_ids: torch.Tensor) -> None:
    """Raise :class:`~qsa_common.errors.InvalidDtype` unless routes are a signed
    int32/int64 tensor."""
    if not isinstance(selected_token_ids, torch.Tensor):
        raise not_an_array("selected_token_ids", selected_token_ids)
    check_route_dtype(dtype_name(selected_token_ids.dtype))


def validate_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    dtypes: tuple[torch.dtype, ...] = _FLOAT_DTYPES,
) -> Validated:
    """Check query ``[B,S_q,Hq,D]``, key/value ``[B,S_kv,Hkv,D]``, routes ``[B,S_q,K]``.

    The checks and messages are :mod:`qsa_common.contract`'s, in its order (arrays,
    dtypes, shapes, devices, scale), so ``qsa_jax.validate_inputs`` raises the same
    error for the same bad input. ``dtypes`` narrows the accepted compute dtype for a
    backend: a contract dtype outside it is that backend's
    :class:`~qsa_common.errors.UnsupportedDtype`.

    Raises:
        InvalidDtype: (a TypeError) a non-tensor, a non-floating compute tensor,
            key/value dtypes differing from query's, or routes not signed int32/int64.
        InvalidInput: (a ValueError) wrong ranks or sizes, Hq % Hkv != 0, empty
            dimensions, tensors on different devices, or a bad scale.
        UnsupportedDtype: (a TypeError) a floating dtype outside ``dtypes``.
    """
    for name, t in (("query", query), ("key", key), ("value", value),
                    ("selected_token_ids", selected_token_ids)):
        if not isinstance(t, torch.Tensor):
            raise not_an_array(name, t)
    check_dtypes(*(dtype_name(t.dtype) for t in (query, key, value, selected_token_ids)))
    if query.dtype not in dtypes:
        raise UnsupportedDtype(f"this backend computes in {', '.join(dtype_name(d) for d in dtypes)} only, "
                               f"got {dtype_name(query.dtype)}")
    dims = check_shapes(
        tuple(query.shape), tuple(key.shape), tuple(value.shape), tuple(selected_token_ids.shape)
    )
    for name, t in (("key", key), ("value", value), ("selected_token_ids", selected_token_ids)):
        if t.device != query.device:
            raise device_mismatch(name, str(t.device), str(query.device))
    return Validated(dims, resolve_scale(softmax_scale, dims.head_dim))


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will want gradients of any of ``tensors`` from this call."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def resolve_deterministic(deterministic: bool | None) -> bool:
    """The dispatchers' ``deterministic``: a bool as given; None follows
    ``torch.are_deterministic_algorithms_enabled()``.

    Raises:
        InvalidDtype: neither a bool nor None.
    """
    if check_bool_or_none("deterministic", deterministic) is None:
        return torch.are_deterministic_algorithms_enabled()
    return deterministic


def available_device_bytes(device: torch.device) -> int | None:
    """Bytes a CUDA device can still hand out: free memory plus what torch's caching
    allocator holds unused. None off CUDA (nothing is checked there)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached)


def dense_aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if row-major with a 16-byte-aligned base, else a row-major copy (the
    kernels' 16-byte copies, and bits that follow from shapes alone)."""
    if tensor.is_contiguous() and tensor.data_ptr() % 16 == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def check_deterministic_backward(backend: str, *tensors: torch.Tensor) -> None:
    """Refuse a backward that ``torch.use_deterministic_algorithms`` forbids.

    For backends whose backward accumulates with atomics: when deterministic
    algorithms are on and autograd will need gradients of ``tensors``, raise
    :class:`~qsa_common.errors.DeterminismUnavailable` (a RuntimeError; in warn-only
    mode, warn instead).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        refuse_nondeterministic_backward(backend)


def refuse_nondeterministic_backward(backend: str) -> None:
    """:func:`check_deterministic_backward` once a backward is known to be needed."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        f"the {backend} backend has no deterministic backward (fp32 atomics), but "
        "torch.use_deterministic_algorithms is on"
    )
    if not torch.is_deterministic_algorithms_warn_only_enabled():
        raise DeterminismUnavailable(message)
    warnings.warn(message, stacklevel=3)


class UnverifiedBackendWarning(UserWarning):
    """A backend ran on a GPU class where no recorded run has checked its numerics."""


# (backend, device class) pairs already warned about: one warning per process each
_UNVERIFIED_WARNED: set[tuple[str, str]] = set()


def warn_unverified(backend: str, device_class: str) -> None:
    """Warn, once per process for each ``(backend, device_class)``, that ``backend`` runs
    on a GPU class where no recorded run (docs/benchmarks.md) has compared its results
    with the float64 oracle (:class:`UnverifiedBackendWarning`)."""
    key = (backend, device_class)
    if key in _UNVERIFIED_WARNED:
        return
    _UNVERIFIED_WARNED.add(key)
    warnings.warn(
        f"qsa_torch: the {backend} backend's numerics are unverified on {device_class} devices: "
        "no recorded run has compared its outputs and gradients with the float64 oracle "
        "there (docs/benchmarks.md). backend='auto' prefers verified backends.",
        UnverifiedBackendWarning,
        stacklevel=3,
    )


def normalize_routes(
    selected_token_ids: torch.Tensor, kv_length: int, *, sort: bool = False
) -> torch.Tensor:
    """Canonical routes: a new contiguous int32 tensor of the same shape.

    IDs outside ``[0, kv_length)`` (negative, past the end, huge int64) become -1.
    Of repeated IDs in a row the first (lowest slot) is kept and the others
    become -1. With ``sort=True`` each row is ascending with the -1 entries
    first; otherwise valid IDs keep their slots. No host synchronisation.
    """
    validate_routes(selected_token_ids)
    if not 0 < kv_length < 2**31:
        raise InvalidInput(f"kv_length must be in [1, 2**31), got {kv_length}")
    routes = selected_token_ids
    # compare in the input dtype: casting huge int64 to int32 first would wrap
    valid = (routes >= 0) & (routes < kv_length)
    ids = torch.where(valid, routes, torch.full_like(routes, -1)).to(torch.int32)
    ordered, order = torch.sort(ids, dim=-1, stable=True)
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[..., 1:] = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    ordered = ordered.masked_fill(repeat, -1)
    if sort:
        return torch.sort(ordered, dim=-1).values.contiguous()
    return torch.empty_like(ordered).scatter_(-1, order, ordered)


def membership_table(
    selected_token_ids: torch.Tensor, kv_length: int, *, dtype: torch.dtype = torch.bool
) -> torch.Tensor:
    """``[B, S_q, kv_length]`` table, 1 where the ID is a valid route of the row.

    Memory: ``B * S_q * kv_length`` elements of ``dtype`` (one byte for bool/uint8).
    """
    validate_routes(selected_token_ids)
    if selected_token_ids.dim() != 3:
        raise InvalidInput(
            f"selected_token_ids must have rank 3 [B, S_q, K], got shape {tuple(selected_token_ids.shape)}"
        )
    if kv_length < 1:
        raise InvalidInput(f"kv_length must be positive, got {kv_length}")
    b, s_q, _ = selected_token_ids.shape
    routes = selected_token_ids
    valid = (routes >= 0) & (routes < kv_length)
    # invalid IDs go to a spare column that is dropped afterwards
    ids = torch.where(valid, routes, torch.full_like(routes, kv_length)).long()
    table = torch.zeros(b, s_q, kv_length + 1, dtype=dtype, device=routes.device)
    table.scatter_(-1, ids, torch.ones_like(ids, dtype=dtype))
    return table[..., :kv_length].contiguous()


def to_torch_routes(
    problem: _layouts.RouteProblem,
    *,
    dtype: torch.dtype = torch.int64,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The problem's routes as a torch tensor.

    With ``dtype=torch.int32`` values outside int32 are first replaced by -1
    (both are padding), so the route set is unchanged.
    """
    routes = problem.routes
    if dtype == torch.int32:
        info = np.iinfo(np.int32)
        routes = np.where((routes < info.min) | (routes > info.max), -1, routes).astype(np.int32)
    return torch.from_numpy(np.ascontiguousarray(routes)).to(device=device, dtype=dtype)


def generate_problem(
    layout: str,
    route_family: str,
    *,
    seed: int,
    seq_len: int,
    dtype: torch.dtype = torch.int64,
    device: torch.device | str = "cpu",
    **kwargs,
) -> tuple[torch.Tensor, _layouts.RouteProblem]:
    """Routes of one layout and family as a tensor, with their description.

    Thin wrapper of :func:`qsa_common.layouts.make_problem` (same arguments):
    the routes equal ``qsa_jax.routes.generate_problem``'s for the same seed.
    """
    problem = _layouts.make_problem(layout, route_family, seed=seed, seq_len=seq_len, **kwargs)
    return to_torch_routes(problem, dtype=dtype, device=device), problem


def _host(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x


def check_routes(routes: torch.Tensor, *, causal: bool = True, documents: torch.Tensor | None = None,
                 kv_length: int | None = None, query_offset: int | None = None) -> _route_check.RouteReport:
    """Report out-of-range IDs (other than -1), routes to future tokens and routes crossing
    documents: :func:`qsa_common.route_check.check_routes` on the host copies of
    ``routes`` ``[B, S_q, K]`` and ``documents`` (per-token document ids ``[B, S_kv]`` or
    ``[S_kv]``). A debugging aid: it copies device data to the host (one synchronisation);
    the attention functions never need it (out-of-range IDs are padding there)."""
    return _route_check.check_routes(_host(routes), causal=causal, documents=_host(documents),
                                     kv_length=kv_length, query_offset=query_offset)
