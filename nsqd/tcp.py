"""The TCP listener and the per-connection I/O driver for protocol V2.

Per connection two tasks share one nursery, as nsqd's IOLoop and
messagePump: the reader receives up to 256 KiB, feeds the sans-I/O protocol
(which parses and executes every complete command) and writes what that
produced; the pump sleeps until the channel wakes it (messages arrived) or a
heartbeat is due. Whichever task writes first fills from the channel and sends
everything pending in one write; the other never waits for a lock: the
pump leaves the write to the active writer (which refills before it stops),
the reader waits for it to finish before reading more, so a client that does
not read back-pressures its own publishing and never grows our buffers.

Reads are paced: the protocol parses and executes at most
``STEP_COMMANDS`` commands per step and the reader yields (a Trio
checkpoint) between steps, and the compressed and TLS streams expand one
bounded step per receive, so no read, however much it expands, holds the
event loop for long.

A plain TCP connection reads with ``readv`` into a buffer all connections
share, waiting for the socket first when the last read found nothing (a
client waiting for our answer), and writes with one non-blocking ``write``;
Trio's stream calls only when TLS or compression wraps the socket, or when
the socket buffer is full. It waits through the readiness hub
(``nsqd/readiness.py``: its socket registered once in one edge-triggered
epoll) instead of Trio's ``wait_readable``, which registers it again on
every wait. That saves the read that finds nothing and the ``epoll_ctl``
(two of the five system calls of a request and its answer) and most of the
Python around the other reads and writes.

Most requests never wake the reader task. While it is parked waiting for
the client, the hub hands the connection's edges to :meth:`Connection._serve_inline`,
which reads, runs the commands (the protocol is sans-I/O) and writes the
answers in one pass, in the hub's task; a durable publish's answer is
written by :meth:`Connection._release_held`, which the disk queue's commit
task calls as the round settles. Anything else is the reader task's job,
and the inline path hands it over: a read that fills the buffer or ends
the stream, a step that needs I/O (TLS, compression, AUTH), commands left
for a later step, a fatal error, a write the socket does not take whole,
or a consumer's held messages. Single PUBs from 100 publishers: 29.9 →
21.6 µs of daemon CPU a message, and a durable one no longer waits for a
task to be scheduled twice.

Deadlines, as nsqd's: a whole command, line and body, must arrive within two
heartbeat intervals of the previous one completing (the clock does not
restart on every byte, so a body trickled in a byte at a time is cut off and
its buffer freed); with heartbeats disabled an idle client may wait forever,
but a started command still has ``--client-timeout``. The pump, which wakes
for heartbeats anyway, enforces the read deadline while the reader waits
for the client, instead of a cancel scope around every read (single PUBs
from 100 publishers: 70–83 → 50–66 µs of daemon CPU a message). A client
that does not take our writes within one heartbeat interval is
disconnected.

Connections count against ``--max-connections`` (shared with the AMQP
gateway); a client over it gets ``E_TOO_MANY_CONNECTIONS`` and is closed.
"""

from __future__ import annotations

import math
import os
import ssl
from functools import partial
from typing import TYPE_CHECKING

import structlog
import trio

from . import auth, message, tls
from .accept import accept_loop
from .client_v2 import ClientV2
from .compression import CorruptStream, DeflateStream, SnappyStream
from .options import host_of, join_host_port
from .broker import PublishError
from .protocol_v2 import HEARTBEAT, MAGIC_V2, ProtocolV2, Unconfirmed
from .readiness import ReadinessHub
from .slots import LINGER, close_stream
from .staging import PublishBatch
from .write_turn import WriteTurn

if TYPE_CHECKING:
    from .broker import Broker

log = structlog.get_logger("nsqd.tcp")

RECEIVE_SIZE = 256 * 1024
#: plain TCP reads land here, then are copied into the connection's parser at once
_RECEIVE_BUFFER = bytearray(RECEIVE_SIZE)
#: time a new connection has to send the protocol magic
MAGIC_TIMEOUT = 10.0
#: how long a big MPUB that a shutdown let finish has to be confirmed and answered
STOP_ANSWER_TIME = 1.0
_BAD_PROTOCOL = message.encode_error(b"E_BAD_PROTOCOL")
_OK = message.encode_response(b"OK")
#: what the inline path hands the reader when it already ran the commands it read
_PROCESSED = memoryview(b"processed")


async def hang_up(stream: trio.SocketStream, linger: float = LINGER) -> None:
    """Stop writing, then drop what the client still sends until it hangs up (at most ``linger``).

    Closing a socket with unread input makes the kernel send a reset, which
    can destroy the error frame just written before the client reads it.
    """
    with trio.move_on_after(linger):
        try:
            await stream.send_eof()
            while await stream.receive_some(RECEIVE_SIZE):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


async def serve_tcp(nsqd: Broker, listeners, handlers: trio.Nursery, *,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections until cancelled; each runs in the ``handlers`` nursery."""
    async with trio.open_nursery() as nursery:
        hub = ReadinessHub(PublishBatch(nsqd))
        await nursery.start(hub.run)
        for listener in listeners:
            nursery.start_soon(_accept_loop, nsqd, listener, handlers, hub)
        task_status.started()


async def _accept_loop(nsqd: Broker, listener: trio.SocketListener, handlers: trio.Nursery,
                       hub: ReadinessHub) -> None:
    slots = nsqd.connection_slots

    def admit(stream: trio.SocketStream) -> None:
        if slots.take():
            handlers.start_soon(handle_connection, nsqd, stream, hub)
        else:
            handlers.start_soon(refuse_connection, nsqd, stream)

    async with listener:
        await accept_loop(listener, admit, log)


async def handle_connection(nsqd: Broker, stream: trio.SocketStream, hub: ReadinessHub) -> None:
    """Serve one connection (holding a connection slot); whatever goes wrong stays inside it."""
    remote = peer_address(stream)
    try:
        await _serve(nsqd, stream, remote, hub)
    except* (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, ConnectionError,
             ssl.SSLError):
        log.info("connection dropped", client=remote)
    except* Exception as group:
        log.error("connection failed", client=remote, exc_info=group)
    finally:
        nsqd.connection_slots.give_back()
        await close_stream(stream, remote=remote)


async def refuse_connection(nsqd: Broker, stream: trio.SocketStream) -> None:
    """A client over ``--max-connections``: ``E_TOO_MANY_CONNECTIONS``, then hang up."""
    slots = nsqd.connection_slots
    log.warning("connection refused: too many connections", client=peer_address(stream), limit=slots.limit)
    async with slots.refusal(stream) as linger:
        await stream.send_all(message.encode_error(
            f"E_TOO_MANY_CONNECTIONS max connections ({slots.limit}) reached".encode()))
        await hang_up(stream, linger)


async def _serve(nsqd: Broker, stream: trio.SocketStream, remote: str, hub: ReadinessHub) -> None:
    magic = None
    with trio.move_on_after(MAGIC_TIMEOUT):
        magic = await _receive_exactly(stream, 4)
    if magic is None:
        return
    if magic[:4] != MAGIC_V2:
        log.warning("bad protocol magic", client=remote, magic=magic[:4])
        await stream.send_all(_BAD_PROTOCOL)
        await hang_up(stream)
        return
    client = ClientV2(nsqd.new_client_id(), remote, nsqd.options, nsqd.now_ns(), nsqd.topics)
    connection = Connection(nsqd, stream, client, hub)
    nsqd.add_client(client)
    try:
        await connection.run(magic[4:])
    finally:
        client.unsubscribe()
        nsqd.remove_client(client)
    if connection.protocol.closed:  # a fatal error frame was written: let the client read it
        await hang_up(stream)


async def _receive_exactly(stream: trio.SocketStream, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = await stream.receive_some(RECEIVE_SIZE)
        if not chunk:
            return None
        data += chunk
    return data


def peer_address(stream: trio.SocketStream) -> str:
    """``host:port`` of the other end, for logs and stats; IPv6 hosts in brackets, as
    Go's RemoteAddr().String() writes them (/stats remote_address is split by tools)."""
    try:
        host, port = stream.socket.getpeername()[:2]
        return join_host_port(host, port)
    except (OSError, ValueError):
        return "unknown"


class Connection:
    def __init__(self, nsqd: Broker, stream: trio.SocketStream, client: ClientV2, hub: ReadinessHub) -> None:
        self.nsqd = nsqd
        self.stream = stream
        #: the socket's descriptor while the stream is plain TCP (-1 once TLS or compression wraps it)
        self._plain_fd = stream.socket.fileno() if type(stream) is trio.SocketStream else -1
        self._hub = hub
        #: the plain socket's readiness, from the hub (None once TLS or compression wraps it)
        self._watch = hub.watch(self._plain_fd, self._serve_inline) if self._plain_fd >= 0 else None
        #: what the inline path left for the reader task: bytes it read, or _PROCESSED
        self._handoff: bytes | memoryview | None = None
        #: durable publishes the inline path waits for (their answers are held in the protocol)
        self._confirming = 0
        #: set when the last of them settles, made when the reader has to wait for that
        self._confirmed: trio.Event | None = None
        #: the client sent more while the inline path waited for confirmations
        self._edge_while_confirming = False
        #: the connection ended: late confirmations must not touch its (maybe reused) descriptor
        self._gone = False
        #: bytes of the shared body budget held for the big body being received (see body_budget.py)
        self._body_reserved = 0
        #: when the last command was complete (the read deadline counts from it)
        self._last_command = 0.0
        #: the last read found nothing: wait for the socket before reading
        self._wait_first = True
        self.client = client
        self.protocol = ProtocolV2(nsqd, client, hub.batch)
        self._lot = trio.lowlevel.ParkingLot()
        self._turn = WriteTurn()
        self._cancel_scope = trio.CancelScope()
        #: when the messages waiting in the output buffer go out (None: nothing held)
        self._held_until: float | None = None
        #: Go's pump flushes held messages on a ticker of ``output_buffer_timeout`` (started with the
        #: pump, again by IDENTIFY), whose channel keeps one tick: the IDENTIFY that started it, its
        #: start, and when a tick was last taken (a message after an idle tick goes at once)
        self._ticker_identify: int | None = None
        self._tick_origin = self._tick_taken = 0.0
        #: while the read loop waits for the client: when the command it waits for is due (nsqd's
        #: read deadline); the pump enforces it, which spares a cancel scope on every read
        self._read_deadline = math.inf
        #: when the parked pump wakes by itself (-inf while it runs: it looks at the deadline anyway)
        self._pump_wake_at = -math.inf
        #: a wake-up that came while the pump was not parked (busy, or not yet started): it must
        #: not wait for the next one (a consumer's SUB and RDY in one read, then its backlog moved)
        self._woken = False
        client.on_wake = self._wake_pump

    async def run(self, initial: bytes) -> None:
        log.info("client connected", client=self.client.remote_address, id=self.client.id)
        try:
            async with trio.open_nursery() as nursery:
                self._cancel_scope = nursery.cancel_scope
                nursery.start_soon(self._pump)
                try:
                    await self._read_loop(initial)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._gone = True
            self._unwatch()
            self.client.on_wake = _noop
            self.protocol.parser.clear()
            self._fit_body_reservation()
            log.info("client gone", client=self.client.remote_address, id=self.client.id)

    def _wake_pump(self) -> None:
        self._woken = True
        self._lot.unpark_all()

    async def _read_loop(self, data: bytes | memoryview) -> None:
        protocol = self.protocol
        parser = protocol.parser
        self._last_command = trio.current_time()
        while True:
            if data:
                parsed = parser.parsed
                if data is not _PROCESSED:
                    protocol.receive_data(data, self.nsqd.now_ns())
                while True:
                    if protocol.held:
                        await self._confirm()
                    await self._flush(wait=True)
                    while protocol.pending and not protocol.closed:
                        await self._perform(protocol.pending.pop(0))
                        if not protocol.pending:
                            protocol.resume(self.nsqd.now_ns())
                        if protocol.held:
                            await self._confirm()
                        await self._flush(wait=True)
                    if not protocol.more:
                        break
                    await trio.lowlevel.checkpoint()
                    protocol.step(self.nsqd.now_ns())
                if protocol.closed:
                    return
                if parser.parsed != parsed:
                    self._last_command = trio.current_time()
            self._expect_command()
            if not self._fit_body_reservation():  # the deadline keeps running while it waits
                need = parser.awaiting
                if await self.nsqd.body_budget.take(need):
                    self._body_reserved = need
                else:  # no room in time: its body is dropped as it arrives, then refused
                    parser.skip_awaited()
            try:
                data = await self._receive()
            except CorruptStream as exc:  # as nsqd: a body it failed to read is answered (compressed)
                log.warning("client error", client=self.client.remote_address, error=str(exc))
                data = b""
            self._read_deadline = math.inf
            if not data:
                if protocol.cut_short():
                    await self._flush(wait=True)
                return

    async def _receive(self) -> bytes | memoryview:
        """The next bytes from the client; b"" once it hung up.

        A plain TCP connection is read into one buffer that every connection
        shares (the caller copies the bytes into its parser before it yields). A
        client that waited for our answer before sending more (most do) is
        waited for first, which saves the read that would find nothing.
        """
        fd = self._plain_fd
        if fd < 0:
            return await self.stream.receive_some(RECEIVE_SIZE)  # TLS or compression
        if self._wait_first:
            await self._wait_readable()
            if self._handoff is not None:
                data, self._handoff = self._handoff, None
                return data
        else:
            await trio.lowlevel.checkpoint()
        buffer = _RECEIVE_BUFFER
        while True:
            try:
                count = os.readv(fd, (buffer,))
            except BlockingIOError:
                self._wait_first = True
                await self._wait_readable()
                if self._handoff is not None:
                    data, self._handoff = self._handoff, None
                    return data
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc
            # a full buffer: more is likely waiting, read again at once next time
            self._wait_first = count < len(buffer)
            return memoryview(buffer)[:count]

    async def _wait_readable(self) -> None:
        """Park until the hub wakes us; then wait out confirmations the inline path still waits for."""
        await self._watch.wait()
        while self._confirming:  # woken by a hang-up: the answers may still go out
            if self._confirmed is None:
                self._confirmed = trio.Event()
            await self._confirmed.wait()

    def _fit_body_reservation(self) -> bool:
        """Hold as much of the shared body budget as the partial command now buffered needs
        (nothing for one that one read can bring whole); False if that needs room the budget
        lacks now. Every body past a read counts, not only those past 1 MiB (HTTP's): 2,000
        clients that each stalled one byte short of a 1,040,000-byte PUB held 2.6 GB."""
        need = self.protocol.parser.awaiting if not self._gone else 0
        if need <= RECEIVE_SIZE:
            need = 0
        held = self._body_reserved
        if need == held:
            return True
        budget = self.nsqd.body_budget
        if held:
            budget.give_back(held)
            self._body_reserved = 0
        if need and not budget.try_take(need):
            return False
        self._body_reserved = need
        return True

    def _expect_command(self) -> None:
        """Start the read deadline for the next command (the pump enforces it)."""
        self._read_deadline = deadline = self._last_command + self._command_time()
        if deadline < self._pump_wake_at:
            self._lot.unpark_all()

    def _serve_inline(self) -> bool:
        """Serve an edge while the reader is parked: read, run the commands, answer; all in one pass.

        Called by the readiness hub, in its task. Returns True when done (the
        reader stays parked), False to wake the reader for what only it can
        do, with what was read or run left in ``_handoff``.
        """
        if self._confirming:  # the client did not wait for its answer: read once it is written
            self._edge_while_confirming = True
            return True
        protocol = self.protocol
        if self._handoff is not None or protocol.held or protocol.pending or self._turn.busy or self._plain_fd < 0:
            return False
        try:
            count = os.readv(self._plain_fd, (_RECEIVE_BUFFER,))
        except BlockingIOError:  # a stale edge
            return True
        except OSError:  # the reader reads again and fails itself
            return False
        if count == 0 or count == RECEIVE_SIZE:  # the end, or more than one read's worth
            self._handoff = bytes(memoryview(_RECEIVE_BUFFER)[:count])
            self._wait_first = count < RECEIVE_SIZE
            return False
        parser = protocol.parser
        parsed = parser.parsed
        if protocol.stage_single_pub(_RECEIVE_BUFFER, count):
            self._last_command = trio.current_time()
            self._read_deadline = math.inf  # the client waits for us now
            self._await_confirmations()
            return True
        protocol.receive_data(memoryview(_RECEIVE_BUFFER)[:count], self.nsqd.now_ns())
        if parser.parsed != parsed:
            self._last_command = trio.current_time()
        if protocol.pending or protocol.more or protocol.closed or not self._fit_body_reservation():
            self._handoff = _PROCESSED
            return False
        if protocol.held:
            self._read_deadline = math.inf  # the client waits for us now
            self._await_confirmations()
            return True
        if not self._write_inline():
            self._handoff = _PROCESSED
            return False
        self._expect_command()
        return True

    def _await_confirmations(self) -> None:
        """Have the held answers released as their durable publishes settle (see :meth:`_release_held`)."""
        held = self.protocol.held
        if len(held) == 1:  # one durable publish (the first held item is always one)
            self._confirming = 1
            held[0].receipt.on_settled(partial(self._publish_settled, held[0]))
            return
        held = [item for item in held if type(item) is Unconfirmed]
        self._confirming = len(held) + 1  # + 1: callbacks that run at once do not release early
        for item in held:
            item.receipt.on_settled(partial(self._publish_settled, item))
        self._publish_settled(None, None)

    def _publish_settled(self, item: Unconfirmed | None, error: PublishError | None) -> None:
        if item is not None:
            item.error = error
        self._confirming -= 1
        if not self._confirming:
            try:
                self._release_held()
            except Exception as exc:  # a bug: this connection fails, not the commit task
                if self._confirmed is not None:
                    self._confirmed.set()
                if not self._gone:
                    self._watch.fail(exc)

    def _release_held(self) -> None:
        """Every held publish settled: queue the answers in order and write them.

        Runs in a disk queue's commit task (or the hub's). What cannot be
        written at once, and a client that sent more meanwhile, is left to
        the reader task.
        """
        protocol = self.protocol
        held, protocol.held = protocol.held, []
        if len(held) == 1:  # the usual case: one publish, nothing behind it
            item = held[0]
            frame = protocol.answer(item, None if item.error is None else item.error.reason)
            if self._confirmed is None:
                frame = self._write_answer(frame)
                if not frame:
                    if self._edge_while_confirming:
                        self._edge_while_confirming = False
                        self._watch.wake()
                    else:
                        self._expect_command()
                    return
            self.client.out.append(frame)
        else:
            self.client.out.extend(
                protocol.answer(item, None if item.error is None else item.error.reason)
                if type(item) is Unconfirmed else item for item in held)
        self.client.flush_now = True
        if self._confirmed is not None:
            self._confirmed.set()
            self._confirmed = None
        if self._gone:
            return
        if not self._write_inline():
            self._handoff = _PROCESSED
        elif self._edge_while_confirming:
            self._edge_while_confirming = False
        else:
            self._expect_command()
            return
        self._watch.wake()

    def _write_answer(self, frame: bytes) -> bytes:
        """Write one answer at once if nothing else waits to go out; what is left to write (b"": all sent)."""
        client = self.client
        if client.out or client.sub is not None or self._turn.busy or self._gone or self._plain_fd < 0:
            return frame
        try:
            sent = os.write(self._plain_fd, frame)
        except OSError:  # full (or failed): the general way writes it, or finds the error
            return frame
        return frame[sent:]

    def _write_inline(self) -> bool:
        """Write what is pending with one ``write``; False if the reader task must finish it.

        When the pump or the reader is writing, it sends these frames too
        (a writer refills before it gives its turn back).
        """
        if self._turn.busy:
            return True
        client = self.client
        out = client.out
        if client.sub is not None:
            client.fill(self.nsqd.now_ns())
        if not out:
            self._held_until = None
            return True
        if client.holds_output():
            return False
        data = b"".join(out)
        out.clear()
        client.flush_now = False
        self._held_until = None
        try:
            sent = _send_now(self._plain_fd, data)
        except trio.BrokenResourceError:  # the reader's next read finds the end
            return False
        if sent < len(data):
            out.append(data[sent:])
            client.flush_now = True
            return False
        return True

    def _unwatch(self) -> None:
        """The socket is no longer read directly (closing, or wrapped by TLS or compression)."""
        if self._watch is not None:
            self._hub.forget(self._watch)
            self._watch = None

    def _read_timed_out(self) -> None:
        """The client sent no whole command in time: log why and end the connection."""
        buffered = self.protocol.parser.buffered
        if buffered:
            log.warning("command not received in time", client=self.client.remote_address, buffered=buffered)
        else:
            log.warning("client missed heartbeats", client=self.client.remote_address)
        self._cancel_scope.cancel()

    def _command_time(self) -> float:
        """Seconds a whole command has, from the end of the previous one (nsqd's read deadline)."""
        hb = self.client.heartbeat_interval_ns
        if hb > 0:
            return 2 * hb / 1e9
        return self.nsqd.options.client_timeout if self.protocol.parser.buffered else math.inf

    async def _pump(self) -> None:
        """Heartbeats, messages for the client, held output, and the read deadline."""
        client = self.client
        last_heartbeat = self._tick_origin = self._tick_taken = trio.current_time()
        while True:
            hb = client.heartbeat_interval_ns / 1e9
            wake_at = last_heartbeat + hb if hb > 0 else math.inf
            if self._held_until is not None:  # messages wait in the output buffer: send them by then
                wake_at = min(wake_at, self._held_until)
            self._pump_wake_at = wake_at = min(wake_at, self._read_deadline)
            if not self._woken:
                with trio.move_on_at(wake_at):
                    await self._lot.park()
            else:  # woken while busy: others run first, so a run of wake-ups cannot hold the loop
                await trio.lowlevel.checkpoint()
            self._woken = False
            self._pump_wake_at = -math.inf
            now = trio.current_time()
            if now >= self._read_deadline:
                if self.protocol.cut_short():
                    with trio.move_on_after(1):  # the client may not read it: a second, no more
                        await self._flush(wait=True)
                self._read_timed_out()
                return
            if hb > 0 and now >= last_heartbeat + hb:
                client.out.append(HEARTBEAT)
                client.flush_now = True
                last_heartbeat = now
            if client.exit_requested:
                self._cancel_scope.cancel()
                return
            await self._flush(wait=False)

    async def _confirm(self) -> None:
        """Wait for the receipts of durable publishes, then release the answers held behind them.

        Nothing more is read meanwhile (the publisher waits for its OK anyway);
        the pump keeps delivering messages to this connection.
        """
        protocol = self.protocol
        held, protocol.held = protocol.held, []
        frames = []
        for item in held:
            if type(item) is Unconfirmed:
                try:
                    await item.receipt.wait()
                except PublishError as exc:
                    frames.append(protocol.answer(item, exc.reason))
                else:
                    frames.append(protocol.answer(item, None))
            else:
                frames.append(item)
        self.client.out.extend(frames)
        self.client.flush_now = True

    async def _perform(self, step: tuple) -> None:
        """One async step a command asked for: a stream upgrade, an auth query or a big MPUB's steps."""
        client = self.client
        kind = step[0]
        if kind == "auth":
            await self._authorize()
            return
        if kind == "steps":  # a big MPUB: every other task runs between its steps
            # stored to its end and answered though the daemon stops meanwhile (its body is in):
            # cut off, the publisher could not tell what was stored and would send it all again
            with trio.CancelScope(shield=True):
                while self.protocol.publish_step():
                    await trio.lowlevel.checkpoint()
                if self.nsqd.draining:  # the shutdown cancels this connection next: answer now, briefly
                    with trio.move_on_after(STOP_ANSWER_TIME):
                        if self.protocol.held:
                            await self._confirm()
                        await self._flush(wait=True)
            return
        async with self._turn.held():  # no pump writes while the stream is replaced
            commands, unparsed = self.protocol.drop_before_upgrade()
            if commands or unparsed:
                log.warning("what was sent before the upgrade was dropped", client=client.remote_address,
                            to=kind, commands=commands, bytes=unparsed)
                self._fit_body_reservation()  # a partial body dropped with them gives its room back
            if kind == "tls":
                stream = tls.TLSStream(self.stream, self.nsqd.tls_context)
                try:
                    with trio.fail_after(5):
                        await stream.do_handshake()
                except (ssl.SSLError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                    await self._refuse_upgrade(tls.handshake_failure(stream, exc))
                    return
                for key, value in tls.describe(stream).items():
                    setattr(client, key, value)
                client.tls = True
                client.common_name = stream.peer_common_name()
            elif kind == "snappy":
                stream = SnappyStream(self.stream)
                client.snappy = True
            else:
                stream = DeflateStream(self.stream, step[1])
                client.deflate = True
            self.stream = stream
            self._plain_fd = -1
            self._unwatch()
            log.info("connection upgraded", client=client.remote_address, to=kind)
            await self.stream.send_all(_OK)

    async def _refuse_upgrade(self, reason: str) -> None:
        """A failed TLS handshake: Go's fatal ``E_IDENTIFY_FAILED``, written in plain text, then the end."""
        log.warning("TLS upgrade failed", client=self.client.remote_address, error=reason)
        self.protocol.closed = True
        with trio.move_on_after(1):
            try:
                await self.stream.send_all(message.encode_error(b"E_IDENTIFY_FAILED IDENTIFY failed " + reason.encode()))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _authorize(self) -> None:
        client = self.client
        opts = self.nsqd.options
        try:
            state = await auth.query_any(
                opts.auth_http_addresses, remote_ip=host_of(client.remote_address), tls=client.tls,
                secret=client.auth_secret, common_name=client.common_name, now=self.nsqd.now_ns() / 1e9,
                method=opts.auth_http_request_method, connect_timeout=opts.http_client_connect_timeout,
                request_timeout=opts.http_client_request_timeout)
        except auth.AuthError as exc:
            self.protocol.auth_done(None, str(exc))
        else:
            self.protocol.auth_done(state, None)

    async def _flush(self, wait: bool) -> None:
        """Fill from the channel and write what is pending, one send per round.

        Messages alone may wait, as in nsqd's buffered writer, until the
        output buffer is full, the client is not ready for more, another frame
        must go, or ``output_buffer_timeout`` passed (the pump wakes for it).
        """
        if not await self._turn.take(wait):
            return
        client = self.client
        out = client.out
        try:
            while True:
                client.fill(self.nsqd.now_ns())
                if client.stopped_short:  # a budget stopped it: other clients run before the next fill
                    await trio.lowlevel.checkpoint()
                if not out:
                    if client.stopped_short:
                        continue
                    self._held_until = None
                    return
                if client.holds_output():
                    now = trio.current_time()
                    if self._held_until is None:
                        self._held_until = self._next_tick(now)
                        if self._held_until > now:
                            self._lot.unpark_all()  # the pump learns when to send them
                    if now < self._held_until:
                        return
                    self._tick_taken = now  # the tick sends them
                data = b"".join(out)
                out.clear()
                client.flush_now = False
                self._held_until = None
                if self._plain_fd >= 0:
                    sent = _send_now(self._plain_fd, data)
                    if sent == len(data):
                        continue
                    data = memoryview(data)[sent:]
                hb = client.heartbeat_interval_ns
                client.write_blocked = True  # the channel wakes its other consumers meanwhile
                try:
                    with trio.CancelScope(deadline=trio.current_time() + hb / 1e9 if hb > 0 else math.inf) as scope:
                        await self.stream.send_all(data)
                finally:
                    client.write_blocked = False
                if scope.cancelled_caught:
                    raise trio.TooSlowError("client did not read its messages in time")
        finally:
            self._turn.give_back()

    def _next_tick(self, now: float) -> float:
        """When Go's output buffer ticker next fires for held messages: its kept tick, if one
        fired since it was last taken (then at once), else the next one."""
        client = self.client
        if client.identified_ns != self._ticker_identify:  # a new ticker: its first tick a period on
            self._ticker_identify = client.identified_ns
            self._tick_origin = self._tick_taken = now - (self.nsqd.now_ns() - client.identified_ns) / 1e9
        period = client.output_buffer_timeout_ns / 1e9
        origin = self._tick_origin
        return origin + (math.floor((self._tick_taken - origin) / period) + 1) * period


def _send_now(fd: int, data: bytes) -> int:
    """What one non-blocking write of ``data`` to a plain socket sent (usually all of it).

    Skips the send wrapper and deadline scope a whole ``send_all`` costs; the
    rest, if the socket buffer is full, goes through ``send_all``.
    """
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket write failed: {exc}") from exc


def _noop() -> None:
    return None
