"""The source's and the sink's options, checked once on the driver.

Spark hands options over as a case-insensitive map of strings; a typo would
otherwise be silently ignored, so an option we do not know is an error that
names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .client import parse_address

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|sec|m|min|h|d)?\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}

READ_OPTIONS = ("nsqd.address", "topic", "channel", "maxMessagesPerTrigger", "minMessagesPerTrigger",
                "maxTriggerDelay", "numPartitions", "maxInFlight", "msgTimeoutMs", "reconnectTimeout")
WRITE_OPTIONS = ("nsqd.address", "topic", "reconnectTimeout")
#: how long a lost daemon is retried before the task or query fails
DEFAULT_RECONNECT_TIMEOUT = "5m"
#: nsqd's rule for topic and channel names (nsqd/names.py; executors need not have the daemon installed)
_NAME = re.compile(r"^[.a-zA-Z0-9_-]{1,64}$")
NAME_RULE = "1 to 64 characters of letters, digits, '.', '_' and '-', optionally ending in '#ephemeral'"
#: most partitions per nsqd address: each one holds a connection to its daemon (and a share of its
#: --max-connections) for every trigger
MAX_PARTITIONS_PER_ADDRESS = 1024
#: options Spark itself adds to those the user gave
SPARK_OPTIONS = frozenset({"checkpointlocation"})


class OptionError(ValueError):
    pass


def _check_known(options, known: tuple[str, ...], what: str) -> dict[str, str]:
    by_lower = {name.lower(): name for name in known}
    values = {}
    for key, value in options.items():
        name = by_lower.get(key.lower())
        if name is None and key.lower() in SPARK_OPTIONS:
            continue
        if name is None:
            raise OptionError(f"unknown option {key!r} for the nsq {what}; known options: {', '.join(known)}")
        values[name] = value
    return values


def _addresses(values: dict[str, str]) -> tuple[str, ...]:
    raw = values.get("nsqd.address", "")
    addresses = tuple(a.strip() for a in raw.split(",") if a.strip())
    if not addresses:
        raise OptionError("option 'nsqd.address' is required (host:port of nsqd's TCP listener, comma separated)")
    for address in addresses:
        try:
            parse_address(address)
        except ValueError as exc:
            raise OptionError(f"option 'nsqd.address': {exc}") from None
    return addresses


def _int(values: dict[str, str], name: str, default: int | None, minimum: int) -> int | None:
    raw = values.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise OptionError(f"option {name!r} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise OptionError(f"option {name!r} must be at least {minimum}, got {value}")
    return value


def parse_duration(name: str, raw: str) -> float:
    """Seconds from Spark's duration syntax (``500ms``, ``10s``, ``15m``; a bare number is ms)."""
    match = _DURATION.match(raw)
    if not match:
        raise OptionError(f"option {name!r} must be a duration such as 500ms, 10s or 15m, got {raw!r}")
    return float(match.group(1)) * _UNIT_SECONDS[(match.group(2) or "ms").lower()]


def _positive(seconds: float, name: str) -> float:
    if seconds <= 0:
        raise OptionError(f"option {name!r} must be more than 0: a read must have time to take a message")
    return seconds


def is_valid_name(name: str) -> bool:
    """Whether nsqd accepts ``name`` as a topic or channel name."""
    base = name[:-len("#ephemeral")] if name.endswith("#ephemeral") else name
    return len(name) <= 64 and _NAME.match(base) is not None


def _name(values: dict[str, str], name: str, required: bool = True) -> str | None:
    """A topic or channel option, checked against nsqd's rule (a bad name would reach another topic)."""
    value = values.get(name, "").strip()
    if not value:
        if required:
            raise OptionError(f"option {name!r} is required")
        return None
    if not is_valid_name(value):
        raise OptionError(f"option {name!r} is {value!r}, not a valid nsq {name} name ({NAME_RULE})")
    return value


def _reconnect_timeout(values: dict[str, str]) -> float:
    seconds = parse_duration("reconnectTimeout", values.get("reconnectTimeout", DEFAULT_RECONNECT_TIMEOUT))
    if seconds <= 0:
        raise OptionError("option 'reconnectTimeout' must be positive")
    return seconds


@dataclass(frozen=True)
class ReadOptions:
    addresses: tuple[str, ...]
    topic: str
    channel: str
    #: most messages one trigger (or one batch read) takes, over all partitions
    max_messages: int | None
    #: fewest messages a trigger waits for, up to ``max_delay``
    min_messages: int
    #: longest a partition reads in one trigger, in seconds
    max_delay: float
    num_partitions: int
    #: RDY of each partition's connection, which is also the size of one lease segment
    max_in_flight: int
    msg_timeout_ms: int
    #: how long a partition or the driver keeps trying to reach a daemon it lost, in seconds
    reconnect_timeout: float

    @classmethod
    def parse(cls, options) -> ReadOptions:
        values = _check_known(options, READ_OPTIONS, "source")
        addresses = _addresses(values)
        partitions = _int(values, "numPartitions", len(addresses), 1)
        if partitions < len(addresses):
            raise OptionError(f"option 'numPartitions' ({partitions}) must be at least the number of "
                              f"nsqd addresses ({len(addresses)}): each address needs a partition")
        if partitions > MAX_PARTITIONS_PER_ADDRESS * len(addresses):
            raise OptionError(f"option 'numPartitions' ({partitions}) must be at most "
                              f"{MAX_PARTITIONS_PER_ADDRESS} per nsqd address: each partition holds a "
                              "connection to its daemon")
        max_messages = _int(values, "maxMessagesPerTrigger", None, 1)
        min_messages = _int(values, "minMessagesPerTrigger", 0, 0)
        if max_messages is not None and min_messages > max_messages:
            raise OptionError(f"option 'minMessagesPerTrigger' ({min_messages}) must be at most "
                              f"'maxMessagesPerTrigger' ({max_messages})")
        return cls(
            addresses=addresses,
            topic=_name(values, "topic"),
            channel=_name(values, "channel"),
            max_messages=max_messages,
            min_messages=min_messages,
            max_delay=_positive(parse_duration("maxTriggerDelay", values.get("maxTriggerDelay", "1s")),
                                "maxTriggerDelay"),
            num_partitions=partitions,
            max_in_flight=_int(values, "maxInFlight", 2500, 1),
            msg_timeout_ms=_int(values, "msgTimeoutMs", 60000, 1000),
            reconnect_timeout=_reconnect_timeout(values),
        )

    def share(self, total: int | None, partition: int) -> int | None:
        """A partition's part of a per-trigger count: ``total`` split as evenly as possible."""
        if total is None:
            return None
        base, extra = divmod(total, self.num_partitions)
        return base + (1 if partition < extra else 0)


@dataclass(frozen=True)
class WriteOptions:
    addresses: tuple[str, ...]
    #: the topic of rows that have no ``topic`` column (or a null in it)
    topic: str | None
    reconnect_timeout: float

    @classmethod
    def parse(cls, options) -> WriteOptions:
        values = _check_known(options, WRITE_OPTIONS, "sink")
        return cls(addresses=_addresses(values), topic=_name(values, "topic", required=False),
                   reconnect_timeout=_reconnect_timeout(values))
