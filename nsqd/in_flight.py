"""In-flight messages of one holder (a subscription or a lease): a deadline-ordered map.

nsqd keeps a per-channel priority heap with one entry per message. Here each
holder has one insertion-ordered dict ``id -> Delivery``: a holder's message
timeout is fixed, so insertion order *is* deadline order, and the dict is a
priority queue whose minimum is its first live entry. TOUCH pops and
re-inserts (the new deadline is the latest), FIN is one ``dict.pop``. Every
message sent in one write shares one :class:`Delivery` record, inserted with
``dict.fromkeys`` (a C loop): no per-message heap entry and nothing kept once
a message is finished.

A delivery remembers where its messages are on disk (``positions``, see
:mod:`nsqd.channel`): the channel's disk queue keeps those records until the
messages are finished, so a crash delivers them again instead of losing them.
"""

from __future__ import annotations

from itertools import islice

from .message import frame_id_of

#: one message taken out of in-flight: its frame and its disk position (None: memory only)
Item = tuple[bytes, "int | None"]


class Delivery:
    """Messages sent to one holder in one batch; they share a deadline."""

    __slots__ = ("deadline", "delivered_at", "ids", "frames", "positions", "noted", "moved", "_index")

    def __init__(self, deadline: int, delivered_at: int, ids: list[bytes], frames: list[bytes],
                 positions: list[int] | tuple[int, ...] | None) -> None:
        self.deadline = deadline
        self.delivered_at = delivered_at
        self.ids = ids
        self.frames = frames
        self.positions = positions
        #: a checkpoint kept it whole once (see :meth:`InFlight.kept`)
        self.noted = False
        #: a message of it left other than finished (REQ, reject, TOUCH, timeout): its record may
        #: be listed by its new holder, so the batch is never kept whole (see :meth:`InFlight.kept`)
        self.moved = False
        self._index: dict[bytes, int] | None = None

    def locate(self, msg_id: bytes) -> int:
        """The index of one message in the batch (built lazily: REQ and timeouts are rare)."""
        if self._index is None:
            self._index = dict(zip(self.ids, range(len(self.ids))))
        return self._index[msg_id]

    def item(self, msg_id: bytes) -> Item:
        index = self.locate(msg_id)
        positions = self.positions
        return self.frames[index], None if positions is None else positions[index]

    def frame(self, msg_id: bytes) -> bytes:
        return self.frames[self.locate(msg_id)]


class InFlight:
    """Messages delivered to one holder and not yet finished, in deadline order."""

    __slots__ = ("map", "deliveries", "refine_later")

    def __init__(self) -> None:
        self.map: dict[bytes, Delivery] = {}
        #: the deliveries made, oldest first; those with nothing left in flight are dropped by :meth:`kept`
        self.deliveries: list[Delivery] = []
        #: the last :meth:`kept` kept a batch whole for the first time: the next one should look again
        self.refine_later = False

    def __len__(self) -> int:
        return len(self.map)

    def __contains__(self, msg_id: bytes) -> bool:
        return msg_id in self.map

    def add(self, ids: list[bytes], frames: list[bytes], positions, deadline: int, now: int) -> None:
        delivery = Delivery(deadline, now, ids, frames, positions)
        self.map.update(dict.fromkeys(ids, delivery))
        if positions is not None:
            self.deliveries.append(delivery)

    def add_items(self, items: list[Item], deadline: int, now: int) -> None:
        """Add messages taken out earlier (a reopened lease, a restart), in order.

        Disk-backed and memory-only messages go in separate deliveries, so each
        delivery's ``positions`` stays all positions (a tuple: not neighbours) or None.
        """
        for ids, frames, positions in pieces(items):
            self.add(ids, frames, positions, deadline, now)

    def finish(self, msg_id: bytes) -> bool:
        return self.map.pop(msg_id, None) is not None

    def take(self, msg_id: bytes) -> Item | None:
        """Remove a message and return it (REQ, reject)."""
        delivery = self.map.pop(msg_id, None)
        if delivery is None:
            return None
        delivery.moved = True
        return delivery.item(msg_id)

    def touch(self, msg_id: bytes, now: int, timeout: int, max_timeout: int) -> bool:
        """Move a message's deadline to ``now + timeout``, capped at delivery + max."""
        delivery = self.map.pop(msg_id, None)
        if delivery is None:
            return False
        deadline = min(now + timeout, delivery.delivered_at + max_timeout)
        if len(delivery.ids) == 1:  # touched before, or delivered alone: the same delivery moves on
            delivery.deadline = deadline
            self.map[msg_id] = delivery
            return True
        delivery.moved = True
        frame, pos = delivery.item(msg_id)
        self.map[msg_id] = touched = Delivery(deadline, delivery.delivered_at, [msg_id], [frame],
                                              None if pos is None else (pos,))
        if pos is not None:
            self.deliveries.append(touched)
        return True

    def next_deadline(self) -> int | None:
        for delivery in self.map.values():
            return delivery.deadline
        return None

    def expire(self, now: int, limit: int | None = None) -> list[Item]:
        """Remove and return the messages whose deadline has passed, oldest first (at most ``limit``)."""
        expired = []
        for msg_id, delivery in self.map.items():
            if delivery.deadline > now or len(expired) == limit:
                break
            expired.append(msg_id)
        if not expired:
            return []
        pop = self.map.pop
        items = []
        for msg_id in expired:
            delivery = pop(msg_id)
            delivery.moved = True
            items.append(delivery.item(msg_id))
        return items

    def drain(self) -> list[Item]:
        """Remove and return every message, in delivery order."""
        items = [delivery.item(msg_id) for msg_id, delivery in self.map.items()]
        self.map.clear()
        self.deliveries = []
        return items

    def clear(self) -> None:
        self.map.clear()
        self.deliveries = []

    def peek(self, count: int) -> list[tuple[bytes, int]]:
        """``(id, deadline)`` of the first ``count`` messages, for stats and tests."""
        return [(msg_id, d.deadline) for msg_id, d in islice(self.map.items(), count)]

    def kept(self, note: object, singles: bool = False) -> tuple[list[tuple[int, int, object]], int]:
        """Disk intervals of the deliveries that still have a message in flight, with ``note``.

        A delivery whose messages are neighbours on disk (``positions`` is a
        list) is one interval at the first checkpoint that sees it, even when
        some of its messages were finished already (most deliveries are
        finished before the next one, and the snapshot stays one entry per
        delivery; ``refine_later`` then asks for another checkpoint); from the
        next checkpoint on only its unfinished messages are kept, as runs of
        neighbours, so a consumer holding one message of a batch does not make
        a crash deliver the rest again. A delivery a message left other than
        finished (REQ, reject, TOUCH, a timeout) is never kept whole: that
        message's new holder (the queue, the deferred heap or index, another
        delivery, the dead letters) lists its record too, and a whole interval
        counted it a second time, so the depth rebuilt after a crash counted
        records that are read back only once. Scattered
        messages (``positions`` a tuple), or every message with ``singles``,
        are one interval each. Returns the intervals and how many messages
        they cover.
        """
        out: list[tuple[int, int, object]] = []
        count = 0
        finished = self.map.keys().isdisjoint
        live: list[Delivery] = []
        self.refine_later = False
        live_map = self.map
        for delivery in self.deliveries:
            if finished(delivery.ids) or not any(live_map.get(msg_id) is delivery for msg_id in delivery.ids):
                continue  # every message of it is finished, or in flight under a later delivery: forget it
            live.append(delivery)
            positions = delivery.positions
            if positions is None:
                continue
            if singles or type(positions) is not list:
                held = [(pos, pos, note) for msg_id, pos in zip(delivery.ids, positions)
                        if self.map.get(msg_id) is delivery]
                out += held
                count += len(held)
            elif delivery.noted or delivery.moved:
                count += _live_runs(delivery, self.map, note, out)
            else:
                delivery.noted = True
                self.refine_later = True
                out.append((positions[0], positions[-1], note))
                count += len(positions)
        self.deliveries = live
        return out, count


def _live_runs(delivery: Delivery, live: dict[bytes, Delivery], note: object, out: list) -> int:
    """Runs of neighbouring messages of ``delivery`` still in flight in it, as intervals; returns their count."""
    positions = delivery.positions
    count = 0
    start = -1
    for index, msg_id in enumerate(delivery.ids):
        if live.get(msg_id) is delivery:
            count += 1
            if start < 0:
                start = index
        elif start >= 0:
            out.append((positions[start], positions[index - 1], note))
            start = -1
    if start >= 0:
        out.append((positions[start], positions[-1], note))
    return count


def pieces(items: list[Item]) -> list[tuple[list[bytes], list[bytes], tuple[int, ...] | None]]:
    """Items as ``(ids, frames, positions)`` runs that keep disk-backed and memory-only messages apart."""
    out = []
    start = 0
    while start < len(items):
        on_disk = items[start][1] is not None
        end = start + 1
        while end < len(items) and (items[end][1] is not None) == on_disk:
            end += 1
        frames = [frame for frame, _ in items[start:end]]
        positions = tuple(pos for _, pos in items[start:end]) if on_disk else None
        out.append((list(map(frame_id_of, frames)), frames, positions))
        start = end
    return out
