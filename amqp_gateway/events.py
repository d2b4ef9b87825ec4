"""What the engine reports after reading bytes: one frozen dataclass per happening.

The engine answers what the spec leaves no choice about by itself (open,
begin, end, close, detach replies, echo of session flow); the events tell the
application what it must decide or act on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .link import Link
    from .performatives import Error, Open
    from .session import Session



class NoRoom:
    """The payload of a multi-frame delivery that found no room in the memory shared by every
    connection (``Connection.partial_budget``): it was not kept, and is refused."""

    __slots__ = ()


NO_ROOM = NoRoom()

#: one complete incoming delivery: (delivery-id, delivery-tag, settled, payload); the payload is
#: None when the message exceeded the link's max-message-size, NO_ROOM when it was not kept
IncomingDelivery = tuple[int, bytes, bool, "bytes | NoRoom | None"]


@dataclass(frozen=True, slots=True)
class SaslLogin:
    """A PLAIN login awaits the application's check: answer with ``connection.sasl_verdict(ok)``.

    Nothing after the sasl-init is read until then.
    """

    username: str
    password: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class ConnectionOpened:
    open: Open


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The connection is over: the peer closed it, or we did because of ``error``."""

    error: Error | None
    by_peer: bool


@dataclass(frozen=True, slots=True)
class SessionBegun:
    session: Session


@dataclass(frozen=True, slots=True)
class SessionEnded:
    """A session and all its links are gone (``by_peer`` False: we ended it on ``error``)."""

    session: Session
    error: Error | None
    by_peer: bool


@dataclass(frozen=True, slots=True)
class LinkAttaching:
    """The peer attached a link: answer with ``link.attach(...)`` or ``link.refuse(...)``."""

    link: Link


@dataclass(frozen=True, slots=True)
class LinkAttached:
    """The peer answered an attach we sent."""

    link: Link


@dataclass(frozen=True, slots=True)
class LinkDetached:
    link: Link
    error: Error | None
    by_peer: bool


@dataclass(frozen=True, slots=True)
class LinkFlow:
    """The peer's flow state for a link has been applied (credit recomputed)."""

    link: Link
    drain: bool
    echo: bool


@dataclass(frozen=True, slots=True)
class SessionFlow:
    """The peer updated session windows (our outgoing window may have opened)."""

    session: Session


@dataclass(frozen=True, slots=True)
class Transfers:
    """Complete deliveries that arrived in a row on one link."""

    link: Link
    deliveries: list[IncomingDelivery] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Settled:
    """The peer settled, or gave a terminal outcome for, deliveries we sent on ``link``."""

    link: Link
    tags: list[bytes]
    state: Any
    settled: bool
