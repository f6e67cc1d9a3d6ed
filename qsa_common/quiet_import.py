"""Import a third-party module without letting its import-time chatter through.

The upstream model (nemo-automodel) pulls in torchao, megatron-fsdp and transformers,
which print warnings and log records while they are imported (an optional compiled
extension not loaded, an optional dependency absent, a deprecated registration). None
of them concern QSA, and on a terminal they read like our own errors. Every place that
imports the upstream model does it through :func:`quiet_import`, which silences
Python warnings and raises the level of the known noisy loggers for the duration of
that import only: no filter or level is changed globally, and whatever the imported
code warns or logs afterwards is shown as usual. Exceptions propagate unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Iterator
from types import ModuleType

# Loggers that emit during the upstream model's import (torchao's "Failed to load"
# extension records, torch's pytree registration notices, megatron and transformers).
NOISY_LOGGERS = (
    "torchao",
    "torch.utils._pytree",
    "torch._dynamo",
    "megatron",
    "megatron_fsdp",
    "megatron.core",
    "transformers",
    "nemo_automodel",
)


@contextlib.contextmanager
def quiet(loggers: tuple[str, ...] = NOISY_LOGGERS, level: int = logging.ERROR) -> Iterator[None]:
    """Within the block: ignore warnings and drop records below ``level`` from ``loggers``."""
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger, _ in saved:
            logger.setLevel(max(level, logger.getEffectiveLevel()))
        try:
            yield
        finally:
            for logger, old in saved:
                logger.setLevel(old)


def quiet_import(name: str) -> ModuleType:
    """``importlib.import_module(name)`` inside :func:`quiet`."""
    with quiet():
        return importlib.import_module(name)
