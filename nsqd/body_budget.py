"""Memory for big command bodies, shared by every connection (``--max-body-memory``).

Each connection may hold one partial command, and a body may be
``--max-body-size`` (5 MiB): a few hundred clients that each send most of an
``MPUB`` body and stall (as Go nsqd, which allocates the body before reading
it, would let them) held gigabytes until their read deadlines ran out. A
connection about to receive a big body (TCP: one that a read cannot bring
whole; HTTP: over ``BIG_BODY``) takes the whole body's size from this budget
first, and gives it back once the command is done or
the connection ends; while the budget lacks room it reads nothing more
(TCP's flow control holds the sender) for up to ``ROOM_WAIT``. A body is
reserved whole before more of it is read, so clients waiting for room never
hold parts of it that they cannot complete: no deadlock. One body bigger
than the whole budget takes all of it. A body that finds no room within
``ROOM_WAIT`` is read and dropped as it arrives (no memory held) and its
command refused with a "try again" error: clients that declare big bodies
and send nothing hold the budget for nothing, and without the bound their
victims waited for as long as the attackers cared to reconnect.

The AMQP gateway takes from it too, frame by frame, for what a connection
holds of unfinished multi-frame deliveries past ``BIG_BODY``; it never waits
(``try_take``): its links share one socket, so waiting for one delivery
would stall the others that could finish. A delivery without room is
dropped and refused instead.
"""

from __future__ import annotations

import trio

#: bodies up to this size need no reservation (ordinary publishes: hundreds of messages)
BIG_BODY = 1024 * 1024
#: how long a big body waits for room before it is refused (dropped as it arrives)
ROOM_WAIT = 5.0
#: what a refused body's command answers, after its name
NO_ROOM = "no memory free for its body (--max-body-memory is in use by other clients); try again"


class BodyBudget:
    """Bytes reserved for bodies being received; ``capacity`` 0 means no limit."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        #: reservations that waited for room, and those refused for want of it (for /metrics)
        self.waits = 0
        self.refusals = 0
        self._lot = trio.lowlevel.ParkingLot()

    def clamp(self, size: int) -> int:
        return min(size, self.capacity) if self.capacity else size

    def try_take(self, size: int) -> bool:
        size = self.clamp(size)
        if self.capacity and self.used + size > self.capacity:
            return False
        self.used += size
        return True

    async def take(self, size: int) -> bool:
        """Reserve ``size`` bytes, waiting up to ``ROOM_WAIT`` for room; False (nothing taken)
        if there was none by then. Callers give back what they took."""
        if self.try_take(size):
            return True
        self.waits += 1
        with trio.move_on_after(ROOM_WAIT):
            while not self.try_take(size):
                await self._lot.park()
            return True
        self.refusals += 1
        return False

    def give_back(self, size: int) -> None:
        self.used -= self.clamp(size)
        self._lot.unpark_all()
