"""One writer at a time on a connection, without a lock per write.

The reader task and the pump task of a connection may both have frames to
send. Whoever finds the write path free takes the turn and keeps writing
(refilling before each send) until nothing is left; a pump that finds it
busy simply leaves, since the active writer will pick its frames up; a reader
waits for the turn to end before reading more, which is what back-pressures
a client that does not read.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio


class WriteTurn:
    def __init__(self) -> None:
        self.busy = False
        self._idle = trio.Event()

    async def take(self, wait: bool) -> bool:
        """Take the turn; without ``wait``, give up (False) when it is taken."""
        while self.busy:
            if not wait:
                return False
            await self._idle.wait()
        self.busy = True
        return True

    def give_back(self) -> None:
        self.busy = False
        idle, self._idle = self._idle, trio.Event()
        idle.set()

    @asynccontextmanager
    async def held(self):
        """Hold the turn for a block (for instance while the stream is replaced)."""
        await self.take(wait=True)
        try:
            yield
        finally:
            self.give_back()
