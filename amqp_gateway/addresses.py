"""Node addresses: ``/topics/<topic>`` to publish, ``/topics/<topic>/channels/<channel>`` to consume.

Names follow NSQ's rules (``nsqd.names``, ``#ephemeral`` allowed) and are
taken literally: no percent-decoding. A URI (``amqps://host/topics/t``)
names the same node as its path. An address of another shape names no
node we have (``amqp:not-found``); a well-shaped address with a bad name, or
a missing address, is ``amqp:invalid-field``; dynamic nodes and termini other
than source and target are ``amqp:not-implemented``.
"""

from __future__ import annotations

from nsqd.names import is_valid_channel_name, is_valid_topic_name

from .errors import INVALID_FIELD, NOT_FOUND, NOT_IMPLEMENTED, LinkRefused


def _path(address: str) -> str:
    """The address without an ``amqp://host:port`` or ``amqps://...`` in front, as some clients
    (uamqp, the Azure SDKs) always send it."""
    scheme, sep, rest = address.partition("://")
    if sep and scheme.lower() in ("amqp", "amqps"):
        _, slash, path = rest.partition("/")
        return slash + path
    return address


def _parts(address: object) -> list[str]:
    if not isinstance(address, str) or not address:
        raise LinkRefused(INVALID_FIELD, "the link needs an address")
    parts = _path(address).split("/")
    if parts[0] != "" or len(parts) < 2 or parts[1] != "topics":
        raise LinkRefused(NOT_FOUND, f"no node at {address!r}: use /topics/<topic>[/channels/<channel>]")
    return parts[2:]


def _topic(name: str, address: str) -> str:
    if not is_valid_topic_name(name):
        raise LinkRefused(INVALID_FIELD, f"invalid topic name {name!r} in {address!r}")
    return name


def topic_address(address: object) -> str:
    """The topic a sender link publishes to (its target address)."""
    parts = _parts(address)
    if len(parts) != 1:
        raise LinkRefused(NOT_FOUND, f"no node at {address!r}: publish to /topics/<topic>")
    return _topic(parts[0], address)


def channel_address(address: object) -> tuple[str, str]:
    """The topic and channel a receiver link consumes from (its source address)."""
    parts = _parts(address)
    if len(parts) != 3 or parts[1] != "channels":
        raise LinkRefused(NOT_FOUND, f"no node at {address!r}: consume from /topics/<topic>/channels/<channel>")
    topic = _topic(parts[0], address)
    if not is_valid_channel_name(parts[2]):
        raise LinkRefused(INVALID_FIELD, f"invalid channel name {parts[2]!r} in {address!r}")
    return topic, parts[2]


def terminus(node: object, kind: type, usage: str):
    """The client's source or target if it can name one of our nodes; else why not.

    A terminus of another type (a coordinator target, for transactions) and a
    dynamic node are functions we lack (``amqp:not-implemented``); a dynamic
    node that has an address anyway breaks spec 3.5.3 (``amqp:invalid-field``).
    """
    if node is None:
        raise LinkRefused(INVALID_FIELD, usage)
    if not isinstance(node, kind):
        descriptor = getattr(node, "descriptor", type(node).__name__)
        raise LinkRefused(NOT_IMPLEMENTED, f"terminus {descriptor!r} is not supported: {usage}")
    if node.dynamic:
        if node.address is not None:
            raise LinkRefused(INVALID_FIELD, "a dynamic node must not have an address")
        raise LinkRefused(NOT_IMPLEMENTED, f"dynamic nodes are not supported: {usage}")
    return node
