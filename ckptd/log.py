"""Logging set-up: structlog, one event name per happening, JSON lines for journald or a
readable console form on a TTY. Owns only configuration; callers use `get_logger`.

structlog (and the console renderer's rich, ~0.14 s of imports) is imported on a logger's
first event, not before: a training process that loads a step and logs nothing never pays it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any


def configure(fmt: str = "auto", level: str = "info", stream: Any = None) -> None:
    """Configure structlog once for the process. `fmt` is auto | json | console."""
    import structlog

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


class _Deferred:
    """A structlog logger bound to `context`, made on its first use (an event, a bind's use)
    with the configuration of that moment."""

    __slots__ = ("_context", "_real")

    def __init__(self, context: dict[str, Any]) -> None:
        self._context = context
        self._real: Any = None

    def bind(self, **more: Any) -> _Deferred:
        return _Deferred({**self._context, **more})

    def __getattr__(self, name: str) -> Any:
        if self._real is None:
            import structlog

            self._real = structlog.get_logger("ckptd").bind(**self._context)
        return getattr(self._real, name)


def get_logger(**bind: Any) -> Any:
    return _Deferred(bind)
