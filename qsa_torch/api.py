"""``qsa_torch.sparse_gqa_attention``: one entry point that dispatches to a backend.

The function is registered as the ``torch.library`` custom op
``qsa::sparse_gqa_attention`` (with a fake implementation and autograd), so it
runs under ``torch.compile(fullgraph=True)`` as one opaque node and never
breaks the graph, whatever the backend does inside.

Backend choice (``backend="auto"``, or ``None``) happens in Python before any op runs:
:func:`candidate_backends` lists, per device class, the backends to try. Their
order is :data:`PREFERENCE` (fastest first, as measured), except that backends
whose numerics a recorded GPU run verified on this device class (:data:`VERIFIED`)
come first, then those verified on another GPU class, then those never verified
on a GPU; the torch reference ends every list. Each backend module states its own
limits in ``supports(query, key, value, selected_token_ids, *, softmax_scale,
deterministic)``, which returns the :class:`~qsa_common.errors.BackendDeclined` it
would raise, or None; the dispatcher asks it and keeps no copy of any limit.

Fallback rules (the same as ``qsa_jax.sparse_gqa_attention(implementation=None)``'s):
a backend that declines, in ``supports`` or while it runs, with a
:class:`~qsa_common.errors.BackendDeclined` (a plain ``ImportError`` counts as
:class:`~qsa_common.errors.MissingRuntime`, and marks the backend broken for the
process) is logged on the ``"qsa_torch"`` logger (INFO the first time a reason is
seen, DEBUG afterwards; WARNING for a failure while running) and the next one is
tried. Bad input (:class:`~qsa_common.errors.InvalidInput`,
:class:`~qsa_common.errors.InvalidDtype`) is raised before any backend runs, and any
other error, ``torch.OutOfMemoryError`` included, propagates at once: a fallback would
hide the size of the problem. When every candidate declined:
:class:`~qsa_common.errors.NoBackendAvailable` with every reason. Under
``torch.compile`` the first backend whose ``supports`` accepts is traced and its errors
propagate. A backend named explicitly raises its own decline. Either way the op records
the concrete backend, and the backward uses that one: it never resolves ``"auto"`` a
second time.

A backend running on a device class where it is not verified warns once per
process (:class:`qsa_torch.routes.UnverifiedBackendWarning`); on Blackwell (SM100)
that is every backend but the reference, and cuDNN has no verified class at all.

Backward cost: the Triton backend goes through a second op pair,
``qsa::triton_sparse_gqa_attention`` and its backward, whose forward returns the
output with the kernel's residuals (LSE and tile unions); the backward uses them,
so forward+backward costs what the backend's own autograd costs. Every other
backend (and Triton when ``deterministic`` differs from
``torch.are_deterministic_algorithms_enabled()``, which that pair's backward reads)
goes through ``qsa::sparse_gqa_attention``, which saves only its inputs: its backward
op runs the same backend's forward again under autograd and asks torch for the
gradients (two forwards plus one backward; memory between the passes is only the
inputs).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from qsa_common.errors import BackendDeclined, InvalidInput, MissingRuntime, as_declined, no_backend_available
from qsa_common.log_once import log_once

from ._private_api import autograd_enabled
from .routes import resolve_deterministic, validate_inputs, warn_unverified

__all__ = [
    "ALIASES",
    "BACKENDS",
    "PREFERENCE",
    "VERIFIED",
    "backend_declines",
    "candidate_backends",
    "device_class",
    "sparse_gqa_attention",
]

logger = logging.getLogger("qsa_torch")

# Preference per device class, fastest first. Update from measurements
# (docs/benchmarks.md); "reference" is appended to every list.
PREFERENCE: dict[str, tuple[str, ...]] = {
    # SM100 / SM103 (Blackwell): nothing is verified there yet; cuDNN, whose numerics were
    # never checked on any GPU, goes behind the portable kernels (see VERIFIED).
    "sm100": ("triton", "flex", "cudnn"),
    # Hopper: ordered by forward+backward time on the H200 (docs/benchmarks.md)
    "sm90": ("triton", "fa4", "flex"),
    "cuda": ("triton", "flex"),  # other CUDA GPUs
    "cpu": ("reference",),  # CPU and any other device
}

# Device classes on which a recorded run compared each backend's outputs and gradients
# with the float64 oracle (docs/benchmarks.md for the GPUs; CPU CI for "cpu"). None: any
# device (plain torch ops). Add a class only with the run that verified it.
VERIFIED: dict[str, frozenset[str] | None] = {
    "reference": None,
    "triton": frozenset({"cpu", "sm90"}),
    "flex": frozenset({"cpu", "sm90"}),
    "fa4": frozenset({"sm90"}),
    "cudnn": frozenset(),
}

ROUTE_FORMATS = ("any", "qsa")
# other spellings accepted for ``backend`` (docs/api-names.md)
ALIASES: dict[str | None, str] = {None: "auto"}


@dataclass(frozen=True)
class _Backend:
    """Where a backend lives: its module (with ``supports``) and public function."""

    module: str
    function: str
    takes_deterministic: bool = False  # the function has a ``deterministic`` argument


BACKENDS: dict[str, _Backend] = {
    "reference": _Backend("qsa_torch.reference", "reference_sparse_gqa_attention"),
    "flex": _Backend("qsa_torch.flex_qsa", "flex_sparse_gqa_attention"),
    "fa4": _Backend("qsa_torch.fa4_qsa", "fa4_sparse_gqa_attention"),
    "cudnn": _Backend("qsa_torch.cudnn_qsa", "cudnn_sparse_gqa_attention"),
    "triton": _Backend("qsa_torch.triton_qsa", "triton_sparse_gqa_attention", True),
}

# Backends whose runtime failed to import or load, with the decline (not retried by "auto").
_BROKEN: dict[str, BackendDeclined] = {}
_LOGGED: set[str] = set()
# Imported backend modules: filled eagerly below for the built-in backends, so that
# dynamo, tracing "auto", reads a dict instead of tracing importlib.
_MODULES: dict[str, ModuleType] = {}


def _log(message: str, level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` the first time, at DEBUG afterwards."""
    log_once(logger, _LOGGED, message, level)


def device_class(device: torch.device) -> str:
    """The :data:`PREFERENCE` row of ``device``: "sm100", "sm90", "cuda" or "cpu"."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) in ((10, 0), (10, 3)):
        return "sm100"
    if major == 9:
        return "sm90"
    return "cuda"


def _verified_on(name: str, cls: str) -> bool:
    """Whether a recorded run verified backend ``name`` on device class ``cls``."""
    classes = VERIFIED.get(name, frozenset())
    return classes is None or cls in classes


def _verified_tier(name: str, cls: str) -> int:
    """0: verified on ``cls``; 1: verified on another GPU class; 2: on no GPU class."""
    if _verified_on(name, cls):
        return 0
    classes = VERIFIED.get(name, frozenset())
    return 1 if any(c != "cpu" for c in classes) else 2


def candidate_backends(device: torch.device) -> tuple[str, ...]:
    """The backends ``"auto"`` tries on ``device``, in order (reference last).

    :data:`PREFERENCE`'s row, reordered by verification (:data:`VERIFIED`): verified on
    this device class, then verified on another GPU class, then never verified on a GPU.
    """
    cls = device_class(device)
    names = [name for name in PREFERENCE[cls] if name != "reference"]
    ordered = [name for tier in (0, 1, 2) for name in names if _verified_tier(name, cls) == tier]
    return tuple(dict.fromkeys(ordered + ["reference"]))


def _module(name: str) -> ModuleType:
    """Backend ``name``'s module (imported on first use).

    Raises:
        MissingRuntime: the module failed to import.
    """
    module = _MODULES.get(name)
    if module is None:
        spec = BACKENDS[name]
        try:
            module = importlib.import_module(spec.module)
        except ImportError as err:
            raise MissingRuntime(f"import of {spec.module} failed: {err}") from err
        _MODULES[name] = module
    return module


for _name in BACKENDS:  # the built-in backends import no optional runtime at import
    _module(_name)
del _name


def backend_declines(name: str, query, key, value, selected_token_ids, *, softmax_scale=None,
                     deterministic: bool = False, route_format: str = "any") -> BackendDeclined | None:
    """Why backend ``name`` declines these (validated) inputs under ``"auto"``, or None:
    a runtime that failed before, a route format the caller did not promise (the
    module's ``ROUTE_FORMAT``), or what the module's ``supports`` returns. Reads
    no device data."""
    if name in _BROKEN:
        return _BROKEN[name]
    module = _module(name)
    needed = getattr(module, "ROUTE_FORMAT", "any")
    if needed != "any" and route_format != needed:
        return BackendDeclined(f"accepts {needed!r}-format routes only (pass route_format={needed!r} to allow it)")
    return module.supports(query, key, value, selected_token_ids, softmax_scale=softmax_scale,
                           deterministic=deterministic)


def _prepare(name: str, device: torch.device) -> Callable[..., torch.Tensor]:
    """Backend ``name``'s function; warns once if it is unverified on ``device``'s class."""
    cls = device_class(device)
    if not _verified_on(name, cls):
        warn_unverified(name, cls)
    spec = BACKENDS[name]
    return getattr(_module(name), spec.function)


def _bound(name: str, device: torch.device, deterministic: bool) -> Callable[..., torch.Tensor]:
    fn = _prepare(name, device)
    if BACKENDS[name].takes_deterministic:
        return lambda *args: fn(*args, deterministic=deterministic)
    return fn


@torch.library.custom_op("qsa::sparse_gqa_attention", mutates_args=())
def _forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float,
    backend: str,
    deterministic: bool,
) -> torch.Tensor:
    """Backend ``backend`` (a name of :data:`BACKENDS`, never "auto") on the inputs."""
    fn = _bound(backend, query.device, deterministic)
    out = fn(query, key, value, selected_token_ids, softmax_scale).contiguous()
    logger.debug("sparse_gqa_attention: ran backend %r", backend)
    return out


@_forward_op.register_fake
def _forward_fake(query, key, value, selected_token_ids, softmax_scale, backend, deterministic):
    return query.new_empty(query.shape)


@torch.library.custom_op("qsa::sparse_gqa_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float,
    backend: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of backend ``backend`` (the forward's): its forward again under autograd."""
    fn = _bound(backend, query.device, deterministic)
    with autograd_enabled():
        leaves = [t.detach().requires_grad_() for t in (query, key, value)]
        out = fn(*leaves, selected_token_ids, softmax_scale)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    logger.debug("sparse_gqa_attention: ran backend %r (backward)", backend)
    return tuple(
        torch.zeros_like(t) if g is None else g.detach().contiguous()
        for g, t in zip(grads, (query, key, value))
    )


@_backward_op.register_fake
def _backward_fake(grad_out, query, key, value, selected_token_ids, softmax_scale, backend, deterministic):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, routes, scale, backend, deterministic = inputs
    ctx.save_for_backward(query, key, value, routes)
    ctx.scale, ctx.backend, ctx.deterministic = scale, backend, deterministic


def _backward(ctx, grad_out):
    query, key, value, routes = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, query, key, value, routes, ctx.scale, ctx.backend, ctx.deterministic)
    return dq, dk, dv, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _candidates(query, key, value, routes, scale: float, deterministic: bool, route_format: str,
                *, log: bool) -> tuple[list[str], dict[str, BackendDeclined]]:
    """The backends ``"auto"`` may run, in order, and the declines of the others."""
    names, reasons = [], {}
    for name in candidate_backends(query.device):
        declined = backend_declines(name, query, key, value, routes, softmax_scale=scale,
                                    deterministic=deterministic, route_format=route_format)
        if declined is None:
            names.append(name)
        else:
            reasons[name] = declined
            if log:
                _log(f"sparse_gqa_attention: skipping backend {name!r}: {declined}")
    return names, reasons


def _call(name: str, query, key, value, routes, scale: float, deterministic: bool) -> torch.Tensor:
    if name == "triton":  # its own op pair keeps LSE and unions for the backward
        from . import triton_qsa

        return triton_qsa.checked_attention(query, key, value, routes, scale, deterministic=deterministic)
    return _forward_op(query, key, value, routes, scale, name, deterministic)


def sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    backend: str | None = "auto",
    deterministic: bool | None = None,
    route_format: str = "any",
) -> torch.Tensor:
    """Route-sparse GQA through the best available backend (``qsa::sparse_gqa_attention``).

    Args:
        query: ``[B, S_q, Hq, D]`` float tensor.
        key, value: ``[B, S_kv, Hkv, D]``, same dtype and device; Hq % Hkv == 0.
        selected_token_ids: ``[B, S_q, K]`` signed int32/int64 IDs into ``[0, S_kv)``
            (global K/V coordinates); anything else is padding, duplicates count once.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``; passed to the op
            as a float.
        backend: ``"auto"`` or ``None`` (see the module docstring, :data:`PREFERENCE`
            and :data:`VERIFIED`) or one of ``"reference"``, ``"flex"``, ``"fa4"``,
            ``"cudnn"``, ``"triton"``.
        deterministic: bitwise-reproducible gradients from run to run; backends whose
            backward cannot give them decline. None (default) follows
            ``torch.are_deterministic_algorithms_enabled()``.
        route_format: ``"qsa"`` promises that the routes follow the QSA route format
            (four-token blocks plus the causal tail, docs/contract.md), which lets ``"auto"``
            consider the cuDNN backend (it gives wrong answers for other route sets);
            ``"any"`` (default) makes no promise.

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype; rows without routes are exactly zero
        and add nothing to any gradient. Differentiable in query, key and value,
        through the backend that ran the forward.

    Raises:
        InvalidInput / InvalidDtype: (ValueError / TypeError) the contract's checks
            (:mod:`qsa_common.contract`); an unknown ``backend`` / ``route_format``; a
            ``deterministic`` neither bool nor None.
        BackendDeclined: the explicitly named backend declined (its subclass says why).
        NoBackendAvailable: every ``"auto"`` candidate declined; ``reasons`` holds each.
        Exception: anything else a backend raises propagates unchanged
            (``torch.OutOfMemoryError`` included: no fallback after it).
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    deterministic = resolve_deterministic(deterministic)
    backend = ALIASES.get(backend, backend)
    if backend != "auto" and backend not in BACKENDS:
        raise InvalidInput(f"backend must be 'auto', None or one of {sorted(BACKENDS)}, got {backend!r}")
    if route_format not in ROUTE_FORMATS:
        raise InvalidInput(f"route_format must be one of {ROUTE_FORMATS}, got {route_format!r}")
    args = (query, key, value, selected_token_ids, checked.scale, deterministic)
    if backend != "auto":
        declined = _module(backend).supports(query, key, value, selected_token_ids, softmax_scale=checked.scale,
                                             deterministic=deterministic)
        if declined is not None:
            raise declined
        try:
            return _call(backend, *args)
        except ImportError as err:  # read as MissingRuntime, as under "auto"
            if isinstance(err, MissingRuntime):
                raise
            raise as_declined(err) from err
    names, reasons = _candidates(*args, route_format, log=not torch.compiler.is_compiling())
    if torch.compiler.is_compiling():  # one traced choice; its errors propagate
        if not names:
            raise no_backend_available(reasons)
        return _call(names[0], *args)
    for name in names:
        try:
            return _call(name, *args)
        except (BackendDeclined, ImportError) as err:
            declined = as_declined(err)
            reasons[name] = declined
            if isinstance(declined, MissingRuntime):  # a missing runtime stays missing: do not retry
                _BROKEN[name] = declined
            _log(f"sparse_gqa_attention: backend {name!r} failed ({type(err).__name__}: {err}); "
                 "falling back", logging.WARNING)
    raise no_backend_available(reasons)
