"""QSA for JAX: route-sparse grouped-query attention.

``reference_sparse_gqa_attention`` is the gather-based XLA reference and runs on any
device. ``sparse_gqa_attention`` picks an
implementation: on CUDA the ``qsa_triton`` kernels through jax-triton
(``"triton"``), then Pallas, then the reference. jax-triton, triton and Pallas'
Triton lowering are imported on first use only, so importing this package needs
nothing but jax and numpy.

Layers: :mod:`qsa_jax.qwen3_8_flash_next` is the Flax nnx port of
Qwen3.8-Flash-Next's QSA attention layer (imported on demand; it needs flax),
built from the functional pieces in :mod:`qsa_jax.layers` and the selection
in :mod:`qsa_jax.indexer`.
"""

import qsa_common._need_jax  # noqa: F401  (first: an ImportError naming the extra to install)
from qsa_common.errors import (
    BackendDeclined,
    DeterminismUnavailable,
    InvalidDtype,
    InvalidInput,
    MissingRuntime,
    NoBackendAvailable,
    QSAError,
    UnsupportedDevice,
    UnsupportedDtype,
    UnsupportedOption,
    UnsupportedShape,
)
from qsa_common.route_check import RouteReport

from .attention import sparse_gqa_attention
from .context_parallel import context_parallel_sparse_gqa_attention
from .indexer import qsa_indexer_routes
from .routes import check_routes, generate_problem, membership_table, normalize_routes, prepare_routes, validate_inputs
from .xla_reference import reference_sparse_gqa_attention

# The same names as qsa_torch.__all__ for the same things (docs/api-names.md); the
# per-implementation functions are each framework's own. The kernels' modules (and
# Pallas' Triton lowering, jax-triton) load on first access to their function.
_LAZY = {"pallas_sparse_gqa_attention": "pallas_qsa", "triton_sparse_gqa_attention": "triton_qsa"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BackendDeclined",
    "DeterminismUnavailable",
    "InvalidDtype",
    "InvalidInput",
    "MissingRuntime",
    "NoBackendAvailable",
    "QSAError",
    "RouteReport",
    "UnsupportedDevice",
    "UnsupportedDtype",
    "UnsupportedOption",
    "UnsupportedShape",
    "check_routes",
    "context_parallel_sparse_gqa_attention",
    "generate_problem",
    "membership_table",
    "normalize_routes",
    "pallas_sparse_gqa_attention",
    "prepare_routes",
    "qsa_indexer_routes",
    "reference_sparse_gqa_attention",
    "sparse_gqa_attention",
    "triton_sparse_gqa_attention",
    "validate_inputs",
]
