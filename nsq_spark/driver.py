"""The driver's side of the leases: finding out whether there is data, touching, finishing.

Spark acknowledges a micro-batch on the driver, after the sink committed it,
so the driver settles leases by name over connections of its own (any
connection subscribed to the channel may). Offsets carry no message ids, so
the driver learns whether a new batch has data by a probe: per nsqd address a
connection with RDY 1 reads under the lease of the next batch's first segment
of that address's first partition (``run:b:j``). When it got a message the
probe seals the lease and the batch is planned; the partition reopens the
lease and gets that message as part of its read, so nothing is read twice.
When the query stops before the batch is planned, the lease keeps the
message for the next run, which reopens it by the same name (the run and
batch come from the checkpoint) and takes it over; only if no run comes
within the lease timeout is it delivered again. A probe gives its message
back (``LREQ``) when its daemon sends ``CLOSE_WAIT``, so that a draining
daemon need not wait for it.

A daemon that cannot be reached is tried again with backoff (see
:class:`~nsq_spark.client.Backoff`): meanwhile a probe reports no data (under
``Trigger.AvailableNow`` it waits, so the query does not end early), and
settling waits, so ``commit`` returns only once the leases are finished. The
settling connections are opened with the first probe, so that a daemon that
starts draining still takes their ``LFIN``.

A background thread touches the leases of batches that are not acknowledged
yet (a batch may run longer than the message timeout) and keeps the driver's
idle connections answering heartbeats. When a settling connection is lost,
the batches acknowledged in the minute before are finished again on the next
one: a durable daemon that crashed brings back the leases its last
checkpoint saw, finished since or not. A driver restarted from the query's
checkpoint does the same, at its first acknowledgement, for the batches
before it (the daemon may have crashed with the earlier driver).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque

from .client import FRAME_MESSAGE, Backoff, Connection, ConnectionLost, retrying
from .leases import lease_base, lease_consumer, lease_reply, open_lease, settle, unexpected
from .options import ReadOptions

log = logging.getLogger("nsq_spark")

_TIMESTAMP = struct.Struct(">q")
#: how long a probe that opens a new lease waits for a message before it says there is none (for now)
PROBE_WAIT = 0.05
#: batches acknowledged this long before a settling connection is lost are finished again on the next
#: one (a durable daemon that crashed brings back the leases its last checkpoint saw), at most so many
REFINISH_SECONDS = 60.0
REFINISH_BATCHES = 64


class Probe:
    """A connection that holds at most one message, under the lease of a batch not planned yet."""

    def __init__(self, opts: ReadOptions, address: str) -> None:
        self.opts = opts
        self.address = address
        self.backoff = Backoff(opts.reconnect_timeout)
        self.conn: Connection | None = None
        self.lease: str | None = None
        #: messages held under ``lease``, and the publish time (ns) of the first
        self.held = 0
        self.first_ns: int | None = None

    def look(self, lease: str) -> bool:
        """Read under ``lease`` and take in what arrived; False while the daemon cannot be reached.

        Raises once it has been unreachable for ``reconnectTimeout``.
        """
        if self.conn is None and not self.backoff.ready():
            return False
        try:
            if self.lease != lease:
                self.arm(lease)
            self._take(self.conn.read_frames(0))
            if self.conn.closing:
                self.release()
                raise ConnectionLost(f"nsqd {self.address} is shutting down")
        except ConnectionLost as exc:
            self.close()
            self.backoff.failed(exc)
            return False
        self.backoff.succeeded()
        return True

    def arm(self, lease: str) -> None:
        """Read under ``lease`` from now on; one left by an earlier process is taken over with its message."""
        if self.conn is None:
            opts = self.opts
            self.conn = lease_consumer(self.address, opts.topic, opts.channel, opts.msg_timeout_ms,
                                       opts.max_in_flight)
        self.lease, self.held, self.first_ns = lease, 0, None
        reply = open_lease(self.conn, lease, after="RDY 1\n")
        left = reply["count"] if reply["reopened"] else 0
        while left:
            left -= self._take(self.conn.read_frames(self.conn.timeout))
        if not reply["reopened"]:
            self._take(self.conn.read_frames(PROBE_WAIT))

    def poll(self) -> None:
        """Take in whatever arrived (and answer heartbeats) without waiting."""
        if self.conn is not None:
            self._take(self.conn.read_frames(0))

    def seal(self) -> None:
        """Stop reading: the lease keeps what it holds for the batch to reopen."""
        if self.conn is None:
            return
        try:
            self.conn.send(b"RDY 0\nLEASE\n")
            self._take(self._skip_messages())
            lease_reply(self.conn)
        except ConnectionLost as exc:  # closing the connection seals the lease all the same
            self.close()
            self.backoff.failed(exc)
        self.lease = None

    def release(self) -> None:
        """Give back what an unplanned lease holds (the daemon is draining), and close."""
        if self.conn is None:
            return
        try:
            if self.lease is not None:
                self.conn.command(f"LREQ {self.lease} 0")
                self._skip_messages()
                lease_reply(self.conn)
        finally:
            self.close()

    def close(self) -> None:
        """Drop the connection; nsqd seals the lease, which keeps what it holds."""
        if self.conn is not None:
            self.conn.close()
        self.conn, self.lease, self.held, self.first_ns = None, None, 0, None

    def _skip_messages(self) -> list[tuple[int, bytes]]:
        """Message frames that came before the next response; the response is left to read."""
        conn, messages = self.conn, []
        while not conn.frame_waiting():
            frame = conn.next_frame()
            if frame is not None:
                messages.append(frame)
            elif not conn.fill(conn.timeout):
                raise ConnectionLost(f"nsqd {self.address}: no answer within {conn.timeout:g} s")
        return messages

    def _take(self, frames: list[tuple[int, bytes]]) -> int:
        for kind, data in frames:
            if kind != FRAME_MESSAGE:
                raise unexpected(self.conn, kind, data, "a message")
            if self.first_ns is None:
                self.first_ns = _TIMESTAMP.unpack_from(data)[0]
            self.held += 1
        return len(frames)


class LeaseDriver:
    """Leases of one run, as the driver sees them: probes, pending batches, acknowledgements.

    Every operation is by lease name and can be repeated, so a lost
    connection is handled by closing it and doing the operation again on a
    new one (a probe's lease is then reopened with what it held).
    """

    def __init__(self, opts: ReadOptions, run: str) -> None:
        self.opts = opts
        self.run = run
        self._lock = threading.Lock()
        self._control: dict[str, Connection] = {}
        self._backoff = {address: Backoff(opts.reconnect_timeout) for address in opts.addresses}
        self._probes = [Probe(opts, address) for address in opts.addresses]
        #: batches whose leases may exist and are not finished
        self._pending: set[int] = set()
        #: batches this process planned from fresh data (any other batch is a replay)
        self._fresh: set[int] = set()
        self._acked_through = 0
        #: (time.monotonic(), batch) of the batches acknowledged lately, newest last
        self._finished: deque[tuple[float, int]] = deque(maxlen=REFINISH_BATCHES)
        #: per address whose settling connection was lost: the batches to finish again once connected
        self._refinish: dict[str, list[int]] = {}
        self._stop = threading.Event()
        interval = min(max(opts.msg_timeout_ms / 4000, 0.25), 10.0)
        self._thread = threading.Thread(target=self._keep, args=(interval,), name="nsq-lease-keeper", daemon=True)
        self._thread.start()

    def new_data(self, batch: int, cutoff_ns: int | None = None) -> bool:
        """Whether batch ``batch`` has data (published by ``cutoff_ns``, if given).

        If so its probes are sealed and the batch counts as fresh. With a
        cutoff (Trigger.AvailableNow) a daemon that cannot be reached is
        waited for, as "no data" would end the query.
        """
        with self._lock:
            self._pending.add(batch)
            for probe in self._probes:
                self._open_control(probe.address)
            for j, probe in enumerate(self._probes):
                lease = lease_base(self.run, batch, j)
                while not probe.look(lease) and cutoff_ns is not None:
                    probe.backoff.wait()
            if not any(p.held and (cutoff_ns is None or p.first_ns <= cutoff_ns) for p in self._probes):
                return False
            for probe in self._probes:
                probe.seal()
            self._fresh.add(batch)
            return True

    def is_fresh(self, batch: int) -> bool:
        return batch in self._fresh

    def hold(self, batch: int) -> None:
        """Keep ``batch``'s leases alive until it is acknowledged."""
        with self._lock:
            self._pending.add(batch)

    def acknowledge(self, batch: int) -> None:
        """Finish the leases of every batch up to ``batch``: Spark has committed them.

        Returns once they are finished, waiting for a daemon that cannot be
        reached (up to ``reconnectTimeout``, then it raises).
        """
        if batch <= self._acked_through:
            return
        with self._lock:
            batches = {b for b in self._pending if b <= batch} | {batch}
            if not self._acked_through:
                # the first in this process (a query restarted from its checkpoint): the batches an
                # earlier driver acknowledged may have leases again, brought back by a durable daemon
                # that crashed with it; nobody knew them as finished, so they expired and were delivered
                # again. Finishing a lease that is gone finishes nothing.
                batches.update(range(max(batch - REFINISH_BATCHES, 1), batch))
            for b in sorted(batches):
                self._settle(b, "LFIN", retry=True)
                self._pending.discard(b)
                self._fresh.discard(b)
                self._finished.append((time.monotonic(), b))
            self._acked_through = batch

    def close(self) -> None:
        """Stop touching and close; a probe's lease keeps its message for the next run."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            for probe in self._probes:
                probe.close()
            for address in list(self._control):
                self._drop_control(address, lost=False)

    # ------------------------------------------------------------ internals
    def _settle(self, batch: int, verb: str, retry: bool) -> None:
        addresses = self.opts.addresses
        for p in range(self.opts.num_partitions):
            address = addresses[p % len(addresses)]
            base = lease_base(self.run, batch, p)
            if retry:
                retrying(self._backoff[address], lambda a=address, b=base: settle(self._connection(a), b, verb),
                         on_lost=lambda a=address: self._drop_control(a))
            else:
                settle(self._connection(address), base, verb)

    def _connection(self, address: str) -> Connection:
        conn = self._control.get(address)
        if conn is None:
            opts = self.opts
            conn = self._control[address] = lease_consumer(address, opts.topic, opts.channel, opts.msg_timeout_ms,
                                                           opts.max_in_flight)
            if address in self._refinish:
                self._finish_again(address, conn)
        return conn

    def _finish_again(self, address: str, conn: Connection) -> None:
        """``LFIN`` again, on a new settling connection, the batches acknowledged shortly before the
        last one was lost: a durable daemon that crashed brings back the leases its last checkpoint
        saw, and their messages would be delivered again once those leases expired (settling twice
        is harmless)."""
        addresses = self.opts.addresses
        mine = [p for p in range(self.opts.num_partitions) if addresses[p % len(addresses)] == address]
        finished = 0
        for batch in self._refinish[address]:
            finished += sum(settle(conn, lease_base(self.run, batch, p), "LFIN") for p in mine)
        del self._refinish[address]
        if finished:
            log.info("nsqd %s brought back %d messages of finished batches: finished again", address, finished)

    def _open_control(self, address: str) -> None:
        """Open the settling connection ahead of need, if the daemon can be reached now."""
        backoff = self._backoff[address]
        if address in self._control or not backoff.ready():
            return
        try:
            self._connection(address)
        except ConnectionLost as exc:
            backoff.failed(exc)
        else:
            backoff.succeeded()

    def _drop_control(self, address: str, lost: bool = True) -> None:
        conn = self._control.pop(address, None)
        if conn is not None:
            conn.close()
            if lost:
                since = time.monotonic() - REFINISH_SECONDS
                recent = [batch for at, batch in self._finished if at >= since]
                if recent:
                    self._refinish[address] = sorted(set(self._refinish.get(address, [])) | set(recent))

    def _keep(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock:
                for batch in sorted(self._pending):
                    try:
                        self._settle(batch, "LTOUCH", retry=False)
                    except Exception as exc:  # the next operation connects again (or reports the error)
                        log.info("touching leases failed: %s", exc)
                        for address in list(self._control):
                            self._drop_control(address)
                        break
                for probe in self._probes:
                    try:
                        probe.poll()
                    except ConnectionLost:
                        probe.close()
                for address, conn in list(self._control.items()):
                    try:
                        conn.read_frames(0)
                    except ConnectionLost:
                        self._drop_control(address)
