"""Imported first by ``qsa_torch``: an ``ImportError`` naming the extra if torch is absent."""

from ._extras import require

require("qsa_torch", "PyTorch", ("torch",), "torch")
