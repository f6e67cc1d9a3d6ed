"""QSA for JAX: route-sparse grouped-query attention.

``reference_sparse_gqa_attention`` (also ``reference``) is the gather-based
XLA reference and runs on any device. ``sparse_gqa_attention`` picks an
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
