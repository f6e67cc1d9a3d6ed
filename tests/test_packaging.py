"""Packaging: the distribution's extras, and the ImportError that names the extra to install."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _import_without(blocked: tuple[str, ...], package: str) -> subprocess.CompletedProcess:
    """Import ``package`` in a fresh interpreter in which ``blocked`` cannot be imported."""
    code = ("import sys\n"
            f"for name in {blocked!r}:\n"
            "    sys.modules[name] = None  # makes 'import name' raise ImportError\n"
            f"import {package}\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("package, blocked, message", [
    ("qsa_torch", ("torch",), "qsa_torch needs PyTorch: pip install 'qsa-kernels[torch]'"),
    ("qsa_torch.integrations.nemo_automodel", ("torch",), "qsa_torch needs PyTorch: pip install 'qsa-kernels[torch]'"),
    ("qsa_jax", ("jax",), "qsa_jax needs JAX: pip install 'qsa-kernels[jax]'"),
    ("qsa_jax", ("jaxlib",), "qsa_jax needs JAX: pip install 'qsa-kernels[jax]'"),
])
def test_missing_framework_names_the_extra(package, blocked, message):
    proc = _import_without(blocked, package)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: " + message), proc.stderr[-2000:]


def test_frameworks_do_not_need_each_other():
    assert _import_without(("jax", "jaxlib", "flax"), "qsa_torch").returncode == 0
    proc = _import_without(("torch",), "qsa_jax")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "qsa-kernels"
    extras = project["optional-dependencies"]
    assert {"torch", "jax", "cuda12", "upstream", "test", "docs", "lint", "all"} <= extras.keys()
    for name, requirements in extras.items():
        for requirement in requirements:
            if requirement.startswith(project["name"] + "["):
                inner = requirement[len(project["name"]) + 1:requirement.index("]")].split(",")
                assert set(inner) <= extras.keys() - {name}, f"extra {name!r} names unknown extras {inner}"
    assert isinstance(project["license"], str), "an SPDX license expression"


def test_quiet_import_restores_filters_and_levels():
    import logging
    import warnings

    from qsa_common.quiet_import import quiet

    logger = logging.getLogger("torchao")
    before_level, before_filters = logger.level, list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet():
            warnings.warn("inside", UserWarning, stacklevel=1)
            assert logging.getLogger("torchao").getEffectiveLevel() >= logging.ERROR
        warnings.warn("outside", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["outside"]
    assert logger.level == before_level and warnings.filters == before_filters
