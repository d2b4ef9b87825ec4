"""Logging set-up: structlog to stderr, in Go nsqd's console format or as JSON.

The start-up configures it once from the options and again whenever
``log_level`` changes at run time (``PUT /config/log_level``), unless the
daemon is embedded in an application that configured logging itself.
:class:`LogThrottle` keeps lines that publishes can repeat to one a second.
"""

from __future__ import annotations

import logging
import sys
import time

import structlog

from .lg import GoLineRenderer
from .options import Options


_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
}


class _NamedLogger(structlog.WriteLogger):
    """A stderr logger carrying the name given to structlog.get_logger()."""

    def __init__(self, name: str = "nsqd") -> None:
        super().__init__(sys.stderr)
        self.name = name

    def msg(self, message: str) -> None:
        """Write one line; one that cannot be written is dropped, as Go's logger drops it.

        A supervisor may hand the daemon a stderr that fails every write (a
        descriptor opened read-only, a closed pipe, a full disk): that must
        not stop the daemon (it did, at its first line).
        """
        try:
            super().msg(message)
        except (OSError, ValueError):  # ValueError: the file was closed
            pass

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def configure_logging(options: Options) -> None:
    """Send structlog output to stderr at the configured level and format.

    ``console`` writes Go nsqd's lines (``nsqd.lg``), ``json`` one object per
    line with an ISO 8601 UTC timestamp. Loggers are not cached, so calling
    this again (after PUT /config/log_level) changes the level of every
    logger at once.
    """
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
    ]
    if options.log_format == "json":
        processors += [structlog.processors.TimeStamper(fmt="iso", utc=True),
                       structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.processors.format_exc_info, GoLineRenderer(options.log_prefix)]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LOG_LEVELS[options.log_level]),
        logger_factory=_NamedLogger,
        cache_logger_on_first_use=False,
    )


class LogThrottle:
    """A line that publishes can repeat (a drop, a full disk) logged at most once per interval.

    Every occurrence is counted; the line that is let through carries the
    count since the last one. Without it a stalled ephemeral consumer under
    100,000 publishes a second wrote as many warnings (Go nsqd drops those
    messages silently), at the cost of the publishes themselves.
    """

    __slots__ = ("interval", "_next_at", "_count")

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._next_at = -float("inf")
        self._count = 0

    def due(self, count: int = 1) -> int:
        """Count ``count`` occurrences; returns how many to report if a line is due now, else 0."""
        self._count += count
        now = time.monotonic()
        if now < self._next_at:
            return 0
        self._next_at = now + self.interval
        reported, self._count = self._count, 0
        return reported
