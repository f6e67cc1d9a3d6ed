"""QSA for JAX: route-sparse grouped-query attention.

``reference_sparse_gqa_attention`` (also ``reference``) is the gather-based
XLA reference and runs on any device. Pallas kernels import their Triton
lowering on first use only, so importing this package needs nothing but jax
and numpy.
"""

from .attention import sparse_gqa_attention
from .context_parallel import context_parallel_sparse_gqa_attention
from .indexer import qsa_indexer_routes
from .routes import generate_problem, normalize_routes, prepare_routes, validate_inputs
from .xla_reference import reference_sparse_gqa_attention

reference = reference_sparse_gqa_attention

__all__ = [
    "context_parallel_sparse_gqa_attention",
    "generate_problem",
    "normalize_routes",
    "prepare_routes",
    "qsa_indexer_routes",
    "reference",
    "reference_sparse_gqa_attention",
    "sparse_gqa_attention",
    "validate_inputs",
]
