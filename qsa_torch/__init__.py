"""QSA for PyTorch: route-sparse grouped-query attention.

``reference_sparse_gqa_attention`` runs anywhere. Optional backends live in
their own modules and import their runtimes (inductor, flash-attn-4, cuDNN
Frontend) on first use only, so importing this package needs nothing but
torch and numpy.
"""

import qsa_common._need_torch  # noqa: F401  (first: an ImportError naming the extra to install)
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

from .api import sparse_gqa_attention
from .context_parallel import context_parallel_sparse_gqa_attention
from .cudnn_qsa import cudnn_sparse_gqa_attention
from .fa4_qsa import fa4_sparse_gqa_attention
from .flex_qsa import flex_sparse_gqa_attention
from .indexer import qsa_indexer_routes
from .reference import reference_sparse_gqa_attention
from .routes import check_routes, generate_problem, membership_table, normalize_routes, validate_inputs
from .triton_qsa import triton_sparse_gqa_attention

# The same names as qsa_jax.__all__ for the same things (docs/api-names.md); the
# per-backend functions are each framework's own.
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
    "cudnn_sparse_gqa_attention",
    "fa4_sparse_gqa_attention",
    "flex_sparse_gqa_attention",
    "generate_problem",
    "membership_table",
    "normalize_routes",
    "qsa_indexer_routes",
    "reference_sparse_gqa_attention",
    "sparse_gqa_attention",
    "triton_sparse_gqa_attention",
    "validate_inputs",
]
