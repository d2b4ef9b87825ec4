"""The in-flight messages of one consumer: a deadline-ordered map.

nsqd keeps a per-channel priority heap with one entry per message. Here each
consumer has one insertion-ordered dict ``id -> Delivery``: a consumer's
message timeout is fixed, so insertion order *is* deadline order, and the dict
is a priority queue whose minimum is its first live entry. TOUCH pops and
re-inserts (the new deadline is the latest), FIN is one ``dict.pop``. Every
message sent to the consumer in one write shares one :class:`Delivery`
record, inserted with ``dict.fromkeys`` (a C loop): no per-message heap entry
and nothing kept once a message is finished.
"""

from __future__ import annotations

from itertools import islice


class Delivery:
    """Messages sent to one consumer in one batch; they share a deadline."""

    __slots__ = ("deadline", "delivered_at", "ids", "frames", "_index")

    def __init__(self, deadline: int, delivered_at: int, ids: list[bytes], frames: list[bytes]) -> None:
        self.deadline = deadline
        self.delivered_at = delivered_at
        self.ids = ids
        self.frames = frames
        self._index: dict[bytes, bytes] | None = None

    def frame(self, msg_id: bytes) -> bytes:
        """The frame of one message of the batch (built lazily: REQ and timeouts are rare)."""
        if self._index is None:
            self._index = dict(zip(self.ids, self.frames))
        return self._index[msg_id]


class InFlight:
    """Messages delivered to one consumer and not yet finished, in deadline order."""

    __slots__ = ("map",)

    def __init__(self) -> None:
        self.map: dict[bytes, Delivery] = {}

    def __len__(self) -> int:
        return len(self.map)

    def __contains__(self, msg_id: bytes) -> bool:
        return msg_id in self.map

    def add(self, ids: list[bytes], frames: list[bytes], deadline: int, now: int) -> None:
        self.map.update(dict.fromkeys(ids, Delivery(deadline, now, ids, frames)))

    def finish(self, msg_id: bytes) -> bool:
        return self.map.pop(msg_id, None) is not None

    def take(self, msg_id: bytes) -> bytes | None:
        """Remove a message and return its frame (REQ)."""
        delivery = self.map.pop(msg_id, None)
        return None if delivery is None else delivery.frame(msg_id)

    def touch(self, msg_id: bytes, now: int, timeout: int, max_timeout: int) -> bool:
        """Move a message's deadline to ``now + timeout``, capped at delivery + max."""
        delivery = self.map.pop(msg_id, None)
        if delivery is None:
            return False
        frame = delivery.frame(msg_id)
        deadline = min(now + timeout, delivery.delivered_at + max_timeout)
        self.map[msg_id] = Delivery(deadline, delivery.delivered_at, [msg_id], [frame])
        return True

    def next_deadline(self) -> int | None:
        for delivery in self.map.values():
            return delivery.deadline
        return None

    def expire(self, now: int) -> list[bytes]:
        """Remove and return the frames whose deadline has passed, oldest first."""
        expired = []
        for msg_id, delivery in self.map.items():
            if delivery.deadline > now:
                break
            expired.append(msg_id)
        if not expired:
            return []
        pop = self.map.pop
        return [pop(msg_id).frame(msg_id) for msg_id in expired]

    def drain(self) -> list[bytes]:
        """Remove and return every frame, in delivery order."""
        frames = [delivery.frame(msg_id) for msg_id, delivery in self.map.items()]
        self.map.clear()
        return frames

    def peek(self, count: int) -> list[tuple[bytes, int]]:
        """``(id, deadline)`` of the first ``count`` messages, for stats and tests."""
        return [(msg_id, d.deadline) for msg_id, d in islice(self.map.items(), count)]
