"""The connection budget NSQ TCP and AMQP clients share (``--max-connections``)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import structlog
import trio

log = structlog.get_logger("nsqd")

#: after a fatal error frame, the longest we wait for the client to hang up first
LINGER = 1.0
#: refused connections lingering at once; past this, they are closed without waiting
MAX_REFUSING = 64


class ConnectionSlots:
    """The ``--max-connections`` budget, shared by NSQ TCP and AMQP clients (0: no limit).

    A connection takes a slot when it is accepted and gives it back when it
    ends; one that finds none is refused with its protocol's own error.
    Refused connections linger (up to ``LINGER``) for the client to read that
    error, but at most ``MAX_REFUSING`` of them at once, so a flood cannot use
    up the descriptors kept free for HTTP; the others are closed right after
    the error is written.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.refusing = 0

    def take(self) -> bool:
        if self.limit and self.used >= self.limit:
            return False
        self.used += 1
        return True

    def give_back(self) -> None:
        self.used -= 1

    @asynccontextmanager
    async def refusal(self, stream: trio.abc.Stream):
        """Around a refused connection's farewell; yields how long it may linger, closes the stream."""
        linger = LINGER if self.refusing < MAX_REFUSING else 0.0
        self.refusing += 1
        try:
            with trio.move_on_after(LINGER + linger):
                yield linger
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.refusing -= 1
            await close_stream(stream)


async def close_stream(stream: trio.abc.AsyncResource, *, remote: str = "") -> None:
    """Close a connection's stream, shielded, within a second; never raises.

    A connection's end must not end the daemon: closing can fail when the
    connection broke in an unusual way (a read still registered on its
    descriptor), and the error would reach the nursery every connection
    runs in.
    """
    with trio.CancelScope(shield=True), trio.move_on_after(1):
        try:
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:
            log.exception("closing a connection failed", client=remote)
