"""``qsa_torch.sparse_gqa_attention``: one entry point that dispatches to a backend.

The function is registered as the ``torch.library`` custom op
``qsa::sparse_gqa_attention`` (with a fake implementation and autograd), so it
runs under ``torch.compile(fullgraph=True)`` as one opaque node and never
breaks the graph, whatever the backend does inside.

Backend choice (``backend="auto"``) happens in Python before any op runs:
:func:`candidate_backends` lists, per device class, the backends to try. Their
order is :data:`PREFERENCE` (fastest first, as measured), except that backends
whose numerics a recorded GPU run verified on this device class (:data:`VERIFIED`)
come first, then those verified on another GPU class, then those never verified
on a GPU; the torch reference ends every list. Backends whose
:func:`unsupported_reason` is not ``None`` for the inputs are skipped, each with
its reason logged on the ``"qsa_torch"`` logger (INFO the first time a reason is
seen, DEBUG afterwards). In eager mode, a backend whose forward raises
ImportError, NotImplementedError or ``torch.OutOfMemoryError`` is logged and the
next one runs (the reference always answers); under ``torch.compile`` the first
supported backend is traced and its errors propagate. A backend named explicitly
runs without fallback. Either way the op records the concrete backend, and the
backward uses that one: it never resolves ``"auto"`` a second time.

A backend running on a device class where it is not verified warns once per
process (:class:`qsa_torch.routes.UnverifiedBackendWarning`); on Blackwell (SM100)
that is every backend but the reference, and cuDNN has no verified class at all.

Backward cost: the Triton backend goes through a second op pair,
``qsa::triton_sparse_gqa_attention`` and its backward, whose forward returns the
output with the kernel's residuals (LSE and tile unions); the backward uses them,
so forward+backward costs what the backend's own autograd costs. Every other
backend goes through ``qsa::sparse_gqa_attention``, which saves only its inputs:
its backward op runs the same backend's forward again under autograd and asks
torch for the gradients (two forwards plus one backward; memory between the passes
is only the inputs).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from qsa_common.log_once import log_once
from qsa_triton.launch import interprets as _triton_interprets

from .routes import ProblemDims, validate_inputs, warn_unverified

__all__ = [
    "BACKENDS",
    "PREFERENCE",
    "VERIFIED",
    "candidate_backends",
    "device_class",
    "sparse_gqa_attention",
    "unsupported_reason",
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


@dataclass(frozen=True)
class _Backend:
    """Where a backend's public function lives (imported on first use)."""

    module: str
    function: str
    dtypes: tuple[torch.dtype, ...]
    deterministic_backward: bool


_HALF_AND_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS: dict[str, _Backend] = {
    "reference": _Backend("qsa_torch.reference", "reference_sparse_gqa_attention",
                          _HALF_AND_FLOAT + (torch.float64,), True),
    "flex": _Backend("qsa_torch.flex_qsa", "flex_sparse_gqa_attention", _HALF_AND_FLOAT, True),
    "fa4": _Backend("qsa_torch.fa4_qsa", "fa4_sparse_gqa_attention", (torch.bfloat16,), False),
    "cudnn": _Backend("qsa_torch.cudnn_qsa", "cudnn_sparse_gqa_attention", (torch.bfloat16,), False),
    "triton": _Backend("qsa_torch.triton_qsa", "triton_sparse_gqa_attention", _HALF_AND_FLOAT, True),
}

# Optional runtime of each backend, checked with find_spec (no import).
_RUNTIME = {"flex": "torch.nn.attention.flex_attention", "fa4": "flash_attn",
            "cudnn": "cudnn", "triton": "triton"}
_CUDNN_HEADS = ((24, 2), (12, 1))
_CUDNN_MAX_WIDTH = 2052

# Backends whose module or runtime failed to import, with the reason (not retried).
_BROKEN: dict[str, str] = {}
_LOGGED: set[str] = set()


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


def _find_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing or broken
        return False


# Whether each optional runtime is installed, looked up once here (find_spec imports
# nothing but parent packages, all already loaded): dynamo cannot trace importlib (a
# graph break in "auto" under torch.compile with torch 2.11), a dict it can.
_RUNTIME_PRESENT: dict[str, bool] = {runtime: _find_module(runtime) for runtime in _RUNTIME.values()}


def _has_module(name: str) -> bool:
    if name not in _RUNTIME_PRESENT:  # pragma: no cover - every runtime is looked up above
        _RUNTIME_PRESENT[name] = _find_module(name)
    return _RUNTIME_PRESENT[name]


def unsupported_reason(
    name: str,
    dims: ProblemDims,
    device: torch.device,
    dtype: torch.dtype,
    *,
    needs_grad: bool,
    route_format: str = "any",
) -> str | None:
    """Why backend ``name`` cannot run these inputs, or ``None`` if it can.

    Checks only what is known without touching device data: device kind and
    compute capability, dtype, head sizes, layout (S_q vs S_kv), route format
    promise, the optional runtime's presence, and deterministic-algorithm mode.
    """
    spec = BACKENDS[name]
    if name in _BROKEN:
        return _BROKEN[name]
    cls = device_class(device)
    if name == "fa4" and cls != "sm90":
        return "needs an SM90 (Hopper) GPU"
    if name == "cudnn" and cls != "sm100":
        return "needs an SM100/SM103 (Blackwell) GPU"
    if name == "cudnn" and route_format != "qsa":
        return "accepts QSA-format routes only (pass route_format='qsa' to allow it)"
    if name == "triton" and cls == "cpu" and not _triton_interprets():
        return "needs a CUDA device (or TRITON_INTERPRET=1 set before its kernels are imported)"
    if name == "flex" and cls == "cpu" and needs_grad:
        return "FlexAttention has no CPU backward"
    if dtype not in spec.dtypes:
        return f"computes in {', '.join(str(d) for d in spec.dtypes)} only, got {dtype}"
    runtime = _RUNTIME.get(name)
    if runtime is not None and not _has_module(runtime):
        return f"optional runtime {runtime!r} is not installed"
    if needs_grad and not spec.deterministic_backward and torch.are_deterministic_algorithms_enabled():
        return "its backward is not deterministic and deterministic algorithms are on"
    if name == "triton" and dims.head_dim > 256:
        return f"head dim must be <= 256, got {dims.head_dim}"
    if name == "fa4" and dims.head_dim != 256:
        return f"head dim must be 256, got {dims.head_dim}"
    if name == "cudnn":
        heads = (dims.query_heads, dims.kv_heads)
        if heads not in _CUDNN_HEADS or dims.head_dim != 256:
            return f"needs (Hq, Hkv) in {_CUDNN_HEADS} and D = 256, got {heads} and D = {dims.head_dim}"
        if dims.routes_per_query > _CUDNN_MAX_WIDTH:
            return f"route width must be <= {_CUDNN_MAX_WIDTH}, got {dims.routes_per_query}"
        if dims.query_length != dims.kv_length:
            return "no context-parallel layout (S_q != S_kv)"
    return None


def candidate_backends(device: torch.device) -> tuple[str, ...]:
    """The backends ``"auto"`` tries on ``device``, in order (reference last).

    :data:`PREFERENCE`'s row, reordered by verification (:data:`VERIFIED`): verified on
    this device class, then verified on another GPU class, then never verified on a GPU.
    """
    cls = device_class(device)
    names = [name for name in PREFERENCE[cls] if name != "reference"]
    ordered = [name for tier in (0, 1, 2) for name in names if _verified_tier(name, cls) == tier]
    return tuple(dict.fromkeys(ordered + ["reference"]))


def _load(name: str) -> Callable[..., torch.Tensor]:
    spec = BACKENDS[name]
    try:
        module = importlib.import_module(spec.module)
        return getattr(module, spec.function)
    except ImportError as err:
        _BROKEN[name] = f"import of {spec.module} failed: {err}"
        raise


def _prepare(name: str, device: torch.device) -> Callable[..., torch.Tensor]:
    """Backend ``name``'s function; warns once if it is unverified on ``device``'s class."""
    cls = device_class(device)
    if not _verified_on(name, cls):
        warn_unverified(name, cls)
    return _load(name)


# what "auto" falls back on when a backend raises it
_FALLBACK_ERRORS = (ImportError, NotImplementedError, torch.OutOfMemoryError)


def _note_failure(name: str, err: Exception) -> None:
    """Log that backend ``name`` raised ``err`` under "auto"; an ImportError marks it broken."""
    if isinstance(err, ImportError):  # a missing runtime stays missing: do not retry
        _BROKEN[name] = f"its runtime failed to import: {err}"
    _log(f"sparse_gqa_attention: backend {name!r} failed ({type(err).__name__}: {err}); "
         "falling back", logging.WARNING)


@contextlib.contextmanager
def _autograd_enabled() -> Iterator[None]:
    """Turn autograd back on inside a custom op's implementation.

    The dispatcher runs op implementations below the Autograd keys (they are in
    the thread's excluded key set), so tensors created there never record a
    graph. The backward op recomputes the forward and needs that graph.
    """
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
            torch._C.DispatchKey.AutogradNestedTensor)
    with contextlib.ExitStack() as stack:
        for key in keys:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        stack.enter_context(torch.enable_grad())
        yield


@torch.library.custom_op("qsa::sparse_gqa_attention", mutates_args=())
def _forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float,
    backend: str,
) -> torch.Tensor:
    """Backend ``backend`` (a name of :data:`BACKENDS`, never "auto") on the inputs."""
    fn = _prepare(backend, query.device)
    out = fn(query, key, value, selected_token_ids, softmax_scale).contiguous()
    logger.debug("sparse_gqa_attention: ran backend %r", backend)
    return out


@_forward_op.register_fake
def _forward_fake(query, key, value, selected_token_ids, softmax_scale, backend):
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of backend ``backend`` (the forward's): its forward again under autograd."""
    fn = _prepare(backend, query.device)
    with _autograd_enabled():
        leaves = [t.detach().requires_grad_() for t in (query, key, value)]
        out = fn(*leaves, selected_token_ids, softmax_scale)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    logger.debug("sparse_gqa_attention: ran backend %r (backward)", backend)
    return tuple(
        torch.zeros_like(t) if g is None else g.detach().contiguous()
        for g, t in zip(grads, (query, key, value))
    )


@_backward_op.register_fake
def _backward_fake(grad_out, query, key, value, selected_token_ids, softmax_scale, backend):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, routes, scale, backend = inputs
    ctx.save_for_backward(query, key, value, routes)
    ctx.scale, ctx.backend = scale, backend


def _backward(ctx, grad_out):
    query, key, value, routes = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, query, key, value, routes, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _first_supported(device: torch.device, dtype: torch.dtype, sizes: tuple, needs_grad: bool,
                     route_format: str) -> str:
    """The backend ``"auto"`` would try first (static checks only). ``sizes`` =
    (B, S_q, S_kv, Hq, Hkv, D, K). Under torch.compile dynamo evaluates it while
    tracing (no graph break: tests/test_torch_api.py checks it)."""
    return _supported(device, dtype, sizes, needs_grad, route_format, log=False)[0]


def _supported(device: torch.device, dtype: torch.dtype, sizes: tuple, needs_grad: bool,
               route_format: str, *, log: bool) -> list[str]:
    """The backends ``"auto"`` may run, in order (static checks; the reference ends it)."""
    dims = ProblemDims(*sizes)
    names = []
    for name in candidate_backends(device):
        reason = unsupported_reason(name, dims, device, dtype, needs_grad=needs_grad,
                                    route_format=route_format)
        if reason is None:
            names.append(name)
        elif log:
            _log(f"sparse_gqa_attention: skipping backend {name!r}: {reason}")
    return names or ["reference"]


def _call(name: str, query, key, value, routes, scale: float) -> torch.Tensor:
    if name == "triton":  # its own op pair keeps LSE and unions for the backward
        from . import triton_qsa

        return triton_qsa.checked_attention(query, key, value, routes, scale)
    return _forward_op(query, key, value, routes, scale, name)


def sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    backend: str = "auto",
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
        backend: ``"auto"`` (see the module docstring, :data:`PREFERENCE` and
            :data:`VERIFIED`) or one of ``"reference"``, ``"flex"``, ``"fa4"``,
            ``"cudnn"``, ``"triton"``.
        route_format: ``"qsa"`` promises that the routes follow the QSA route format
            (four-token blocks plus the causal tail, docs/contract.md), which lets ``"auto"``
            consider the cuDNN backend (it gives wrong answers for other route sets);
            ``"any"`` (default) makes no promise.

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype; rows without routes are exactly zero
        and add nothing to any gradient. Differentiable in query, key and value,
        through the backend that ran the forward.

    Raises:
        ValueError: unknown ``backend`` / ``route_format``, or the contract's shape,
            device and scale checks.
        TypeError: the contract's dtype checks.
        RuntimeError: anything the explicitly named backend raises (RuntimeError for an
            unsupported GPU, ImportError for a missing runtime, ...); under
            ``torch.compile``, also what the backend ``"auto"`` chose raises.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    if route_format not in ROUTE_FORMATS:
        raise ValueError(f"route_format must be one of {ROUTE_FORMATS}, got {route_format!r}")
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    args = (query, key, value, selected_token_ids, checked.scale)
    if backend != "auto":
        return _call(backend, *args)
    needs_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    d = checked.dims
    sizes = (d.batch, d.query_length, d.kv_length, d.query_heads, d.kv_heads, d.head_dim,
             d.routes_per_query)
    if torch.compiler.is_compiling():  # one traced choice; its errors propagate
        return _call(_first_supported(query.device, query.dtype, sizes, needs_grad, route_format),
                     *args)
    names = _supported(query.device, query.dtype, sizes, needs_grad, route_format, log=True)
    for name in names[:-1]:
        try:
            return _call(name, *args)
        except _FALLBACK_ERRORS as err:
            _note_failure(name, err)
    return _call(names[-1], *args)
