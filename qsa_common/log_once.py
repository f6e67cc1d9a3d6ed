"""Messages logged once at their level, at DEBUG when seen again (both frameworks'
dispatchers log the implementations they skip this way)."""

from __future__ import annotations

import logging

__all__ = ["log_once"]


def log_once(logger: logging.Logger, seen: set[str], message: str, level: int = logging.INFO) -> None:
    """Log ``message`` on ``logger`` at ``level`` if it is not in ``seen`` (the caller's
    record of messages already logged, to which it is added), else at DEBUG."""
    if message in seen:
        logger.debug(message)
    else:
        seen.add(message)
        logger.log(level, message)
