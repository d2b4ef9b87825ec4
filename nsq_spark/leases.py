"""Reading a partition under leases, and settling leases by name.

A partition of micro-batch ``b`` of run ``r`` reads under lease ``r:b:p``.
nsqd counts every lease a connection opened, sealed ones included, in that
connection's in-flight budget (RDY) for as long as it is connected, and
leased messages stay in flight until the driver settles them. So one
connection reads one segment: a partition that wants more than
``maxInFlight`` messages reads ``r:b:p``, then ``r:b:p.1``, ``r:b:p.2`` and
so on, each on a connection of its own. Closing a connection releases its
leases: they keep their messages and count in nobody's budget.

The next connection is opened and subscribed while a segment fills. Once a
segment is in its last eighth, the next starts (its RDY sent), and its
messages are on their way while the current one's last arrive, so the
partition reads on without waiting. The
current connection is closed once its segment is full, or sealed first
(``RDY 0``, ``LEASE``: the messages before the answer are its last) when it
is not. Segments are opened in order and each holds at least one message,
so a replay stops at the first that is missing, and the driver's LFIN and
LTOUCH, which walk them a window of names at a time, after the first window
with one missing. Segments expire one by one (each from its own last
touch), so a replay queues again whatever is left after a missing one
rather than leave it to the driver's LFIN unread.

Reopening a live lease sends exactly its messages again, whatever RDY is,
so a replayed partition yields what its first read yielded (its segments
reopened one after another on one connection), as long as its leases have
not expired.

A read survives its connection: when the daemon goes away (``CLOSE_WAIT``
ends the read with what it has; a crash or a broken socket do not) the
partition connects again with backoff and reopens the segment it was
filling. nsqd keeps leases across a restart (a graceful one, and a crash in
durable mode), so what comes back is that segment's messages, those it had
already handed over (skipped by id) and those that were on their way when
the connection broke; then it reads on. A daemon that lost the read's leases
(a crash without ``--durable``, or leases that expired while it was away)
has put their messages back in the queue or lost them with its memory: the
partition then reads on under the first segment name again.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Iterator

import pyarrow as pa

from .client import (FRAME_ERROR, FRAME_MESSAGE, FRAME_RESPONSE, Backoff, Connection, ConnectionLost, Draining,
                     NSQError, error_frame, identify_command, retrying)
from .options import OptionError, ReadOptions
from .rows import Columns

#: a first read that has what it needs stops when nothing arrives for this long (shorter gaps end reads
#: early on a busy machine, where a daemon with a backlog can wait that long for a CPU)
IDLE_GAP = 0.2
#: asked for in IDENTIFY: nsqd holds a slow stream's messages at most this long (its default, 250 ms, is
#: longer than IDLE_GAP and would end reads while messages wait in its output buffer)
OUTPUT_BUFFER_TIMEOUT_MS = 50
#: rows, and bytes of frames, per Arrow batch handed to Spark
BATCH_ROWS = 8192
BATCH_BYTES = 16 << 20
#: lease commands sent before their answers are read, when walking segments
WINDOW = 16
#: a segment with less than this share of its room left hands over to the next: the spare connection
#: gets its RDY while this one takes its last messages, so the partition reads on without a pause
REFILL_FRACTION = 8
#: how long a segment in its last eighth may take to fill up before it is closed
FULL_WAIT = 0.01
#: a spare connection idle for longer is not used (nsqd closes a connection that misses two heartbeats)
SPARE_MAX_AGE = 10.0


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


def send_handshake(conn: Connection, topic: str, channel: str, msg_timeout_ms: int) -> None:
    """``IDENTIFY`` with the lease extension, then ``SUB``, in one write; :func:`check_handshake` reads the answers."""
    conn.send(identify_command(feature_negotiation=True, leases=True, msg_timeout=msg_timeout_ms,
                               output_buffer_timeout=OUTPUT_BUFFER_TIMEOUT_MS)
              + f"SUB {topic} {channel}\n".encode())


def check_handshake(conn: Connection, msg_timeout_ms: int, max_in_flight: int) -> None:
    """The answers to :func:`send_handshake`; the daemon's limits are checked against the options.

    A misfit is an error naming the option rather than a failure later on.
    """
    try:
        features = conn.identified()
    except NSQError as exc:
        if "msg timeout" in str(exc):
            raise OptionError(f"option 'msgTimeoutMs' ({msg_timeout_ms}) is above the --max-msg-timeout "
                              f"of nsqd {conn.address}: {exc}") from None
        raise
    if features.get("leases") is not True:
        raise NSQError(f"nsqd {conn.address} does not support leases (IDENTIFY leases)")
    max_rdy = features.get("max_rdy_count", max_in_flight)
    if max_in_flight > max_rdy:
        raise OptionError(f"option 'maxInFlight' ({max_in_flight}) is above the --max-rdy-count of "
                          f"nsqd {conn.address} ({max_rdy})")
    conn.expect_ok()


def lease_consumer(address: str, topic: str, channel: str, msg_timeout_ms: int, max_in_flight: int = 1,
                   timeout: float = 10.0) -> Connection:
    """A connection subscribed to ``topic``/``channel`` with the lease extension on (see :func:`check_handshake`)."""
    conn = Connection(address, timeout)
    try:
        send_handshake(conn, topic, channel, msg_timeout_ms)
        check_handshake(conn, msg_timeout_ms, max_in_flight)
    except BaseException:
        conn.close()
        raise
    return conn


class Subscription:
    """A partition's connections to one daemon: the current one, and a spare for its next segment.

    The current connection is connected again, with backoff, when it is lost.
    """

    def __init__(self, opts: ReadOptions, address: str) -> None:
        self.opts = opts
        self.address = address
        self.backoff = Backoff(opts.reconnect_timeout)
        self.conn: Connection | None = None
        #: the next connection: its handshake sent, answered once ``_spare_ready``; when it was opened
        self._spare: Connection | None = None
        self._spare_ready = False
        self._spare_since = 0.0

    def connect(self) -> Connection:
        """The connection; while the daemon cannot be reached this waits (see :class:`Backoff`)."""
        if self.conn is None:
            self.conn = retrying(self.backoff, self._subscribed)
        return self.conn

    def prepare(self) -> None:
        """Open the spare now and send its handshake without waiting for the answers (:meth:`spare` reads them)."""
        if self._spare is not None:
            return
        opts = self.opts
        try:
            conn = Connection(self.address)
        except ConnectionLost:
            return  # spare() tries again when the spare is needed
        try:
            send_handshake(conn, opts.topic, opts.channel, opts.msg_timeout_ms)
        except ConnectionLost:
            conn.close()
            return
        self._spare, self._spare_ready, self._spare_since = conn, False, time.monotonic()

    def spare(self) -> Connection:
        """The spare, subscribed: the one :meth:`prepare` opened, or a new one. Raises ConnectionLost."""
        if self._spare is not None and not self._spare_ready:
            if time.monotonic() - self._spare_since < SPARE_MAX_AGE:
                try:
                    check_handshake(self._spare, self.opts.msg_timeout_ms, self.opts.max_in_flight)
                    self._spare_ready = True
                except ConnectionLost:
                    self._close_spare()
            else:
                self._close_spare()
        if self._spare is None:
            self._spare, self._spare_ready = self._subscribed(), True
        return self._spare

    def promote(self) -> Connection:
        """Go on with the spare; the current connection is closed (nsqd releases its leases, which live on)."""
        conn = self.spare()
        self._spare = None
        if self.conn is not None:
            self.conn.close()
        self.conn = conn
        return conn

    def lost(self, exc: ConnectionLost) -> None:
        """The connection broke: drop it and pause before the next :meth:`connect` (or give up)."""
        self.close()
        self.backoff.failed(exc)
        self.backoff.wait()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self._close_spare()

    def _subscribed(self) -> Connection:
        opts = self.opts
        return lease_consumer(self.address, opts.topic, opts.channel, opts.msg_timeout_ms, opts.max_in_flight)

    def _close_spare(self) -> None:
        if self._spare is not None:
            self._spare.close()
            self._spare = None


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
        # where the read is: the current segment, what it gave, how many it may take (a fresh one)
        self._segment = 0
        self._got = 0
        self._want = 0
        #: the current segment's LEASE and RDY went out ahead on the current connection, unanswered so far
        self._started = False
        #: take no new messages: seal the current segment and end
        self._stopping = False
        self._done = False
        #: the last segment this read sent LEASE for: it may hold messages, so it is always reopened
        #: (segment 0 from the start: the driver's probe may hold a message under its name, and a
        #: read that ended without opening it had that message finished unread with the batch)
        self._leased = 0
        #: a segment was missing: every segment this read has not leased yet is new
        self._past_end = False
        #: the current connection opened a lease that holds messages: they fill its budget for good
        self._used = False
        #: the connection was lost since the current segment was opened
        self._reconnected = False
        #: ids of the current segment handed over before the connection broke
        self._skip: frozenset[bytes] = frozenset()
        #: id columns of the last batches handed over, enough to cover one segment
        self._recent: deque[pa.Array] = deque()

    def batches(self) -> Iterator[pa.RecordBatch]:
        self.deadline = math.inf  # maxTriggerDelay counts from the first connection: not the wait for a daemon
        while not self._done:
            try:
                conn = self.link.connect()
                if self.deadline == math.inf:
                    self.last = time.monotonic()
                    self.deadline = self.last + self.max_delay
                yield from self._step(conn)
            except ConnectionLost as exc:
                self._resume(exc)
        if len(self.columns):
            yield self._take()

    # ------------------------------------------------------------ steps
    def _step(self, conn: Connection) -> Iterator[pa.RecordBatch]:
        """The current segment: open it, replay what it holds or read new messages into it."""
        if self._reconnected:
            self._reconnected = False
            if not self.replay and self._segment:
                conn.command(f"LTOUCH {self.base}")
                if lease_reply(conn)["count"] == 0:
                    self._restart_names()
        name = segment_name(self.base, self._segment)
        fresh = True
        if self._started:  # sent by _start_next
            self._started = False
            reply = open_lease(conn, name, after=f"RDY {self._want}\n", reply=lease_reply(conn))
        else:
            stop = not self.replay and (self._stopping or conn.closing or not self._room()
                                        or time.monotonic() >= self.deadline)
            if stop and self._segment > self._leased:
                self._done = True  # the segment before is full or sealed, and nothing else was asked for
                return
            fresh = not (stop or self.replay)
            if fresh and self._used:
                if not self._past_end or self._segment <= self._leased:  # it may exist: if so, reopen it here
                    conn.command(f"LTOUCH {name}")
                    if lease_reply(conn)["count"]:
                        reply = self._lease(conn, name, rdy=False)
                        if reply["reopened"]:
                            yield from self._reopened(conn, reply["count"])
                            return
                    self._past_end = True
                try:
                    conn = self.link.promote()  # this one's budget is taken: a fresh segment needs a new connection
                except Draining:  # as CLOSE_WAIT would say, were it read already: the read ends with what it has
                    self._done = True
                    return
                self._used = False
            reply = self._lease(conn, name, rdy=fresh)
        if reply["reopened"]:
            yield from self._reopened(conn, reply["count"])
            return
        if self.replay:
            self._requeue_beyond(conn)
        self._past_end = True
        self._got = 0  # if it had given messages, the daemon lost the lease (they are queued again, or lost)
        if not fresh:
            yield from self._seal(conn)
            return
        yield from self._read_fresh(conn)

    def _lease(self, conn: Connection, name: str, rdy: bool) -> dict:
        """``LEASE name``, and with ``rdy`` the RDY for a fresh segment (the connection has no lease yet)."""
        self._leased = max(self._leased, self._segment)
        if not rdy:
            return open_lease(conn, name, before="RDY 0\n")
        self._want = self._room()
        return open_lease(conn, name, after=f"RDY {self._want}\n")

    def _requeue_beyond(self, conn: Connection) -> None:
        """A replay ends at the first segment missing; segments after it that are still there go
        back to the queue (``LREQ``), up to a whole window of missing names.

        Segments do not expire together (each one's timeout counts from its own
        last delivery or touch), so the first attempt's later segments may
        outlive an earlier one. This replay did not read them, and the
        driver's walks (:func:`settle`) go on to the end of a window: its
        ``LFIN`` would finish them unread. Queued again, they are read later
        (at least once, as after any expiry).
        """
        first = self._segment + 1
        while True:
            names = [segment_name(self.base, first + i) for i in range(WINDOW)]
            conn.send("".join(f"LREQ {name} 0\n" for name in names).encode())
            if not any([lease_reply(conn)["count"] for _ in names]):
                return
            first += WINDOW

    def _room(self, ahead: int = 0) -> int:
        """How many messages the next segment may take, ``ahead`` more being on their way (a replay: any)."""
        if self.max_messages is None or self.replay:
            return self.max_in_flight
        return max(min(self.max_in_flight, self.max_messages - self.total - ahead), 0)

    def _next_segment(self, count: int) -> None:
        if count:  # an empty segment is the last, and nsqd forgot it when it was sealed
            self.segments[segment_name(self.base, self._segment)] = count
        self._segment += 1
        self._got = 0
        self._skip = frozenset()

    def _hand_over(self, n: int) -> None:
        self._got += n
        self.total += n
        self.last = time.monotonic()

    def _reopened(self, conn: Connection, count: int) -> Iterator[pa.RecordBatch]:
        """A segment that exists: its messages, sent again; they stay in this connection's budget."""
        if not self.replay:
            self.link.prepare()  # the next fresh segment needs another connection
        yield from self._replay(conn, count)
        self._used = True
        self._next_segment(count)

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
        """New messages into the open segment until nsqd sends it no more or the read should stop.

        Once the segment has less than an eighth of its room left, the next
        segment starts (:meth:`_start_next`) while this one takes its last
        messages. The spare connection for it is opened when this one is
        half full.
        """
        columns, want = self.columns, self._want
        spare = self.max_messages is None or self.total - self._got + want < self.max_messages
        while True:
            n = conn.take_messages(columns, want - self._got)
            if n:
                self._hand_over(n)
                if self._full():
                    yield self._take()
                if spare and 2 * self._got >= want:
                    spare = False
                    self.link.prepare()
                if (want - self._got) * REFILL_FRACTION < want:
                    yield from self._start_next(conn)
                    return
                continue
            if conn.frame_waiting():
                kind, data = conn.next_frame()
                raise unexpected(conn, kind, data, "a message")
            now = time.monotonic()
            wait = self.deadline - now
            if self.total >= self.min_messages:
                wait = min(wait, self.last + IDLE_GAP - now)
            if wait <= 0 or conn.closing or (self.max_messages is not None and self.total >= self.max_messages):
                yield from self._seal(conn)
                return
            conn.fill(wait)

    def _start_next(self, conn: Connection) -> Iterator[pa.RecordBatch]:
        """The open segment takes no more: start the next on the spare, finish this one, go on with the next.

        nsqd takes the next segment's messages after all of this one's, so
        the order holds, and they are on their way while this one ends.
        """
        want = self._room(ahead=self._want - self._got)
        start = bool(want) and not (self._stopping or conn.closing or time.monotonic() >= self.deadline)
        if start:
            try:
                spare = self.link.spare()
            except ConnectionLost:  # a draining daemon refuses SUB: this connection is told CLOSE_WAIT too
                start = False
            else:
                self._leased = self._segment + 1
                spare.send(f"LEASE {segment_name(self.base, self._segment + 1)}\nRDY {want}\n".encode())
        yield from self._complete(conn)
        if start:
            self.link.promote()
            self._want, self._started, self._used = want, True, False
        else:
            self._used = True

    def _complete(self, conn: Connection) -> Iterator[pa.RecordBatch]:
        """The open segment's last messages: it ends when full (nsqd sends it nothing more), else it is sealed.

        Messages nsqd took for it may wait in its buffered writer while the
        connection has room; sealing it sends them at once.
        """
        want = self._want
        while self._got < want:
            n = conn.take_messages(self.columns, want - self._got)
            if n:
                self._hand_over(n)
                if self._full():
                    yield self._take()
            elif conn.frame_waiting() or not conn.fill(FULL_WAIT):
                yield from self._close_segment(conn)
                return
        self._next_segment(self._got)

    def _seal(self, conn: Connection) -> Iterator[pa.RecordBatch]:
        """Stop taking messages, close the open segment, and end the read."""
        self._stopping = True
        yield from self._close_segment(conn)
        self._done = True

    def _close_segment(self, conn: Connection) -> Iterator[pa.RecordBatch]:
        """``RDY 0``, ``LEASE``: the messages on their way before the answer are the segment's last."""
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

    # ------------------------------------------------------------ connection loss
    def _resume(self, exc: ConnectionLost) -> None:
        """After a lost connection: reconnect, and reopen the current segment skipping what was handed over."""
        self.link.lost(exc)
        if self._got:
            self._skip = frozenset(self._last_ids(self._got))
        self._started = self._used = False
        self._reconnected = True

    def _restart_names(self) -> None:
        """The daemon lost this read's leases: read on under the first segment name.

        Their messages went back to the queue (they expired), or were lost with
        the daemon (a crash without ``--durable``). Going on under later names
        would leave a gap, and whoever walks the segments from the first would
        never reach what the read takes now.
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
