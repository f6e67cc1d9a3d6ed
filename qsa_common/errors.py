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
  :class:`UnsupportedOption` (``ValueError``: an option such as block sizes or an
  interpret mode the backend does not take),
  :class:`UnsupportedDevice` (``RuntimeError``: off the GPU, or a GPU the backend does
  not build for), :class:`DeterminismUnavailable` (``RuntimeError``) and
  :class:`MissingRuntime` (``ImportError``: an optional package is absent). Under
  automatic selection a dispatcher moves on to the next backend after one of these
  and raises them all together only when no backend is left
  (:func:`no_backend_available`); a backend named explicitly raises its own.

A dispatcher never moves on after any other exception: not after bad input, and not
after an out-of-memory error (``torch.OutOfMemoryError``, XLA's ``RESOURCE_EXHAUSTED``),
which propagates to the caller: another backend would not make the memory appear, and
retrying hides the size of the problem. A plain ``ImportError`` raised by a backend
while it runs is read as :class:`MissingRuntime` (an optional package failed to load).
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
    "UnsupportedOption",
    "UnsupportedShape",
    "as_declined",
    "no_backend_available",
]


class QSAError(Exception):
    """Base class of every exception QSA raises on purpose."""


class InvalidInput(QSAError, ValueError):
    """Input that breaks the contract: a wrong rank or size, Hq not a multiple of Hkv,
    tensors on different devices, a non-finite or non-positive softmax scale."""


class InvalidDtype(QSAError, TypeError):
    """A dtype or type the contract rejects: non-floating query/key/value, mixed dtypes,
    unsigned or floating route IDs, a non-array input, a non-real softmax scale, a
    non-bool flag."""


class BackendDeclined(QSAError):
    """A backend cannot take these (valid) inputs; another backend may."""


class UnsupportedShape(BackendDeclined, ValueError):
    """Valid sizes outside a backend's limits (e.g. a head dim it has no kernel for)."""


class UnsupportedDtype(BackendDeclined, TypeError):
    """A valid dtype a backend has no kernel for (e.g. float64 on a GPU kernel)."""


class UnsupportedOption(BackendDeclined, ValueError):
    """A backend-specific option this backend does not take (another backend's block
    sizes class, an interpret mode it has not)."""


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


def as_declined(err: BaseException) -> BackendDeclined | None:
    """``err`` as the decline it stands for under automatic selection, or None where the
    dispatcher must let it propagate: a :class:`BackendDeclined` itself, a plain
    ``ImportError`` as :class:`MissingRuntime` (same message), anything else None."""
    if isinstance(err, BackendDeclined):
        return err
    if isinstance(err, ImportError):
        declined = MissingRuntime(str(err))
        declined.__cause__ = err
        return declined
    return None


def no_backend_available(reasons: dict[str, BackendDeclined], what: str = "backend") -> NoBackendAvailable:
    """The error a dispatcher raises when every candidate declined: one line per
    backend (``what`` names them: "backend" in torch, "implementation" in JAX) with its
    exception class and message; ``reasons`` is kept on the error."""
    lines = "".join(f"\n  {name}: {type(err).__name__}: {err}" for name, err in reasons.items())
    return NoBackendAvailable(f"no {what} accepted the inputs:{lines}", reasons)
