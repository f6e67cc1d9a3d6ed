"""The token-gather QSA kernels in Triton, for every framework that launches them.

Framework-neutral: nothing here imports torch or jax. ``qsa_torch.triton_qsa`` launches
the kernels through torch, ``qsa_jax.triton_qsa`` through ``jax_triton.triton_call``;
both build their launches from this package's plans (:mod:`.plan`), launch descriptions
(:mod:`.launch`) and configuration table (:mod:`.config`), so the same inputs on the
same GPU run the same kernels with the same tiles, unions, constexprs and scalars.

Importing the package imports only those pure-Python modules; the kernels
(``forward``, ``backward``, ``fixed_point``, ``union_keys``, ``union_merge``,
``union_cut``, one per module) import triton and load when
:func:`qsa_triton.launch.kernel` first asks for one. ``backward`` has a deterministic
mode (int64 fixed-point dK/dV, ``fixed_point``).
"""

from .config import DEFAULT_BLOCK_SIZES, SAFE_BLOCK_SIZES, BlockSizes, default_block_sizes
from .plan import Plan, make_plan

__all__ = ["BlockSizes", "DEFAULT_BLOCK_SIZES", "SAFE_BLOCK_SIZES", "Plan", "default_block_sizes", "make_plan"]
