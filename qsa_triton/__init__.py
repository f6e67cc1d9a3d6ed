"""The token-gather QSA kernels in Triton, for every framework that launches them.

Framework-neutral: nothing here imports torch or jax. :mod:`.driver` holds the steps
around the launches once (union recipe, Hopper-or-portable choice, the out-of-shared-
memory retry, the deterministic backward's fixed-point steps) behind a small adapter
that ``qsa_torch._triton_launch`` (tensors) and ``qsa_jax._triton_call``
(``jax_triton.triton_call``) implement; :mod:`.limits` what the kernels take (both
frameworks' ``supports``); the driver's launches come from the plans (:mod:`.plan`),
launch descriptions (:mod:`.launch`) and configuration table (:mod:`.config`), so the
same inputs on the same GPU run the same kernels with the same tiles, unions, constexprs
and scalars.

Importing the package imports only those pure-Python modules; the kernels
(``forward``, ``backward``, ``fixed_point``, ``union_keys``, ``union_merge``,
``union_cut``, ``union_rank``, the Hopper ``forward_sm90`` / ``backward_sm90``, one per
module) import triton and load when :func:`qsa_triton.kernels.kernel` first asks for
one. ``backward`` has a deterministic mode (int64 fixed-point dK/dV, ``fixed_point``).
"""

from .config import DEFAULT_BLOCK_SIZES, SAFE_BLOCK_SIZES, BlockSizes, default_block_sizes
from .plan import Plan, make_plan

__all__ = ["BlockSizes", "DEFAULT_BLOCK_SIZES", "SAFE_BLOCK_SIZES", "Plan", "default_block_sizes", "make_plan"]
