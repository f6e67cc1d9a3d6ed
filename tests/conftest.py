"""Shared pytest setup: GPU tests skip cleanly where no CUDA device is present;
hypothesis profiles for the property tests.

Hypothesis profiles: ``ci`` (the default) draws a few fresh random tiny examples per
test and run (no example database; a failure prints the blob that reproduces it), so
CPU CI stays fast; ``gpu`` (``pytest --hypothesis-profile=gpu``) draws more of them and
larger (tests/test_property.py reads the profile).
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=6, derandomize=False, database=None, deadline=None,
                          suppress_health_check=_SLOW_OK, print_blob=True)
settings.register_profile("gpu", max_examples=20, deadline=None, suppress_health_check=_SLOW_OK,
                          print_blob=True)
settings.load_profile("ci")  # `--hypothesis-profile` (applied after this) overrides it

# Several host devices for device-mismatch and context-parallel tests on CPU;
# must be set before jax is first imported.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

# Without a GPU, Triton kernels run in its interpreter; must precede any triton import.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# make `import contract_base` / `import runners` work from any test module
sys.path.insert(0, os.path.dirname(__file__))


def _has_cuda() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
