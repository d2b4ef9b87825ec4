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

A read survives its connection: when the daemon goes away (``CLOSE_WAIT``
and a restart, a crash, a broken socket) the partition connects again with
backoff and reopens the segment it was filling. What comes back is that
segment's messages, those it had already handed over (skipped by id) and
those that were on their way when the connection broke; then it reads on.
A daemon that forgot the read's leases (they do not survive a restart yet)
has put their messages back in the queue: the partition then reads on under
the first segment name again.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator

import pyarrow as pa

from .client import (FRAME_ERROR, FRAME_MESSAGE, FRAME_RESPONSE, Backoff, Connection, ConnectionLost, NSQError,
                     error_frame, retrying)
from .options import OptionError, ReadOptions
from .rows import Columns

#: a first read that has what it needs stops when nothing arrives for this long (shorter gaps end reads
#: early on a busy machine, where a daemon with a backlog can wait that long for a CPU)
IDLE_GAP = 0.2
#: rows, and bytes of frames, per Arrow batch handed to Spark
BATCH_ROWS = 8192
BATCH_BYTES = 16 << 20
#: lease commands sent before their answers are read, when walking segments
WINDOW = 16


def lease_base(run: str, batch: int, partition: int) -> str:
    return f"{run}:{batch}:{partition}"


def segment_name(base: str, segment: int) -> str:
    return base if segment == 0 else f"{base}.{segment}"


def unexpected(conn: Connection, kind: int, data: bytes, expected: str) -> NSQError:
    if kind == FRAME_ERROR:
        return error_frame(conn.address, data)
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


def lease_consumer(address: str, topic: str, channel: str, msg_timeout_ms: int, max_in_flight: int = 1,
                   timeout: float = 10.0) -> Connection:
    """A connection subscribed to ``topic``/``channel`` with the lease extension on.

    The daemon's limits are checked against the options that depend on them,
    so a misfit is an error naming the option rather than a failure later on.
    """
    conn = Connection(address, timeout)
    try:
        try:
            features = conn.identify(feature_negotiation=True, leases=True, msg_timeout=msg_timeout_ms)
        except NSQError as exc:
            if "msg timeout" in str(exc):
                raise OptionError(f"option 'msgTimeoutMs' ({msg_timeout_ms}) is above the --max-msg-timeout "
                                  f"of nsqd {address}: {exc}") from None
            raise
        if features.get("leases") is not True:
            raise NSQError(f"nsqd {address} does not support leases (IDENTIFY leases)")
        max_rdy = features.get("max_rdy_count", max_in_flight)
        if max_in_flight > max_rdy:
            raise OptionError(f"option 'maxInFlight' ({max_in_flight}) is above the --max-rdy-count of "
                              f"nsqd {address} ({max_rdy})")
        conn.subscribe(topic, channel)
    except BaseException:
        conn.close()
        raise
    return conn


class Subscription:
    """A lease consumer of one daemon that is connected again, with backoff, when it is lost."""

    def __init__(self, opts: ReadOptions, address: str) -> None:
        self.opts = opts
        self.address = address
        self.backoff = Backoff(opts.reconnect_timeout)
        self.conn: Connection | None = None

    def connect(self) -> Connection:
        """The connection; while the daemon cannot be reached this waits (see :class:`Backoff`)."""
        if self.conn is None:
            opts = self.opts
            self.conn = retrying(self.backoff, lambda: lease_consumer(
                self.address, opts.topic, opts.channel, opts.msg_timeout_ms, opts.max_in_flight))
        return self.conn

    def lost(self, exc: ConnectionLost) -> None:
        """The connection broke: drop it and pause before the next :meth:`connect` (or give up)."""
        self.close()
        self.backoff.failed(exc)
        self.backoff.wait()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class LeaseReader:
    """One partition's read: the segments that exist are replayed, then (on a first read) fresh ones.

    A first read stops at ``max_messages``, at ``max_delay`` after it began,
    once it has ``min_messages`` and nothing arrived for :data:`IDLE_GAP`, or
    when the daemon sends ``CLOSE_WAIT``. A replay reads only the segments
    that exist. ``segments`` maps every lease the read left behind to its
    number of messages.
    """

    def __init__(self, link: Subscription, base: str, columns: Columns, *, replay: bool, max_in_flight: int,
                 max_messages: int | None, min_messages: int, max_delay: float) -> None:
        self.link = link
        self.base = base
        self.columns = columns
        self.replay = replay
        self.max_in_flight = max_in_flight
        self.max_messages = max_messages
        self.min_messages = min_messages
        self.max_delay = max_delay
        self.segments: dict[str, int] = {}
        #: messages handed over
        self.total = 0
        #: when the read must end, and when the last message came (time.monotonic)
        self.deadline = self.last = 0.0
        # where the read is: the current segment, what it gave, whether it takes new messages here
        self._segment = 0
        self._got = 0
        self._open = False
        self._want = 0
        #: the next segment's lease response when it was opened early, or LEASE sent and not answered
        self._early: dict | None = None
        self._switching = False
        #: take no new messages: seal the current segment and end
        self._stopping = False
        self._done = False
        #: the connection has no lease yet (nothing may be delivered before LEASE)
        self._bare = True
        #: the last segment this read sent LEASE for: it may hold messages, so it is always reopened
        self._leased = -1
        #: the connection was lost since the current segment was opened
        self._reconnected = False
        #: ids of the current segment handed over before the connection broke
        self._skip: frozenset[bytes] = frozenset()
        #: id columns of the last batches handed over, enough to cover one segment
        self._recent: deque[pa.Array] = deque()

    def batches(self) -> Iterator[pa.RecordBatch]:
        self.deadline = time.monotonic() + self.max_delay
        self.last = time.monotonic()
        while not self._done:
            try:
                yield from self._step(self.link.connect())
            except ConnectionLost as exc:
                self._resume(exc)
        if len(self.columns):
            yield self._take()

    # ------------------------------------------------------------ steps
    def _step(self, conn: Connection) -> Iterator[pa.RecordBatch]:
        """Go on with the current segment: open it, replay what it holds, read new messages into it."""
        if self._open:
            yield from self._read_fresh(conn)
            return
        if self._reconnected:
            self._reconnected = False
            if not self.replay and self._segment:
                conn.command(f"LTOUCH {self.base}")
                if lease_reply(conn)["count"] == 0:
                    self._restart_names()
        name = segment_name(self.base, self._segment)
        stop = not self.replay and (self._stopping or conn.closing or not self._room()
                                    or time.monotonic() >= self.deadline)
        if self._early is not None:
            reply, self._early = self._early, None
            if reply["reopened"] and not reply["count"]:
                reply = open_lease(conn, name, after=f"RDY {self._want}\n", reply=reply)
        elif stop and self._segment > self._leased:
            self._done = True  # the segment before is full or sealed, and nothing else was asked for
            return
        else:
            reply = self._lease(conn, name, rdy=not (stop or self.replay))
        if reply["reopened"]:
            yield from self._replay(conn, reply["count"])
            self._next_segment(reply["count"])
            return
        self._got = 0  # if it had given messages, the daemon lost it (and them)
        if stop or self.replay:
            yield from self._seal(conn)
            return
        self._open = True
        yield from self._read_fresh(conn)

    def _lease(self, conn: Connection, name: str, rdy: bool) -> dict:
        """``LEASE name``; RDY goes first when the connection's current lease takes nothing more."""
        self._leased = max(self._leased, self._segment)
        bare, self._bare = self._bare, False
        if not rdy:
            return open_lease(conn, name)
        self._want = self._room()
        if bare:  # nothing may be delivered before the lease is current
            return open_lease(conn, name, after=f"RDY {self._want}\n")
        return open_lease(conn, name, before=f"RDY {self._want}\n")

    def _room(self) -> int:
        """How many messages the next segment may take (a replay takes whatever its leases hold)."""
        if self.max_messages is None or self.replay:
            return self.max_in_flight
        return max(min(self.max_in_flight, self.max_messages - self.total), 0)

    def _next_segment(self, count: int) -> None:
        if count:  # an empty segment is the last, and nsqd forgot it when it was sealed
            self.segments[segment_name(self.base, self._segment)] = count
        self._segment += 1
        self._got = 0
        self._open = False
        self._skip = frozenset()

    def _hand_over(self, n: int) -> None:
        self._got += n
        self.total += n
        self.last = time.monotonic()

    def _replay(self, conn: Connection, count: int) -> Iterator[pa.RecordBatch]:
        """Exactly the ``count`` messages a reopened lease sends again, less those in ``_skip``."""
        columns, skip, left = self.columns, self._skip, count
        while left:
            if skip:  # rare (a lost connection): one frame at a time, by id
                frame = conn.next_frame()
                if frame is not None:
                    kind, data = frame
                    if kind != FRAME_MESSAGE:
                        raise unexpected(conn, kind, data, "a message of a reopened lease")
                    if data[10:26] not in skip:
                        columns.add_frame(data)
                        self._hand_over(1)
                    left -= 1
                    continue
            else:
                n = conn.take_messages(columns, left)
                if n:
                    left -= n
                    self._hand_over(n)
                    if self._full():
                        yield self._take()
                    continue
                if conn.frame_waiting():
                    kind, data = conn.next_frame()
                    raise unexpected(conn, kind, data, "a message of a reopened lease")
            if not conn.fill(conn.timeout):
                raise ConnectionLost(f"nsqd {conn.address}: lease replay stalled with {left} messages to go")

    def _read_fresh(self, conn: Connection) -> Iterator[pa.RecordBatch]:
        """New messages into the open segment until it is full or the read should stop.

        When the segment is half full and the limit leaves room for a whole
        next one, the next is opened at once: nsqd seals this one with what it
        has sent and fills the next while we read, instead of waiting for us.
        """
        columns, want = self.columns, self._want
        early = self.max_messages is None or self.total - self._got + 2 * want <= self.max_messages
        while True:
            if not self._switching and self._got >= want:
                self._next_segment(self._got)  # full: nsqd sends it nothing more
                return
            n = conn.take_messages(columns, want - self._got)
            if n:
                self._hand_over(n)
                if self._full():
                    yield self._take()
            if conn.frame_waiting():
                kind, data = conn.next_frame()
                if not (self._switching and kind == FRAME_RESPONSE and data.startswith(b"{")):
                    raise unexpected(conn, kind, data, "a message")
                self._switching = False
                self._early = json.loads(data)  # the next segment's: what came before it was this one's
                self._next_segment(self._got)
                return
            if n:
                continue
            if self._switching:
                if not conn.fill(conn.timeout):
                    raise ConnectionLost(f"nsqd {conn.address}: no answer to LEASE")
                continue
            now = time.monotonic()
            wait = self.deadline - now
            if self.total >= self.min_messages:
                wait = min(wait, self.last + IDLE_GAP - now)
            if wait <= 0 or conn.closing or (self.max_messages is not None and self.total >= self.max_messages):
                yield from self._seal(conn)
                return
            if early and self._got >= max(want // 2, 1):
                self._leased = self._segment + 1
                conn.command(f"LEASE {segment_name(self.base, self._segment + 1)}")
                self._switching = True
                continue
            conn.fill(wait)

    def _seal(self, conn: Connection) -> Iterator[pa.RecordBatch]:
        """Stop taking messages and close the open segment; messages on their way are handed over first."""
        self._stopping = True
        conn.send(b"RDY 0\nLEASE\n")
        while True:
            n = conn.take_messages(self.columns, self.max_in_flight)
            if n:
                self._hand_over(n)
                continue
            frame = conn.next_frame()
            if frame is None:
                if not conn.fill(conn.timeout):
                    raise ConnectionLost(f"nsqd {conn.address}: no answer to LEASE")
                continue
            kind, data = frame
            if kind != FRAME_RESPONSE or not data.startswith(b"{") or json.loads(data).get("lease") != "":
                raise unexpected(conn, kind, data, "the response to LEASE")
            break
        if self._full():
            yield self._take()
        self._next_segment(self._got)
        self._done = True

    # ------------------------------------------------------------ connection loss
    def _resume(self, exc: ConnectionLost) -> None:
        """After a lost connection: reconnect, and reopen the current segment skipping what was handed over."""
        self.link.lost(exc)
        if self._got:
            self._skip = frozenset(self._last_ids(self._got))
        self._open = self._switching = False
        self._early = None
        self._bare = True
        self._reconnected = True

    def _restart_names(self) -> None:
        """The daemon lost this read's leases (it restarted): read on under the first segment name.

        Their messages went back to the queue, or were lost with the daemon.
        Going on under later names would leave a gap, and whoever walks the
        segments from the first would never reach what the read takes now.
        """
        self.segments.clear()
        self._segment, self._got, self._leased = 0, 0, -1
        self._skip = frozenset()

    def _last_ids(self, count: int) -> list[bytes]:
        """Ids of the last ``count`` messages handed over (at most a segment's worth)."""
        ids = self.columns.ids()
        for column in reversed(self._recent):
            if len(ids) >= count:
                break
            ids = [i.encode() for i in column.to_pylist()] + ids
        return ids[-count:]

    # ------------------------------------------------------------ batches
    def _full(self) -> bool:
        return len(self.columns) >= BATCH_ROWS or self.columns.nbytes >= BATCH_BYTES

    def _take(self) -> pa.RecordBatch:
        batch = self.columns.take()
        recent = self._recent
        recent.append(batch.column(0))
        while sum(len(c) for c in recent) - len(recent[0]) >= self.max_in_flight:
            recent.popleft()
        return batch
