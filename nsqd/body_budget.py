"""Memory for big command bodies, shared by every connection (``--max-body-memory``).

Each connection may hold one partial command, and a body may be
``--max-body-size`` (5 MiB): a few hundred clients that each send most of an
``MPUB`` body and stall (as Go nsqd, which allocates the body before reading
it, would let them) held gigabytes until their read deadlines ran out. A
connection about to receive a body over ``BIG_BODY`` takes the whole body's
size from this budget first, and gives it back once the command is done or
the connection ends; while the budget lacks room it reads nothing more
(TCP's flow control holds the sender), and its read deadline keeps running.
A body is reserved whole before more of it is read, so clients waiting for
room never hold parts of it that they cannot complete: no deadlock. One
body bigger than the whole budget takes all of it.

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


class BodyBudget:
    """Bytes reserved for bodies being received; ``capacity`` 0 means no limit."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        #: reservations that waited for room, for /stats and tests
        self.waits = 0
        self._lot = trio.lowlevel.ParkingLot()

    def clamp(self, size: int) -> int:
        return min(size, self.capacity) if self.capacity else size

    def try_take(self, size: int) -> bool:
        size = self.clamp(size)
        if self.capacity and self.used + size > self.capacity:
            return False
        self.used += size
        return True

    async def take(self, size: int) -> None:
        """Reserve ``size`` bytes, waiting for room (callers give back what they took)."""
        if self.try_take(size):
            return
        self.waits += 1
        while not self.try_take(size):
            await self._lot.park()

    def give_back(self, size: int) -> None:
        self.used -= self.clamp(size)
        self._lot.unpark_all()
