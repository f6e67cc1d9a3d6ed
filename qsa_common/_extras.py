"""Import-time checks that name the extra to install when a framework is missing.

``qsa_torch`` and ``qsa_jax`` call :func:`require` on their first line, so importing
either without its framework raises an ``ImportError`` that says which extra of the
``qsa-kernels`` distribution provides it, instead of a bare ``No module named ...``.
Only the presence of the modules is checked (``importlib.util.find_spec``); nothing
is imported here, so ``qsa_common`` still imports neither torch nor jax.
"""

from __future__ import annotations

import importlib.util

DISTRIBUTION = "qsa-kernels"


def installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (a missing parent package or
    a module set to None in ``sys.modules`` count as absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(package: str, framework: str, modules: tuple[str, ...], extra: str) -> None:
    """Raise ``ImportError`` naming ``extra`` if any of ``modules`` cannot be found.

    ``package`` is the importing package (``"qsa_torch"``), ``framework`` the runtime's
    name for people (``"PyTorch"``).
    """
    absent = [m for m in modules if not installed(m)]
    if absent:
        raise ImportError(
            f"{package} needs {framework}: pip install '{DISTRIBUTION}[{extra}]' "
            f"(not found: {', '.join(absent)})",
            name=absent[0],
        )
