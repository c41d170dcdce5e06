"""structlog configuration: JSON lines in services, readable output on a console.

Services call :func:`configure` once in ``__main__`` and bind ids
(``log.bind(session_id=..., group_id=..., version=...)``) where they know them.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(service: str, level: str = "info", json: bool = True) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger bound to ``service``."""
    lvl = _LEVELS.get(level.lower())
    if lvl is None:
        raise ValueError(f"log level must be one of {sorted(_LEVELS)}, got {level!r}")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logger: structlog.stdlib.BoundLogger = structlog.get_logger().bind(service=service)
    return logger


def get(name: str) -> structlog.stdlib.BoundLogger:
    """A logger for a module; inherits the process configuration.

    Lazy: module loggers are made at import, before :func:`configure` runs, and a logger bound
    then would keep structlog's defaults for good (console lines with one-second timestamps,
    every level, on stdout). The name goes in as ``logger_name`` (``logger`` is the name of
    structlog's own first parameter); the console renderer shows it as ``[name]`` either way.
    """
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(logger_name=name)
    return logger
