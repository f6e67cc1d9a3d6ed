"""``qsa_jax.sparse_gqa_attention``: one entry point, implementations by name.

``implementation`` may be a name or a sequence of names; the first that does
not raise ``NotImplementedError`` or ``ImportError`` for the given inputs runs,
otherwise all the reasons are raised together (as ``ImportError`` when every one
was a missing runtime, else ``NotImplementedError``). ``None`` means
:data:`GPU_DEFAULT` when the inputs live on GPUs (the ``qsa_triton`` kernels
through jax-triton, JAX's own Pallas kernels where jax-triton is absent, and the
reference for what the kernels refuse, e.g. D > 256 or float64) and ``"xla"``
elsewhere. Where the inputs live: a concrete array's devices; inside ``jax.jit`` (tracers)
and for host arrays, the platform of ``jax.default_device`` where one is set, else the
default backend's (so a jitted call on CPU arrays on a host with GPUs picks the GPU path
unless ``jax.default_device`` says otherwise).

int64 routes: pass them as numpy arrays (they are checked on the host, so IDs
past int32 stay padding). A jax array, or a ``jax.jit`` argument, is already
int32 unless x64 is enabled: JAX itself wraps huge int64 IDs when converting.

Each implementation that declines while another is left to try is logged on the
``"qsa_jax"`` logger with its reason, as ``qsa_torch`` logs its skipped backends: a missing
runtime (``ImportError``, e.g. no jax-triton, so the GPU default runs the slower Pallas
kernels) at WARNING, a refusal of the inputs at INFO, each message at that level the
first time and at DEBUG afterwards. Under ``jax.jit`` this happens when the call is traced.

``deterministic=True`` asks for bitwise-reproducible gradients. ``"triton"`` gives them
(int64 fixed-point dK/dV, ``qsa_triton.fixed_point``); ``"pallas"`` declines (its dK/dV
are fp32 atomics); ``"xla"`` is deterministic on CPU, while on GPUs the scatter-add of
its gather's gradient is not unless XLA runs with ``--xla_gpu_deterministic_ops=true``
or ``--xla_gpu_exclude_nondeterministic_ops=true`` in ``XLA_FLAGS``: without one of
them (read from the environment at the call; XLA itself reads it once, when its GPU
backend starts) it declines on GPUs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from qsa_common.log_once import log_once

from .routes import on_gpu, prepare_routes, validate_inputs
from .sharding import partitioned
from .xla_reference import reference_sparse_gqa_attention

__all__ = ["sparse_gqa_attention", "IMPLEMENTATIONS", "GPU_DEFAULT", "DETERMINISTIC_XLA_FLAGS",
           "xla_gpu_deterministic"]


logger = logging.getLogger("qsa_jax")
_LOGGED: set[str] = set()


def _log_decline(name: str, err: Exception) -> None:
    """Log that implementation ``name`` declined with ``err`` and the next is tried:
    WARNING (a missing runtime) or INFO the first time a message is seen, DEBUG afterwards."""
    message = f"sparse_gqa_attention: implementation {name!r} declined ({type(err).__name__}: {err}); trying the next"
    log_once(logger, _LOGGED, message, logging.WARNING if isinstance(err, ImportError) else logging.INFO)


# XLA flags under which XLA:GPU's scatter-add (the reference's backward) is deterministic
DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_exclude_nondeterministic_ops=true")


def xla_gpu_deterministic() -> bool:
    """Whether ``XLA_FLAGS`` (in this process's environment) asks XLA:GPU for
    deterministic ops."""
    flags = os.environ.get("XLA_FLAGS", "").lower().split()
    return any(flag in flags for flag in DETERMINISTIC_XLA_FLAGS)


def _xla(query, key, value, routes, scale, *, block_sizes, interpret, deterministic):
    del block_sizes, interpret  # the reference has neither
    if deterministic and on_gpu(query) and not xla_gpu_deterministic():
        raise NotImplementedError(
            "deterministic=True: the reference's backward scatter-adds on the GPU, which XLA makes deterministic "
            f"only with {' or '.join(DETERMINISTIC_XLA_FLAGS)} in XLA_FLAGS")
    return reference_sparse_gqa_attention(query, key, value, routes, scale)


def _pallas(query, key, value, routes, scale, *, block_sizes, interpret, deterministic):
    from . import pallas_qsa  # imports the Triton lowering on first use only

    return pallas_qsa.pallas_sparse_gqa_attention(
        query, key, value, routes, scale, block_sizes=block_sizes, interpret=interpret,
        deterministic=deterministic,
    )


def _triton(query, key, value, routes, scale, *, block_sizes, interpret, deterministic):
    if interpret:
        raise NotImplementedError("the jax-triton launch has no interpret mode (use implementation='pallas')")
    from . import triton_qsa  # imports jax_triton on first use only

    return triton_qsa.triton_sparse_gqa_attention(query, key, value, routes, scale, block_sizes=block_sizes,
                                                  deterministic=deterministic)


IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {"xla": _xla, "pallas": _pallas, "triton": _triton}
# The order tried on GPUs when no implementation is named.
GPU_DEFAULT: tuple[str, ...] = ("triton", "pallas", "xla")


def _implementation_names(implementation) -> tuple[str, ...]:
    """``implementation`` (a name or a sequence of names) as a tuple, every name checked
    before any is tried."""
    if isinstance(implementation, str):
        names = (implementation,)
    elif isinstance(implementation, Sequence) and not isinstance(implementation, (bytes, bytearray)):
        names = tuple(implementation)
    else:
        raise TypeError(f"implementation must be a name or a sequence of names, got {implementation!r}")
    if not names:
        raise ValueError(f"implementation names no implementation; expected some of {sorted(IMPLEMENTATIONS)}")
    for name in names:
        if not isinstance(name, str) or name not in IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {name!r}; expected one of {sorted(IMPLEMENTATIONS)}")
    return names


def sparse_gqa_attention(
    query,
    key,
    value,
    selected_token_ids,
    softmax_scale: float | None = None,
    *,
    implementation: str | Sequence[str] | None = None,
    block_sizes=None,
    interpret: bool | None = None,
    deterministic: bool = False,
):
    """Route-sparse GQA: each query row attends exactly to its routes.

    Args:
        query: ``[B, S_q, Hq, D]`` (bf16, f16 or f32).
        key, value: ``[B, S_kv, Hkv, D]``, same dtype; Hq a multiple of Hkv.
        selected_token_ids: ``[B, S_q, K]`` int32/int64 IDs in global K/V
            coordinates; IDs outside ``[0, S_kv)`` are padding, duplicates count once.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        implementation: ``"triton"`` (the ``qsa_triton`` kernels through
            jax-triton, CUDA only), ``"pallas"`` (JAX's Pallas kernels), ``"xla"``
            (the gather reference), a sequence of them tried in order, or ``None``.
        block_sizes: a ``qsa_triton.BlockSizes`` for ``"triton"``, a
            ``qsa_jax.pallas_qsa.BlockSizes`` for ``"pallas"`` (an implementation
            given the other class declines with NotImplementedError).
        interpret: run the Pallas kernels in interpret mode (CPU); default: on
            when the inputs do not live on GPUs. ``"triton"`` declines it.
        deterministic: bitwise-reproducible gradients (dq, dk, dv) from run to run;
            implementations that cannot promise them decline (module docstring).

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype. Empty rows are exactly zero and
        add nothing to any gradient.

    Raises:
        ValueError / TypeError: bad shapes, dtypes or scale (the contract's types); an
            unknown or empty ``implementation``, a non-bool ``interpret`` or ``deterministic``.
        ImportError: every requested implementation lacks its runtime (jax-triton).
        NotImplementedError: no requested implementation accepts the inputs.
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if interpret is not None and not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool or None, got {interpret!r}")
    routes = prepare_routes(selected_token_ids)
    checked = validate_inputs(query, key, value, routes, softmax_scale)
    if implementation is None:
        names: Sequence[str] = GPU_DEFAULT if on_gpu(query) else ("xla",)
    else:
        names = _implementation_names(implementation)
    reasons, missing = [], []
    for position, name in enumerate(names):
        try:
            return partitioned(  # the call, partitioned by the inputs' shardings (qsa_jax.sharding)
                IMPLEMENTATIONS[name], query, key, value, routes, checked.scale,
                block_sizes=block_sizes, interpret=interpret, deterministic=deterministic,
            )
        except (NotImplementedError, ImportError) as err:
            reasons.append(f"{name}: {err}")
            missing.append(isinstance(err, ImportError))
            if position + 1 < len(names):
                _log_decline(name, err)
    message = "no implementation accepted the inputs:\n  " + "\n  ".join(reasons)
    raise ImportError(message) if all(missing) else NotImplementedError(message)
