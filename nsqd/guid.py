"""Message ids: 16 lowercase hex digits, unique per daemon across restarts, in nsqd's layout.

As nsqd's guid the value is ``tick << 22 | node_id << 12 | sequence``, where
a tick is ``UnixNano >> 20`` (about a millisecond) counted from nsqd's epoch,
so ids decode as Go's do and daemons with different ``--node-id`` never mint
the same id. A tick holds 4,096 ids; where nsqd sleeps into the next tick
once they are used, a batch here borrows the ticks after it (a 100,000-message
``MPUB`` runs about 25 ms ahead of the clock), and the next batch starts at the
later of that and the clock. A crash saves no ``last_message_id``, so a
daemon starts ahead of the clock by a second plus the ticks the biggest
body can take (an HTTP ``/mpub`` of one-byte lines: 2.6 million ids, 640
ticks, in 5 MiB): once one has run that long, what it minted ahead is
behind where the next start begins, however quick the restart (a younger
one has its successor's start-up, about 0.3 s, on its side). A batch is
one clock read plus one cheap format per id.
"""

from __future__ import annotations

import time

_LOW_DIGITS = [b"%02x" % i for i in range(256)]
#: ids are 64 bits (16 hex digits, the width of the frame's id field)
ID_LIMIT = 1 << 64
#: nsqd's epoch, in its ticks (it subtracts this from ``UnixNano >> 20``)
TWEPOCH = 1288834974288
SEQUENCE_BITS = 12
TICK_SHIFT = 22
PER_TICK = 1 << SEQUENCE_BITS
#: a saved floor further ahead of the clock than this (a day of ticks) is not followed: it was
#: written in this daemon's earlier layout (unix milliseconds << 22, far above nsqd's), or edited
FLOOR_AHEAD_TICKS = 86_400 * 1_000_000_000 >> 20
#: how far ahead of the clock a daemon starts, besides the ticks its biggest body can take
START_AHEAD_TICKS = 1_000_000_000 >> 20


def start_ahead(max_body_size: int) -> int:
    """Ticks a daemon starts ahead: a second plus those of a body of one-byte messages (2 bytes each)."""
    return START_AHEAD_TICKS + max_body_size // 2 // PER_TICK


def clock_tick() -> int:
    return (time.time_ns() >> 20) - TWEPOCH


class GUIDFactory:
    def __init__(self, node_id: int, floor: int = 0, ahead: int = START_AHEAD_TICKS) -> None:
        """``floor``: no id below it is minted (the saved last id + 1), unless it is far ahead;
        ``ahead``: ticks ahead of the clock to start at (see :func:`start_ahead`)."""
        if not 0 <= node_id < 1024:
            raise ValueError(f"node id {node_id} out of range 0-1023")
        self._node_bits = node_id << SEQUENCE_BITS
        now = clock_tick()
        floor_tick = floor >> TICK_SHIFT
        #: the tick being used and its next sequence number
        self._tick, self._sequence = now + ahead, 0
        if now <= floor_tick <= now + FLOOR_AHEAD_TICKS:  # ids up to the floor may be ahead of the clock
            self._tick = max(self._tick, floor_tick + 1)
        self._last = floor - 1 if floor else 0

    def new_ids(self, count: int) -> list[bytes]:
        now = clock_tick()
        if now > self._tick:
            self._tick, self._sequence = now, 0
        tick, sequence = self._tick, self._sequence
        node_bits = self._node_bits
        if count == 1 and sequence < PER_TICK:  # a single PUB
            value = tick << TICK_SHIFT | node_bits | sequence
            self._sequence = sequence + 1
            self._last = value
            return [b"%016x" % value]
        ids: list[bytes] = []
        left = count
        while left:
            if sequence == PER_TICK:
                tick, sequence = tick + 1, 0
            run = min(left, PER_TICK - sequence)
            n = tick << TICK_SHIFT | node_bits | sequence
            stop = n + run
            # consecutive ids share all but their last two hex digits: format the shared
            # prefix once per 256 ids and append the digits from a table
            while n < stop:
                low = n & 0xFF
                take = min(stop - n, 256 - low)
                prefix = b"%014x" % (n >> 8)
                ids += [prefix + digits for digits in _LOW_DIGITS[low:low + take]]
                n += take
            sequence += run
            left -= run
            self._last = stop - 1
        self._tick, self._sequence = tick, sequence
        return ids

    def new_id(self) -> bytes:
        return self.new_ids(1)[0]

    @property
    def last(self) -> int:
        """The highest value handed out so far (persisted as a floor)."""
        return self._last
