"""The driver's side of the leases: finding out whether there is data, touching, finishing.

Spark acknowledges a micro-batch on the driver, after the sink committed it,
so the driver settles leases by name over connections of its own (any
connection subscribed to the channel may). Offsets carry no message ids, so
the driver learns whether a new batch has data by a probe: per nsqd address a
connection with RDY 1 reads under the lease of the next batch's first segment
of that address's first partition (``run:b:j``). When it got a message the
probe seals the lease and the batch is planned; the partition reopens the
lease and gets that message as part of its read, so nothing is read twice. A
probe gives its message back only when the query stops before the batch is
planned.

A background thread touches the leases of batches that are not acknowledged
yet (a batch may run longer than the message timeout) and keeps the driver's
idle connections answering heartbeats.
"""

from __future__ import annotations

import logging
import struct
import threading

from .client import FRAME_MESSAGE, Connection, NSQError, lease_consumer
from .leases import IDLE_GAP, lease_base, lease_reply, open_lease, settle, unexpected
from .options import ReadOptions

log = logging.getLogger("nsq_spark")

_TIMESTAMP = struct.Struct(">q")


class Probe:
    """A connection that holds at most one message, under the lease of a batch not planned yet."""

    def __init__(self, opts: ReadOptions, address: str) -> None:
        self.opts = opts
        self.address = address
        self.conn: Connection | None = None
        self.lease: str | None = None
        #: messages held under ``lease``, and the publish time (ns) of the first
        self.held = 0
        self.first_ns: int | None = None

    def arm(self, lease: str) -> None:
        """Read under ``lease`` from now on; one left by an earlier process is taken over with its message."""
        if self.conn is None:
            self.conn = lease_consumer(self.address, self.opts.topic, self.opts.channel, self.opts.msg_timeout_ms)
        self.lease, self.held, self.first_ns = lease, 0, None
        reply = open_lease(self.conn, lease, after="RDY 1\n")
        left = reply["count"] if reply["reopened"] else 0
        while left:
            left -= self._take(self.conn.read_frames(self.conn.timeout))
        if not reply["reopened"]:
            self._take(self.conn.read_frames(IDLE_GAP))

    def poll(self) -> None:
        """Take in whatever arrived (and answer heartbeats) without waiting."""
        if self.conn is not None:
            self._take(self.conn.read_frames(0))

    def seal(self) -> None:
        """Stop reading: the lease keeps what it holds for the batch to reopen."""
        self.conn.send(b"RDY 0\nLEASE\n")
        self._take(self._skip_messages())
        lease_reply(self.conn)
        self.lease = None

    def release(self) -> None:
        """Give back what an unplanned lease holds (the query stops), and close."""
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
        messages = []
        while True:
            frame = self.conn.read_frame()
            if frame[0] != FRAME_MESSAGE:
                self.conn.unread([frame])
                return messages
            messages.append(frame)

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

    Every operation is by lease name and can be repeated, so a broken
    connection is handled by closing everything and doing the operation once
    more on new connections (a probe's lease is then reopened with what it held).
    """

    def __init__(self, opts: ReadOptions, run: str) -> None:
        self.opts = opts
        self.run = run
        self._lock = threading.Lock()
        self._control: dict[str, Connection] = {}
        self._probes = [Probe(opts, address) for address in opts.addresses]
        #: batches whose leases may exist and are not finished
        self._pending: set[int] = set()
        #: batches this process planned from fresh data (any other batch is a replay)
        self._fresh: set[int] = set()
        self._acked_through = 0
        self._stop = threading.Event()
        interval = min(max(opts.msg_timeout_ms / 4000, 0.25), 10.0)
        self._thread = threading.Thread(target=self._keep, args=(interval,), name="nsq-lease-keeper", daemon=True)
        self._thread.start()

    def new_data(self, batch: int, cutoff_ns: int | None = None) -> bool:
        """Whether batch ``batch`` has data (published by ``cutoff_ns``, if given).

        If so its probes are sealed and the batch counts as fresh.
        """
        with self._lock:
            self._pending.add(batch)
            return self._retry(self._probe, batch, cutoff_ns)

    def is_fresh(self, batch: int) -> bool:
        return batch in self._fresh

    def hold(self, batch: int) -> None:
        """Keep ``batch``'s leases alive until it is acknowledged."""
        with self._lock:
            self._pending.add(batch)

    def acknowledge(self, batch: int) -> None:
        """Finish the leases of every batch up to ``batch``: Spark has committed them."""
        if batch <= self._acked_through:
            return
        with self._lock:
            for b in sorted({b for b in self._pending if b <= batch} | {batch}):
                self._retry(self._settle, b, "LFIN")
                self._pending.discard(b)
                self._fresh.discard(b)
            self._acked_through = batch

    def close(self) -> None:
        """Stop touching; give back what the probes hold for a batch that was never planned."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            for probe in self._probes:
                try:
                    probe.release()
                except NSQError as exc:
                    log.warning("could not give back a probe's lease: %s", exc)
            self._close_connections()

    # ------------------------------------------------------------ internals
    def _probe(self, batch: int, cutoff_ns: int | None) -> bool:
        for j, probe in enumerate(self._probes):
            lease = lease_base(self.run, batch, j)
            if probe.lease != lease:
                probe.arm(lease)
            probe.poll()
        if not any(p.held and (cutoff_ns is None or p.first_ns <= cutoff_ns) for p in self._probes):
            return False
        for probe in self._probes:
            probe.seal()
        self._fresh.add(batch)
        return True

    def _settle(self, batch: int, verb: str) -> None:
        addresses = self.opts.addresses
        for p in range(self.opts.num_partitions):
            settle(self._connection(addresses[p % len(addresses)]), lease_base(self.run, batch, p), verb)

    def _connection(self, address: str) -> Connection:
        conn = self._control.get(address)
        if conn is None:
            opts = self.opts
            conn = self._control[address] = lease_consumer(address, opts.topic, opts.channel, opts.msg_timeout_ms)
        return conn

    def _retry(self, operation, *args):
        try:
            return operation(*args)
        except NSQError as exc:
            log.warning("nsqd connection lost, retrying once: %s", exc)
            self._close_connections()
            return operation(*args)

    def _close_connections(self) -> None:
        for conn in self._control.values():
            conn.close()
        self._control.clear()
        for probe in self._probes:
            probe.close()

    def _keep(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock:
                try:
                    for batch in sorted(self._pending):
                        self._settle(batch, "LTOUCH")
                    for probe in self._probes:
                        probe.poll()
                    for conn in self._control.values():
                        conn.read_frames(0)
                except NSQError as exc:  # the next operation reconnects
                    log.warning("touching leases failed: %s", exc)
                    self._close_connections()
