"""Console log lines in Go nsqd's format (its ``internal/lg`` over Go's ``log``).

Every line is ``<prefix><date> <time> <LEVEL>: <message>``::

    [nsqd] 2024/01/01 12:00:00.000000 INFO: TCP: listening on 127.0.0.1:4150
    [nsqd] 2024/01/01 12:00:01.250000 WARNING: LOOKUP: lookupd connection failed lookupd=10.0.0.1:4160

in local time with microseconds (Go's ``Ldate|Ltime|Lmicroseconds``), the
level as Go names it (DEBUG, INFO, WARNING, ERROR, FATAL). Tools written for
Go nsqd read these lines (the ``listening on`` ones above all), so the
shape is kept exactly; our structured fields follow the message as
``key=value``. A logger below the daemon's own (``nsqd.tcp``,
``amqp_gateway.server``) names its part the way Go's messages do (``TCP:``,
``AMQP:``) unless the message already starts with that name.
"""

from __future__ import annotations

import json
import re
from datetime import datetime

LEVELS = {
    "debug": "DEBUG",
    "info": "INFO",
    "warn": "WARNING",
    "warning": "WARNING",
    "error": "ERROR",
    "exception": "ERROR",
    "critical": "FATAL",
    "fatal": "FATAL",
}

_HIDDEN = ("event", "level", "logger", "timestamp", "exception", "exc_info", "stack")


def component(logger_name: str) -> str:
    """``nsqd.tcp`` -> ``TCP``; the AMQP gateway's loggers are ``AMQP``; a top-level logger has none."""
    if logger_name.split(".")[0] == "amqp_gateway":
        return "AMQP"
    head, dot, tail = logger_name.rpartition(".")
    return tail.upper() if dot else ""


def _value(value: object) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, (int, float)):
        text = str(value)
    else:
        text = repr(value)
    if not text or any(ch.isspace() or ch in "\"=" for ch in text):
        return json.dumps(text, ensure_ascii=False)
    return text


def timestamp(now: datetime | None = None) -> str:
    """Go's ``2006/01/02 15:04:05.000000`` in local time."""
    return (now or datetime.now()).strftime("%Y/%m/%d %H:%M:%S.%f")


class GoLineRenderer:
    """A structlog renderer writing Go nsqd's console lines (``--log-format=console``)."""

    def __init__(self, prefix: str = "[nsqd] ") -> None:
        self.prefix = prefix

    def __call__(self, logger: object, method_name: str, event_dict: dict) -> str:
        level = LEVELS.get(str(event_dict.get("level", method_name)).lower(), "INFO")
        message = str(event_dict.get("event", ""))
        part = component(str(event_dict.get("logger") or getattr(logger, "name", "") or ""))
        if part and not re.match(rf"{part}\b", message, re.IGNORECASE):
            message = f"{part}: {message}"
        fields = " ".join(f"{key}={_value(value)}" for key, value in event_dict.items() if key not in _HIDDEN)
        line = f"{self.prefix}{timestamp()} {level}: {message}"
        if fields:
            line += " " + fields
        for key in ("stack", "exception"):
            if event_dict.get(key):
                line += "\n" + str(event_dict[key]).rstrip("\n")
        return line
