"""AMQP error conditions (spec 2.8.15-2.8.18) and the exceptions that carry them.

The engine raises :class:`ConnectionFault` or :class:`SessionFault` where the
spec says the peer broke a rule; each is turned into ``close`` or ``end`` with
the condition, never into a crash (a link rule broken detaches that link).
The gateway raises :class:`LinkRefused` for a link it cannot serve.
"""

from __future__ import annotations

from .performatives import Error

# amqp-error
INTERNAL_ERROR = "amqp:internal-error"
NOT_FOUND = "amqp:not-found"
UNAUTHORIZED_ACCESS = "amqp:unauthorized-access"
DECODE_ERROR = "amqp:decode-error"
RESOURCE_LIMIT_EXCEEDED = "amqp:resource-limit-exceeded"
NOT_ALLOWED = "amqp:not-allowed"
INVALID_FIELD = "amqp:invalid-field"
NOT_IMPLEMENTED = "amqp:not-implemented"
FRAME_SIZE_TOO_SMALL = "amqp:frame-size-too-small"
RESOURCE_DELETED = "amqp:resource-deleted"
ILLEGAL_STATE = "amqp:illegal-state"
# connection-error
CONNECTION_FORCED = "amqp:connection:forced"
FRAMING_ERROR = "amqp:connection:framing-error"
# session-error
WINDOW_VIOLATION = "amqp:session:window-violation"
HANDLE_IN_USE = "amqp:session:handle-in-use"
UNATTACHED_HANDLE = "amqp:session:unattached-handle"
# link-error
TRANSFER_LIMIT_EXCEEDED = "amqp:link:transfer-limit-exceeded"
MESSAGE_SIZE_EXCEEDED = "amqp:link:message-size-exceeded"


class Fault(Exception):
    """A rule broken by the peer; ``error`` is what we answer with."""

    def __init__(self, condition: str, description: str) -> None:
        super().__init__(f"{condition}: {description}")
        self.error = Error(condition, description)


class ConnectionFault(Fault):
    """Ends the whole connection with ``close``."""


class SessionFault(Fault):
    """Ends one session with ``end``."""


class LinkRefused(Exception):
    """A link the gateway will not serve: its attach is answered with a null node, then this error."""

    def __init__(self, condition: str, description: str) -> None:
        super().__init__(description)
        self.error = Error(condition, description)
