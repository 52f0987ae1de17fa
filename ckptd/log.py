"""Logging set-up: structlog, one event name per happening, JSON lines for journald or a
readable console form on a TTY. Owns only configuration; callers use `get_logger`."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(fmt: str = "auto", level: str = "info", stream: Any = None) -> None:
    """Configure structlog once for the process. `fmt` is auto | json | console."""
    stream = stream or sys.stdout
    if hasattr(stream, "reconfigure"):
        stream.reconfigure(line_buffering=True)  # one event a line, even into a file or pipe
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level(level)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def _level(name: str) -> int:
    value = logging.getLevelName(name.upper())
    return value if isinstance(value, int) else logging.INFO


def get_logger(**bind: Any) -> Any:
    return structlog.get_logger("ckptd").bind(**bind)
