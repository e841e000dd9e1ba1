"""structlog configuration for the CLI and workers: JSON lines on stderr, filtered by level.

The engine logs through ``structlog.get_logger`` and never configures anything itself; a
process entry point (the CLI, a worker, a test) calls :func:`configure_logging` once. Until
then structlog's defaults apply (pretty lines on stdout), which is why the CLI calls it before
any command runs: stdout is for the command's own output.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Final, TextIO

import structlog

__all__ = ["LEVELS", "configure_logging", "info_enabled", "level_number"]

#: Level names accepted by :func:`configure_logging` (case-insensitive).
LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def level_number(level: str) -> int:
    """The stdlib number of a level name; :class:`ValueError` for anything else."""
    name = level.strip().upper()
    if name == "WARN":
        name = "WARNING"
    if name not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    return int(logging.getLevelNamesMapping()[name])


def info_enabled() -> bool:
    """Whether structlog, as configured now, emits ``info`` events. A hot path asks before
    binding context it would only log at that level: with ``cache_logger_on_first_use`` off,
    every ``bind`` on a module logger builds a new logger, filtered or not."""
    is_enabled = getattr(structlog.get_config()["wrapper_class"], "is_enabled_for", None)
    # A wrapper class that does not say (a custom one) is taken to emit everything.
    return True if is_enabled is None else bool(is_enabled(None, logging.INFO))


def configure_logging(
    level: str = "WARNING", json: bool = True, stream: TextIO | None = None
) -> None:
    """Send structlog events at ``level`` or above to ``stream`` (stderr), as JSON or plain text."""
    threshold = level_number(level)
    # Without an explicit stream, write to whatever sys.stderr is at each event: test runners
    # and daemonizers replace it, and a stream captured once may be closed later.
    out: Any = _CurrentStderr() if stream is None else stream
    renderer: Any = (
        structlog.processors.JSONRenderer(sort_keys=True)
        if json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        # The filtering logger drops calls below the threshold before any processor runs, so
        # the engine's per-effect info events cost almost nothing when they are not wanted.
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        # Module-level loggers are created at import, before this runs: never cache them, so a
        # later configure_logging call (another test, a worker reload) still takes effect.
        cache_logger_on_first_use=False,
    )


class _CurrentStderr:
    """A file-like object that forwards to the current ``sys.stderr``."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()
