"""Message ids: 16 lowercase hex digits, unique per daemon across restarts.

Like nsqd's guid the value is ``ms timestamp << 22 | node_id << 12 | sequence``
but the sequence simply counts on: each batch starts at the larger of the
counter and the current clock value, so ids stay time-ordered, a restart
(later clock) never reuses an id while the long-run rate stays below 4M ids/s,
and minting a batch is one clock read plus one cheap format per id.
"""

from __future__ import annotations

import time

_LOW_DIGITS = [b"%02x" % i for i in range(256)]
#: ids are 64 bits (16 hex digits, the width of the frame's id field)
ID_LIMIT = 1 << 64


class GUIDFactory:
    def __init__(self, node_id: int, floor: int = 0) -> None:
        if not 0 <= node_id < 1024:
            raise ValueError(f"node id {node_id} out of range 0-1023")
        self._node_bits = node_id << 12
        self._next = max(floor, self._clock())

    def _clock(self) -> int:
        return (time.time_ns() // 1_000_000) << 22 | self._node_bits

    def new_ids(self, count: int) -> list[bytes]:
        start = max(self._next, self._clock())
        if start + count > ID_LIMIT:  # a floor near the top (an edited nsqd.dat): the clock is far below it
            start = self._clock()
        self._next = stop = start + count
        if count == 1:  # a single PUB
            return [b"%016x" % start]
        # consecutive ids share all but their last two hex digits: format the
        # shared prefix once per 256 ids and append the digits from a table
        ids: list[bytes] = []
        n = start
        while n < stop:
            low = n & 0xFF
            take = min(stop - n, 256 - low)
            prefix = b"%014x" % (n >> 8)
            ids += [prefix + digits for digits in _LOW_DIGITS[low:low + take]]
            n += take
        return ids

    def new_id(self) -> bytes:
        return self.new_ids(1)[0]

    @property
    def last(self) -> int:
        """The highest value handed out so far (persisted as a floor)."""
        return self._next - 1
