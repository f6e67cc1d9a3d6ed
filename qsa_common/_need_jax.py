"""Imported first by ``qsa_jax``: an ``ImportError`` naming the extra if jax is absent."""

from ._extras import require

require("qsa_jax", "JAX", ("jax", "jaxlib"), "jax")
