"""The exceptions both frameworks raise, defined once.

Every class subclasses the built-in exception the contract names for its case, so
code written against the built-ins (``except ValueError``) keeps working, and
``except QSAError`` catches everything this library raises on purpose.

Two families:

* Bad input, which no backend could take: :class:`InvalidInput` (``ValueError``:
  ranks, sizes, heads, devices, scale) and :class:`InvalidDtype` (``TypeError``:
  non-floating tensors, unsigned or floating route IDs). A dispatcher never moves
  on from these: it raises them.
* A backend declining inputs that are valid but outside what it supports, all
  subclasses of :class:`BackendDeclined`: :class:`UnsupportedShape`
  (``ValueError``), :class:`UnsupportedDtype` (``TypeError``),
  :class:`UnsupportedDevice` (``RuntimeError``: off the GPU, or a GPU the backend does
  not build for), :class:`DeterminismUnavailable` (``RuntimeError``) and
  :class:`MissingRuntime` (``ImportError``: an optional package is absent). Under
  automatic selection a dispatcher moves on to the next backend after one of these
  and raises them all together only when no backend is left; a backend named
  explicitly raises its own.
"""

from __future__ import annotations

__all__ = [
    "BackendDeclined",
    "DeterminismUnavailable",
    "InvalidDtype",
    "InvalidInput",
    "MissingRuntime",
    "NoBackendAvailable",
    "QSAError",
    "UnsupportedDevice",
    "UnsupportedDtype",
    "UnsupportedShape",
]


class QSAError(Exception):
    """Base class of every exception QSA raises on purpose."""


class InvalidInput(QSAError, ValueError):
    """Input that breaks the contract: a wrong rank or size, Hq not a multiple of Hkv,
    tensors on different devices, a non-finite or non-positive softmax scale."""


class InvalidDtype(QSAError, TypeError):
    """A dtype the contract rejects: non-floating query/key/value, mixed dtypes,
    unsigned or floating route IDs."""


class BackendDeclined(QSAError):
    """A backend cannot take these (valid) inputs; another backend may."""


class UnsupportedShape(BackendDeclined, ValueError):
    """Valid sizes outside a backend's limits (e.g. a head dim it has no kernel for)."""


class UnsupportedDtype(BackendDeclined, TypeError):
    """A valid dtype a backend has no kernel for (e.g. float64 on a GPU kernel)."""


class UnsupportedDevice(BackendDeclined, RuntimeError):
    """Inputs on a device or GPU architecture the backend does not run on."""


class DeterminismUnavailable(BackendDeclined, RuntimeError):
    """``deterministic=True`` asked of a backend whose backward cannot give it."""


class MissingRuntime(BackendDeclined, ImportError):
    """An optional package the backend needs is not installed. The message names the
    package and the extra that installs it."""


class NoBackendAvailable(QSAError, RuntimeError):
    """Automatic selection found no backend for the inputs; ``reasons`` maps each
    backend tried to the :class:`BackendDeclined` it raised."""

    def __init__(self, message: str, reasons: dict[str, BackendDeclined] | None = None):
        super().__init__(message)
        self.reasons = dict(reasons or {})
