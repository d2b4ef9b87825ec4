"""AMQP 1.0 gateway: AMQP clients publish to topics and consume from channels.

The engine modules (codec, composite, performatives, sections, framing,
sasl, connection, session, link, events, serial, errors) are a sans-I/O
AMQP 1.0 implementation; gateway, consumer, publisher, mapping and
addresses bind it to the daemon; server runs it on Trio sockets and auth is
where logins are checked. See docs/amqp.md.
"""

from .server import serve_amqp

__all__ = ["serve_amqp"]
