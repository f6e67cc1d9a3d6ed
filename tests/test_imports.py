"""Importing either package pulls in nothing optional and not the other framework."""

from __future__ import annotations

import subprocess
import sys

import pytest

OPTIONAL = ("flash_attn", "cudnn", "jax_triton", "triton", "torch._inductor", "cutlass")


@pytest.mark.parametrize("package,forbidden", [
    ("qsa_torch", ("jax", "qsa_jax") + OPTIONAL),
    ("qsa_jax", ("torch", "qsa_torch") + OPTIONAL),
    ("qsa_common", ("jax", "torch")),
])
def test_import_is_lean(package, forbidden):
    code = (
        f"import sys, {package}\n"
        f"bad = [m for m in {forbidden!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
