"""The walls between packages and backends.

* Importing a package pulls in nothing optional and not the other framework (checked
  in a fresh interpreter through ``sys.modules``).
* ``qsa_triton`` (the kernels, their plans and launch descriptions) imports neither
  torch nor jax, its kernel modules included.
* ``qsa_torch`` and ``qsa_jax`` never import each other, and within each, a backend's
  modules never import another backend's: checked on every import statement of every
  module, those inside functions included (the lazy ones no import would run).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPTIONAL = ("flash_attn", "cudnn", "jax_triton", "triton", "torch._inductor", "cutlass")


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("package,forbidden", [
    ("qsa_torch", ("jax", "qsa_jax") + OPTIONAL),
    ("qsa_jax", ("torch", "qsa_torch") + OPTIONAL),
    ("qsa_jax.triton_qsa", ("torch", "qsa_torch", "jax_triton", "triton")),
    ("qsa_common", ("jax", "torch")),
    ("qsa_triton", ("jax", "torch", "triton", "qsa_torch", "qsa_jax")),
])
def test_import_is_lean(package, forbidden):
    _run(f"import sys, {package}\n"
         f"bad = [m for m in {forbidden!r} if m in sys.modules]\n"
         "assert not bad, bad\n")


def test_kernel_package_imports_neither_framework():
    """Every module of qsa_triton, the Triton kernels included, loads without torch or
    jax: it can serve either framework, or none."""
    _run("import importlib, pkgutil, sys, qsa_triton\n"
         "names = [m.name for m in pkgutil.iter_modules(qsa_triton.__path__, 'qsa_triton.')]\n"
         "assert 'qsa_triton.forward' in names, names\n"
         "for name in names:\n"
         "    importlib.import_module(name)\n"
         "assert 'triton' in sys.modules\n"
         "bad = [m for m in ('torch', 'jax', 'qsa_torch', 'qsa_jax') if m in sys.modules]\n"
         "assert not bad, bad\n")


def _imports(path: pathlib.Path, module: str) -> set[str]:
    """Absolute names of every module ``module`` (at ``path``) imports, anywhere in it."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _hits(names: set[str], prefixes) -> list[str]:
    return sorted(n for n in names for p in prefixes if n == p or n.startswith(p + "."))


@pytest.mark.parametrize("package, forbidden", [
    ("qsa_triton", ("torch", "jax", "qsa_torch", "qsa_jax")),
    ("qsa_torch", ("jax", "qsa_jax")),
    ("qsa_jax", ("torch", "qsa_torch")),
    ("qsa_common", ("torch", "jax", "qsa_torch", "qsa_jax", "qsa_triton")),
])
def test_packages_never_import_across_the_wall(package, forbidden):
    bad = {module: _hits(_imports(path, module), forbidden) for path, module in _modules(package)}
    assert not {m: hits for m, hits in bad.items() if hits}


# Each backend's modules, per framework package. A backend module may import shared
# modules (routes, the neutral packages), never another backend's.
BACKENDS = {
    "qsa_torch": {
        "triton": ("triton_qsa", "_triton_launch", "_triton_autograd"),
        "flex": ("flex_qsa",),
        "fa4": ("fa4_qsa",),
        "cudnn": ("cudnn_qsa",),
        "reference": ("reference",),
    },
    "qsa_jax": {
        "triton": ("triton_qsa", "_triton_call", "_jax_triton_patch"),
        "pallas": ("pallas_qsa", "_pallas_atomics", "_pallas_kernels", "_pallas_tiles"),
        "xla": ("xla_reference",),
    },
}


@pytest.mark.parametrize("package", sorted(BACKENDS))
def test_a_backend_never_imports_another(package):
    groups = {name: {f"{package}.{m}" for m in members} for name, members in BACKENDS[package].items()}
    bad = {}
    for path, module in _modules(package):
        own = next((name for name, members in groups.items() if module in members), None)
        if own is None:
            continue
        others = [m for name, members in groups.items() if name != own for m in members]
        hits = _hits(_imports(path, module), others)
        if hits:
            bad[module] = hits
    assert not bad
    present = {module for _, module in _modules(package)}
    assert all(m in present for members in groups.values() for m in members)
