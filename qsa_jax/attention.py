"""``qsa_jax.sparse_gqa_attention``: one entry point, implementations by name.

``implementation`` may be a name or a sequence of names (``"reference"`` is another
name of ``"xla"``, the gather reference; ``"auto"`` means ``None``). ``None`` means
:data:`GPU_DEFAULT` when the inputs live on GPUs (the ``qsa_triton`` kernels through
jax-triton, JAX's own Pallas kernels where jax-triton is absent, and the reference for
what the kernels decline, e.g. D > 256 or float64) and ``"xla"`` elsewhere. Where the
inputs live: a concrete array's devices; inside ``jax.jit`` (tracers) and for host
arrays, the platform of ``jax.default_device`` where one is set, else the default
backend's.

Fallback rules (the same as ``qsa_torch.sparse_gqa_attention(backend="auto")``'s):
each implementation's module states its limits in ``supports(...)``, asked before it
runs; an implementation that declines, there or while it runs, with a
:class:`~qsa_common.errors.BackendDeclined` (a plain ``ImportError`` counts as
:class:`~qsa_common.errors.MissingRuntime`) is skipped and the next is tried. Bad
input (:class:`~qsa_common.errors.InvalidInput`,
:class:`~qsa_common.errors.InvalidDtype`) is raised before any implementation runs,
and any other error, out-of-memory (XLA's ``RESOURCE_EXHAUSTED``) included, propagates
at once: no fallback hides it. When every candidate declined:
:class:`~qsa_common.errors.NoBackendAvailable` with every reason; a single named
implementation raises its own decline.

Each implementation that declines while another is left to try is logged on the
``"qsa_jax"`` logger with its reason: a missing runtime at WARNING (e.g. no jax-triton,
so the GPU default runs the slower Pallas kernels), a refusal of the inputs at INFO,
each message at that level the first time and at DEBUG afterwards. Under ``jax.jit``
this happens when the call is traced.

``deterministic=True`` asks for bitwise-reproducible gradients. ``"triton"`` gives them
(int64 fixed-point dK/dV, ``qsa_triton.fixed_point``); ``"pallas"`` declines (its dK/dV
are fp32 atomics); ``"xla"`` is deterministic on CPU, and on GPUs only with
``--xla_gpu_deterministic_ops=true`` or ``--xla_gpu_exclude_nondeterministic_ops=true``
in ``XLA_FLAGS``. ``deterministic=None`` (the default) means True exactly when
``XLA_FLAGS`` holds one of those flags (:func:`qsa_jax.routes.resolve_deterministic`),
as torch's ``None`` follows ``torch.use_deterministic_algorithms``.

int64 routes: pass them as numpy arrays (they are checked on the host, so IDs
past int32 stay padding). A jax array, or a ``jax.jit`` argument, is already
int32 unless x64 is enabled: JAX itself wraps huge int64 IDs when converting.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from types import ModuleType

from qsa_common.errors import (
    BackendDeclined,
    InvalidDtype,
    InvalidInput,
    MissingRuntime,
    UnsupportedOption,
    as_declined,
    no_backend_available,
)
from qsa_common.log_once import log_once

from .routes import (
    DETERMINISTIC_XLA_FLAGS,
    on_gpu,
    prepare_routes,
    resolve_deterministic,
    validate_inputs,
    xla_gpu_deterministic,
)
from .sharding import partitioned

__all__ = ["sparse_gqa_attention", "IMPLEMENTATIONS", "ALIASES", "GPU_DEFAULT", "DETERMINISTIC_XLA_FLAGS",
           "xla_gpu_deterministic"]


logger = logging.getLogger("qsa_jax")
_LOGGED: set[str] = set()

# name -> the module holding the implementation and its ``supports``
IMPLEMENTATIONS: dict[str, str] = {"xla": "qsa_jax.xla_reference", "pallas": "qsa_jax.pallas_qsa",
                                   "triton": "qsa_jax.triton_qsa"}
# other spellings accepted for ``implementation`` (docs/api-names.md)
ALIASES: dict[str, str | None] = {"reference": "xla", "auto": None}
# The order tried on GPUs when no implementation is named.
GPU_DEFAULT: tuple[str, ...] = ("triton", "pallas", "xla")


def _log_decline(name: str, err: BackendDeclined) -> None:
    """Log that implementation ``name`` declined with ``err`` and the next is tried:
    WARNING (a missing runtime) or INFO the first time a message is seen, DEBUG afterwards."""
    message = f"sparse_gqa_attention: implementation {name!r} declined ({type(err).__name__}: {err}); trying the next"
    log_once(logger, _LOGGED, message, logging.WARNING if isinstance(err, MissingRuntime) else logging.INFO)


def _module(name: str) -> ModuleType:
    """The module of implementation ``name`` (imported on first use).

    Raises:
        MissingRuntime: the module or a package it needs failed to import.
    """
    try:
        return importlib.import_module(IMPLEMENTATIONS[name])
    except ImportError as err:
        raise MissingRuntime(f"{IMPLEMENTATIONS[name]} failed to import: {err}") from err


# One module-level runner per implementation (qsa_jax.sharding passes it as a static
# argument of the partitioned call); each takes the already-validated inputs.
def _run_xla(query, key, value, routes, scale, *, block_sizes, interpret, deterministic):
    del block_sizes, interpret, deterministic  # supports() declined what the reference cannot do
    return _module("xla").reference_sparse_gqa_attention(query, key, value, routes, scale)


def _run_pallas(query, key, value, routes, scale, *, block_sizes, interpret, deterministic):
    return _module("pallas").pallas_sparse_gqa_attention(query, key, value, routes, scale, block_sizes=block_sizes,
                                                         interpret=interpret, deterministic=deterministic)


def _run_triton(query, key, value, routes, scale, *, block_sizes, interpret, deterministic):
    del interpret  # refused before the call: the jax-triton launch has no interpret mode
    return _module("triton").checked_attention(query, key, value, routes, scale, block_sizes=block_sizes,
                                               deterministic=deterministic)


_RUNNERS = {"xla": _run_xla, "pallas": _run_pallas, "triton": _run_triton}


def _implementation_names(implementation) -> tuple[str, ...] | None:
    """``implementation`` (None, a name or a sequence of names) as a tuple of canonical
    names, or None for automatic choice; every name checked before any is tried."""
    if implementation is None:
        return None
    if isinstance(implementation, str):
        names = (implementation,)
    elif isinstance(implementation, Sequence) and not isinstance(implementation, (bytes, bytearray)):
        names = tuple(implementation)
    else:
        raise InvalidDtype(f"implementation must be None, a name or a sequence of names, got {implementation!r}")
    known = sorted(IMPLEMENTATIONS) + sorted(ALIASES)
    if not names:
        raise InvalidInput(f"implementation names no implementation; expected some of {known}")
    for name in names:
        if not isinstance(name, str) or (name not in IMPLEMENTATIONS and name not in ALIASES):
            raise InvalidInput(f"unknown implementation {name!r}; expected one of {known}")
    if names == ("auto",):
        return None
    if "auto" in names:
        raise InvalidInput("implementation 'auto' cannot be part of a sequence")
    return tuple(dict.fromkeys(ALIASES.get(name, name) for name in names))


def sparse_gqa_attention(
    query,
    key,
    value,
    selected_token_ids,
    softmax_scale: float | None = None,
    *,
    implementation: str | Sequence[str] | None = None,
    deterministic: bool | None = None,
    block_sizes=None,
    interpret: bool | None = None,
):
    """Route-sparse GQA: each query row attends exactly to its routes.

    Args:
        query: ``[B, S_q, Hq, D]`` (bf16, f16, f32; f64 on the reference).
        key, value: ``[B, S_kv, Hkv, D]``, same dtype; Hq a multiple of Hkv.
        selected_token_ids: ``[B, S_q, K]`` int32/int64 IDs in global K/V
            coordinates; IDs outside ``[0, S_kv)`` are padding, duplicates count once.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        implementation: ``"triton"`` (the ``qsa_triton`` kernels through jax-triton,
            CUDA only), ``"pallas"`` (JAX's Pallas kernels), ``"xla"`` (the gather
            reference; also ``"reference"``), a sequence of them tried in order, or
            ``None`` / ``"auto"`` (module docstring).
        deterministic: bitwise-reproducible gradients (dq, dk, dv) from run to run;
            implementations that cannot promise them decline. None: True exactly when
            ``XLA_FLAGS`` asks XLA:GPU for deterministic ops.
        block_sizes: a ``qsa_triton.BlockSizes`` for ``"triton"``, a
            ``qsa_jax.pallas_qsa.BlockSizes`` for ``"pallas"`` (an implementation
            given the other class declines with UnsupportedOption).
        interpret: run the Pallas kernels in interpret mode (CPU); default: on
            when the inputs do not live on GPUs. ``"triton"`` declines it.

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype. Empty rows are exactly zero and
        add nothing to any gradient.

    Raises:
        InvalidInput / InvalidDtype: (ValueError / TypeError) bad shapes, dtypes or
            scale (:mod:`qsa_common.contract`); an unknown or empty ``implementation``;
            a non-bool ``interpret`` or ``deterministic``.
        BackendDeclined: the one named implementation declined (its subclass says why).
        NoBackendAvailable: every candidate declined; ``reasons`` holds each decline.
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    deterministic = resolve_deterministic(deterministic)
    if interpret is not None and not isinstance(interpret, bool):
        raise InvalidDtype(f"interpret must be a bool or None, got {interpret!r}")
    names = _implementation_names(implementation)
    explicit = names is not None and len(names) == 1
    if names is None:
        names = GPU_DEFAULT if on_gpu(query) else ("xla",)
    routes = prepare_routes(selected_token_ids)
    reasons: dict[str, BackendDeclined] = {}
    for position, name in enumerate(names):
        try:
            if name == "triton" and interpret:
                raise UnsupportedOption("the jax-triton launch has no interpret mode (use implementation='pallas')")
            module = _module(name)
            declined = module.supports(query, key, value, routes, softmax_scale=checked.scale,
                                       deterministic=deterministic)
            if declined is not None:
                raise declined
            return partitioned(  # the call, partitioned by the inputs' shardings (qsa_jax.sharding)
                _RUNNERS[name], query, key, value, routes, checked.scale,
                block_sizes=block_sizes, interpret=interpret, deterministic=deterministic,
            )
        except (BackendDeclined, ImportError) as err:
            declined = as_declined(err)
            if explicit:
                if declined is err:
                    raise
                raise declined from err
            reasons[name] = declined
            if position + 1 < len(names):
                _log_decline(name, declined)
    raise no_backend_available(reasons, "implementation")
