"""Logging set-up: structlog to stderr, in Go nsqd's console format or as JSON.

The start-up configures it once from the options and again whenever
``log_level`` changes at run time (``PUT /config/log_level``), unless the
daemon is embedded in an application that configured logging itself.
"""

from __future__ import annotations

import logging
import sys

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
