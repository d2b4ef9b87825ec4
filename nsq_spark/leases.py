"""Reading a partition under leases, and settling leases by name.

A partition of micro-batch ``b`` of run ``r`` reads under lease ``r:b:p``.
RDY bounds what a connection holds in flight, leased messages included, and
leased messages stay in flight until the driver settles them, so a partition
that wants more than ``maxInFlight`` messages reads in segments: once one is
half full it opens the next, ``r:b:p.1``, ``r:b:p.2`` and so on (nsqd seals
the previous one with what it has sent by then). Segments are opened in order
and each holds at least one message, so whoever walks them (a replay, the
driver's LFIN and LTOUCH) stops at the first that is missing.

Reopening a live lease sends exactly its messages again, so a replayed
partition yields what its first read yielded, as long as its leases have not
expired.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pyarrow as pa

from .client import FRAME_ERROR, FRAME_MESSAGE, FRAME_RESPONSE, Connection, NSQError
from .rows import Columns

#: a first read that has what it needs stops when nothing arrives for this long
IDLE_GAP = 0.05
#: rows per Arrow batch handed to Spark
BATCH_ROWS = 8192
#: lease commands sent before their answers are read, when walking segments
WINDOW = 16


def lease_base(run: str, batch: int, partition: int) -> str:
    return f"{run}:{batch}:{partition}"


def segment_name(base: str, segment: int) -> str:
    return base if segment == 0 else f"{base}.{segment}"


def unexpected(conn: Connection, kind: int, data: bytes, expected: str) -> NSQError:
    if kind == FRAME_ERROR:
        return NSQError(f"nsqd {conn.address}: {data.decode(errors='replace')}")
    return NSQError(f"nsqd {conn.address}: expected {expected}, got {data[:60]!r}")


def lease_reply(conn: Connection) -> dict:
    kind, data = conn.read_frame()
    if kind != FRAME_RESPONSE or not data.startswith(b"{"):
        raise unexpected(conn, kind, data, "a lease response")
    return json.loads(data)


def open_lease(conn: Connection, name: str, before: str = "", after: str = "", reply: dict | None = None) -> dict:
    """``LEASE name``, with the RDY commands to send around it; returns the lease response.

    ``reply`` is the response when the ``LEASE`` was sent already. Reopening a
    lease that holds nothing (one left open by a connection that is going
    away) seals it empty, and a sealed lease takes nothing: such a lease is
    dropped and opened afresh.
    """
    if reply is None:
        conn.send(f"{before}LEASE {name}\n{after}".encode())
        reply = lease_reply(conn)
    if reply["reopened"] and not reply["count"]:
        conn.send(f"RDY 0\nLEASE\n{before}LEASE {name}\n{after}".encode())
        lease_reply(conn)
        reply = lease_reply(conn)
    return reply


def settle(conn: Connection, base: str, verb: str) -> int:
    """``LFIN`` or ``LTOUCH`` every segment of the lease ``base``; returns how many messages."""
    total = 0
    first = 0
    while True:
        names = [segment_name(base, first + i) for i in range(WINDOW)]
        conn.send("".join(f"{verb} {name}\n" for name in names).encode())
        counts = [lease_reply(conn)["count"] for _ in names]
        total += sum(counts)
        if 0 in counts:
            return total
        first += WINDOW


class LeaseReader:
    """One partition's read: the segments that exist are replayed, then (on a first read) fresh ones.

    A first read stops at ``max_messages``, at ``max_delay`` after it began, or
    once it has ``min_messages`` and nothing arrived for :data:`IDLE_GAP`. A
    replay reads only the segments that exist. ``segments`` lists
    ``(name, count)`` of every lease the read left behind.
    """

    def __init__(self, conn: Connection, base: str, columns: Columns, *, replay: bool, max_in_flight: int,
                 max_messages: int | None, min_messages: int, max_delay: float) -> None:
        self.conn = conn
        self.base = base
        self.columns = columns
        self.replay = replay
        self.max_in_flight = max_in_flight
        self.max_messages = max_messages
        self.min_messages = min_messages
        self.max_delay = max_delay
        self.segments: list[tuple[str, int]] = []
        self.total = 0
        #: when the read must end, and when the last message came (time.monotonic)
        self.deadline = self.last = 0.0

    def batches(self) -> Iterator[pa.RecordBatch]:
        self.deadline = time.monotonic() + self.max_delay
        self.last = time.monotonic()
        segment, want, reply = 0, self._room(), None
        while want:
            name = segment_name(self.base, segment)
            reply = self._open(name, segment, want, reply)
            if reply["reopened"]:
                yield from self._replay(reply["count"])
                got, reply = reply["count"], None
            elif self.replay:
                self._seal()
                break
            else:
                got, reply = yield from self._read_fresh(want, segment_name(self.base, segment + 1))
                filled = self.max_messages is not None and self.total + got >= self.max_messages
                if reply is None and (got < want or filled or time.monotonic() >= self.deadline):
                    got += self._seal()
                    want = 0
            if got:  # an empty segment is the last, and nsqd forgot it when it was sealed
                self.segments.append((name, got))
            self.total += got
            want = want and self._room()
            segment += 1
        if self.columns:
            yield self.columns.take()

    def _open(self, name: str, segment: int, want: int, reply: dict | None) -> dict:
        """Open segment ``name``, unless it was opened early (``reply`` is its response)."""
        if self.replay:
            return open_lease(self.conn, name)
        if segment == 0 or reply is not None:
            return open_lease(self.conn, name, after=f"RDY {want}\n", reply=reply)
        return open_lease(self.conn, name, before=f"RDY {want}\n")  # the previous segment is full or sealed

    def _room(self) -> int:
        """How many messages the next segment may take (a replay takes whatever its leases hold)."""
        if self.max_messages is None or self.replay:
            return self.max_in_flight
        return max(min(self.max_in_flight, self.max_messages - self.total), 0)

    def _replay(self, count: int) -> Iterator[pa.RecordBatch]:
        """Exactly the ``count`` messages a reopened lease sends again."""
        columns = self.columns
        left = count
        while left:
            frames = self.conn.read_frames(self.conn.timeout)
            if not frames:
                raise NSQError(f"nsqd {self.conn.address}: lease replay stalled with {left} messages to go")
            for i, (kind, data) in enumerate(frames):
                if kind != FRAME_MESSAGE:
                    raise unexpected(self.conn, kind, data, "a message of a reopened lease")
                columns.add(data)
                left -= 1
                if not left:
                    self.conn.unread(frames[i + 1:])
                    break
            if len(columns) >= BATCH_ROWS:
                yield columns.take()

    def _read_fresh(self, want: int, next_name: str) -> Iterator[pa.RecordBatch]:
        """New messages into the open segment until it is full or the read should stop.

        When the segment is half full and the limit leaves room for a whole
        next one, the next is opened at once: nsqd seals this one with what it
        has sent and fills the next while we read, instead of waiting for us.
        Returns ``(count, reply)``, ``reply`` being the next segment's lease
        response if it was opened.
        """
        conn, columns = self.conn, self.columns
        early = self.max_messages is None or self.total + 2 * want <= self.max_messages
        got, switched = 0, False
        while switched or got < want:
            now = time.monotonic()
            wait = self.deadline - now
            if switched:
                wait = conn.timeout
            elif self.total + got >= self.min_messages:
                wait = min(wait, self.last + IDLE_GAP - now)
            frames = conn.read_frames(max(wait, 0.0))
            if not frames:
                if switched:
                    raise NSQError(f"nsqd {conn.address}: no answer to LEASE {next_name}")
                break
            for i, (kind, data) in enumerate(frames):
                if kind == FRAME_MESSAGE:
                    columns.add(data)
                    got += 1
                elif switched:  # the next segment's response: what came before it was this segment's
                    conn.unread(frames[i:])
                    return got, lease_reply(conn)
                else:
                    raise unexpected(conn, kind, data, "a message")
            self.last = time.monotonic()
            if early and not switched and got >= max(want // 2, 1) and self.last < self.deadline:
                conn.command(f"LEASE {next_name}")
                switched = True
            if len(columns) >= BATCH_ROWS:
                yield columns.take()
            if not switched and self.last >= self.deadline:
                break
        return got, None

    def _seal(self) -> int:
        """Stop taking messages and close the open segment; returns messages that were on the way."""
        conn = self.conn
        conn.send(b"RDY 0\nLEASE\n")
        late = 0
        while True:
            kind, data = conn.read_frame()
            if kind == FRAME_MESSAGE:
                self.columns.add(data)
                late += 1
                continue
            conn.unread([(kind, data)])
            reply = lease_reply(conn)
            if reply.get("lease") != "":
                raise NSQError(f"nsqd {conn.address}: unexpected lease response {reply}")
            return late
