"""Queue policies beyond nsqd: limits, overflow, attempts, TTL and durability, as values.

A topic or channel gets its policy when it is created and a new one in one
step (``set_policy``) when an operator changes it; nothing sets the fields
one by one. The daemon's flags make the defaults (:func:`defaults`); a topic's
channel defaults reach its channels unless a channel has its own override.
Overrides are kept in ``nsqd.dat`` only where they differ from the defaults,
so a file with none is exactly Go nsqd's format.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .options import OVERFLOW_POLICIES

if TYPE_CHECKING:
    from .options import Options


class PolicyError(ValueError):
    """A policy value that cannot apply; the message names the field."""


@dataclass(frozen=True)
class ChannelPolicy:
    max_messages: int = 0
    """Most messages the channel may hold (memory and disk); 0: no limit."""
    max_bytes: int = 0
    """Most bytes the channel may hold; 0: no limit."""
    max_attempts: int = 0
    """Deliveries before a message goes to the dead-letter topic; 0: no limit."""
    ttl_ns: int = 0
    """Messages older than this are dropped instead of delivered; 0: no limit."""


@dataclass(frozen=True)
class TopicPolicy:
    max_messages: int = 0
    """Most messages the topic may hold itself (while it has no channel or is paused); 0: no limit."""
    overflow: str = "reject"
    """What a full topic or channel does: ``reject`` publishes, or ``drop-oldest``."""
    durable: bool = False
    """Confirm a publish only once it is fsynced (write-through to disk)."""
    channel: ChannelPolicy = field(default_factory=ChannelPolicy)
    """Defaults for the topic's channels."""


#: the names used over HTTP and in nsqd.dat, with their types
TOPIC_FIELDS = {"max_messages": int, "overflow": str, "durable": bool, "channel_max_messages": int,
                "channel_max_bytes": int, "max_attempts": int, "message_ttl_ms": int}
CHANNEL_FIELDS = {"max_messages": int, "max_bytes": int, "max_attempts": int, "message_ttl_ms": int}


def defaults(options: Options) -> TopicPolicy:
    """The policy the daemon's flags give every topic."""
    return TopicPolicy(
        max_messages=options.topic_max_messages,
        overflow=options.overflow_policy,
        durable=options.durable,
        channel=ChannelPolicy(max_messages=options.channel_max_messages, max_bytes=options.channel_max_bytes,
                              max_attempts=options.max_attempts, ttl_ns=int(options.message_ttl * 1e9)))


def topic_document(policy: TopicPolicy) -> dict:
    """The flat form of a topic policy (HTTP answers, nsqd.dat)."""
    return {"max_messages": policy.max_messages, "overflow": policy.overflow, "durable": policy.durable,
            "channel_max_messages": policy.channel.max_messages, "channel_max_bytes": policy.channel.max_bytes,
            "max_attempts": policy.channel.max_attempts, "message_ttl_ms": policy.channel.ttl_ns // 1_000_000}


def channel_document(policy: ChannelPolicy) -> dict:
    return {"max_messages": policy.max_messages, "max_bytes": policy.max_bytes,
            "max_attempts": policy.max_attempts, "message_ttl_ms": policy.ttl_ns // 1_000_000}


def with_topic_changes(policy: TopicPolicy, changes: dict) -> TopicPolicy:
    """A topic policy with the flat ``changes`` applied (validated)."""
    _check(changes, TOPIC_FIELDS)
    channel = replace(policy.channel, **_channel_kwargs(changes, prefix="channel_"))
    top = {key: changes[key] for key in ("max_messages", "overflow", "durable") if key in changes}
    if top.get("overflow", policy.overflow) not in OVERFLOW_POLICIES:
        raise PolicyError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}")
    return replace(policy, **top, channel=channel)


def with_channel_changes(policy: ChannelPolicy, changes: dict) -> ChannelPolicy:
    _check(changes, CHANNEL_FIELDS)
    return replace(policy, **_channel_kwargs(changes, prefix=""))


def _channel_kwargs(changes: dict, prefix: str) -> dict:
    out = {}
    for key in ("max_messages", "max_bytes"):
        if prefix + key in changes:
            out[key] = changes[prefix + key]
    if "max_attempts" in changes:
        out["max_attempts"] = changes["max_attempts"]
    if "message_ttl_ms" in changes:
        out["ttl_ns"] = changes["message_ttl_ms"] * 1_000_000
    return out


def _check(changes: dict, allowed: dict) -> None:
    for key, value in changes.items():
        kind = allowed.get(key)
        if kind is None:
            raise PolicyError(f"unknown policy field {key!r}")
        if type(value) is not kind or (kind is int and value < 0):
            raise PolicyError(f"{key} must be a {'non-negative integer' if kind is int else kind.__name__}")


def overrides(document: dict, default: dict) -> dict:
    """The fields of ``document`` that differ from ``default`` (what nsqd.dat keeps)."""
    return {key: value for key, value in document.items() if value != default[key]}

