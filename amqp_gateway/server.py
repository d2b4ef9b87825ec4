"""The AMQP listener and the per-connection I/O driver (Trio).

Per connection two tasks share one nursery, as in ``nsqd/tcp.py``: the
reader receives up to 256 KiB, feeds the gateway (engine and daemon calls;
``gateway.STEP_FRAMES`` frames per step, with a checkpoint between steps),
asks the auth servers when the gateway needs them (a login, an expired
authorization; it reads nothing more meanwhile) and writes what that
produced; the pump sleeps until a channel wakes a consuming link, a
heartbeat is due or a publishing link starved by a full topic may be topped
up (the daemon wakes it when room is made; ``POLL_INTERVAL`` is the safety
net). Whichever task writes first fills one batch
per consuming link and sends everything pending with one ``send_all``, round
after round until nothing is left; the other never waits for a lock: the
pump leaves writing to the active writer (which refills before it stops),
the reader waits for it before reading more, so a client that does not read
back-pressures only itself.

Timers: we announce ``idle_timeout`` in our open and close a connection
that sends nothing for twice that long (``amqp:resource-limit-exceeded``:
spec 2.4.5 has a peer announce half its real threshold, so a client that
keeps to the announced value is never cut off by a late frame); we send
an empty frame when we have been silent for half the peer's idle timeout; a
write the peer does not take within ``idle_timeout`` drops the connection.
After a close (ours or the peer's) we linger up to ``LINGER`` seconds for
the peer to hang up, so our close frame is read before the socket goes.

Connections count against ``--max-connections`` together with the NSQ TCP
clients. One over the limit is refused the AMQP way: after the header
exchange (and SASL, which it passes, since nothing follows) it gets open and
at once close with ``amqp:resource-limit-exceeded``.

The amqps listener (``--amqps-address``) runs the same driver over TLS
(``nsqd.tls.TLSStream``, the NSQ protocol's own): the handshake comes first
and must finish within ``HANDSHAKE_TIMEOUT``. Where TLS is required, the
plain listener refuses every connection as above, with
``amqp:not-allowed``.

Whatever goes wrong in a connection stays in it: it is logged, the
connection's consumers leave their channels (requeueing their messages in
order) and the daemon carries on.
"""

from __future__ import annotations

import math
import ssl
from typing import TYPE_CHECKING

import structlog
import trio

from nsqd.accept import accept_loop
from nsqd.broker import PublishError
from nsqd.options import TLS_NOT_REQUIRED, split_host_port
from nsqd.slots import close_stream
from nsqd.tcp import hang_up, peer_address
from nsqd.tls import TLSStream, describe
from nsqd.write_turn import WriteTurn

from . import auth
from .connection import Connection
from .errors import CONNECTION_FORCED, NOT_ALLOWED, RESOURCE_LIMIT_EXCEEDED
from .gateway import CONTAINER_ID, GatewayConnection
from .performatives import Error
from .publisher import POLL_INTERVAL
from .sasl import Authenticate, SaslServer

if TYPE_CHECKING:
    from nsqd.broker import Broker

log = structlog.get_logger("amqp_gateway.server")

RECEIVE_SIZE = 256 * 1024
IDLE_TIMEOUT = 60.0
LINGER = 1.0
#: seconds an amqps client has for its TLS handshake (as an NSQ client's TLS upgrade)
HANDSHAKE_TIMEOUT = 5.0
#: seconds a client has from connecting to its ``open`` (headers, SASL), its own time only: a
#: silent or dribbling socket held a connection slot until the idle cut (RabbitMQ allows 10 s)
OPEN_TIMEOUT = 10.0
#: seconds a multi-frame delivery has from its first frame to its last, as an HTTP body must
#: arrive within 60 s: a client that sent heartbeats and never the last frame held its memory
#: for good (past the connection's free 1 MiB, ``--max-body-memory`` shared with others)
PARTIAL_TIMEOUT = 60.0


async def serve_amqp(nsqd: Broker, address: str, *, idle_timeout: float = IDLE_TIMEOUT,
                     authenticate: Authenticate = auth.authenticate, tls_context: ssl.SSLContext | None = None,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on ``address`` (port 0 picks one) and serve AMQP connections until cancelled.

    ``authenticate(username, password) -> bool`` checks SASL PLAIN logins
    when the daemon has no auth servers (with them, they decide: see
    :mod:`auth`). With ``tls_context`` every connection starts with a TLS
    handshake (amqps); without it, and with ``--tls-required``, every
    connection is refused. ``task_status.started`` gets the list of bound
    ``(host, port)`` pairs.
    """
    host, port = split_host_port(address)
    listeners = await trio.open_tcp_listeners(port, host=host or None)
    addresses = [listener.socket.getsockname()[:2] for listener in listeners]
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept_loop, nsqd, listener, nursery, idle_timeout, authenticate, tls_context)
        task_status.started(addresses)


async def _accept_loop(nsqd: Broker, listener: trio.SocketListener, handlers: trio.Nursery,
                       idle_timeout: float, authenticate: Authenticate, tls_context: ssl.SSLContext | None) -> None:
    slots = nsqd.connection_slots

    def admit(stream: trio.SocketStream) -> None:
        if tls_context is None and nsqd.options.tls_required != TLS_NOT_REQUIRED:
            handlers.start_soon(refuse_connection, nsqd, stream, None, Error(
                NOT_ALLOWED, "TLS is required: connect with amqps" + _amqps_port(nsqd)))
        elif slots.take():
            handlers.start_soon(handle_connection, nsqd, stream, idle_timeout, authenticate, tls_context)
        else:
            handlers.start_soon(refuse_connection, nsqd, stream, tls_context, Error(
                RESOURCE_LIMIT_EXCEEDED, f"max connections ({slots.limit}) reached"))

    async with listener:
        await accept_loop(listener, admit, log)


def _amqps_port(nsqd: Broker) -> str:
    return f" (port {nsqd.amqps_addresses[0][1]})" if nsqd.amqps_addresses else ""


async def _start_tls(stream: trio.SocketStream, tls_context: ssl.SSLContext | None, remote: str) -> trio.abc.Stream | None:
    """The stream to speak AMQP on: ``stream`` itself, or TLS over it once the handshake passed (None: it did not)."""
    if tls_context is None:
        return stream
    secure = TLSStream(stream, tls_context)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            await secure.do_handshake()
    except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as exc:
        log.info("AMQP TLS handshake failed", client=remote, error=str(exc) or type(exc).__name__)
        return None
    return secure


async def handle_connection(nsqd: Broker, stream: trio.SocketStream, idle_timeout: float,
                            authenticate: Authenticate, tls_context: ssl.SSLContext | None = None) -> None:
    """Serve one connection (holding a connection slot); whatever goes wrong stays inside it."""
    remote = peer_address(stream)
    try:
        secure = await _start_tls(stream, tls_context, remote)
        if secure is None:
            await close_stream(stream, remote=remote)
            return
        gateway = GatewayConnection(nsqd, remote, authenticate=authenticate, idle_timeout=idle_timeout,
                                    tls=None if tls_context is None else describe(secure))
        driver = Driver(nsqd, secure, gateway, idle_timeout)
        try:
            await driver.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, ConnectionError):
            log.info("AMQP connection dropped", client=remote)
        except* Exception as group:
            log.error("AMQP connection failed", client=remote, exc_info=group)
        finally:
            try:
                gateway.connection_lost()
            except Exception:  # a bug: this connection's alone, as one while it ran (it was the daemon's)
                log.exception("AMQP connection teardown failed", client=remote)
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    await driver.say_goodbye()
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError):
                    pass
                except Exception:
                    log.exception("AMQP goodbye failed", client=remote)
            await close_stream(stream, remote=remote)
    finally:
        nsqd.connection_slots.give_back()


async def refuse_connection(nsqd: Broker, stream: trio.SocketStream, tls_context: ssl.SSLContext | None,
                            error: Error) -> None:
    """A connection that may not stay (over ``--max-connections``, or plain where TLS is required):
    the header exchange (TLS first on amqps), then open and at once close with ``error``."""
    slots = nsqd.connection_slots
    remote = peer_address(stream)
    log.warning("AMQP connection refused", client=remote, reason=error.description)
    engine = Connection(client=False, container_id=CONTAINER_ID, sasl=SaslServer(_anyone), refuse=error)
    async with slots.refusal(stream) as linger:
        if not linger:  # too many refusals at once: no time for the exchange
            return
        secure = await _start_tls(stream, tls_context, remote)
        if secure is None:
            return
        while not engine.finished:
            data = await secure.receive_some(RECEIVE_SIZE)
            if not data:
                return
            engine.receive_data(data)
            await secure.send_all(engine.data_to_send())
        await hang_up(stream, linger)


def _anyone(username: str, password: str) -> bool:
    """A refused connection's login: anyone passes, since only the refusal follows."""
    return True


class Driver:
    """Moves bytes between one socket and one :class:`GatewayConnection`."""

    def __init__(self, nsqd: Broker, stream: trio.abc.Stream, gateway: GatewayConnection,
                 idle_timeout: float) -> None:
        self.nsqd = nsqd
        self.stream = stream
        self.gateway = gateway
        self.engine = gateway.engine
        self.idle_timeout = idle_timeout
        self._lot = trio.lowlevel.ParkingLot()
        self._turn = WriteTurn()
        self._last_send = trio.current_time()
        self._heartbeats = False
        #: a wake-up that came while the pump was busy: it must not wait for the next one
        self._woken = False
        #: the pump's sleep ends in time to look at starved publishing links again
        self._polling = False
        gateway.on_wake = self._wake

    def _wake(self) -> None:
        self._woken = True
        self._lot.unpark_all()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump)
            try:
                await self._read_loop()
            finally:
                nursery.cancel_scope.cancel()

    async def _read_loop(self) -> None:
        gateway = self.gateway
        engine = self.engine
        receive = self.stream.receive_some
        idle = 2 * self.idle_timeout if self.idle_timeout else math.inf
        open_by = trio.current_time() + OPEN_TIMEOUT
        partials_by = math.inf
        while not engine.finished:
            deadline = trio.current_time() + idle
            if not engine.open_received:
                deadline = min(deadline, open_by)
            with trio.move_on_at(min(deadline, partials_by)) as scope:
                data = await receive(RECEIVE_SIZE)
            now = trio.current_time()
            if now >= partials_by:
                gateway.partials_expired(PARTIAL_TIMEOUT)
                await self._flush(wait=True)
                break
            if scope.cancelled_caught:
                if engine.open_received:
                    gateway.idle_expired()
                else:
                    log.info("AMQP client did not open in time", client=gateway.remote_address)
                    engine.close(Error(RESOURCE_LIMIT_EXCEEDED, "no open in time"))
                await self._flush(wait=True)
                break
            if not data:
                return
            engine.now = now
            gateway.receive_data(data, self.nsqd.now_ns())
            while True:
                while gateway.auth_pending or gateway.pending:
                    await self._confirm()
                    if gateway.auth_pending:
                        await self._flush(wait=True)  # answers to what came before need not wait for the auth servers
                        state = await auth.query(self.nsqd, gateway.remote_address, gateway.auth_secret,
                                                 tls=gateway.tls)
                        gateway.auth_done(state, self.nsqd.now_ns())
                if engine.peer_idle_timeout and not self._heartbeats:
                    self._heartbeats = True
                    self._lot.unpark_all()  # the pump learns the peer's heartbeat interval
                if gateway.publishers_starved and not self._polling:
                    self._lot.unpark_all()  # a link starved while the pump slept without a deadline
                await self._flush(wait=True)
                if not engine.more:
                    break
                await trio.lowlevel.checkpoint()
                gateway.receive_data(b"", self.nsqd.now_ns())
            started = engine.oldest_unfinished
            partials_by = math.inf if started is None else started + PARTIAL_TIMEOUT
            if engine.close_sent:  # ours, for a fault: a moment for the peer to read it, no more
                break
        await self._linger()

    async def _confirm(self) -> None:
        """Wait for the receipts of durable publishes, then let their deliveries be accepted.

        Nothing more is read meanwhile; the pump keeps delivering to the
        connection's receiving links.
        """
        gateway = self.gateway
        while gateway.pending:
            pending, gateway.pending = gateway.pending, []
            for item in pending:
                try:
                    await item.receipt.wait()
                except PublishError as exc:
                    item.done(exc)
                else:
                    item.done(None)

    async def say_goodbye(self) -> None:
        """A connection we end without a close of its own (shutdown, a failure) still gets one;
        one that never got past the headers or SASL gets none (the engine sends nothing)."""
        if self.engine.close_sent or self._turn.busy:
            return  # said already, or a write was cut off midway and the stream is unusable
        self.engine.close(Error(CONNECTION_FORCED, "the daemon ended the connection"))
        if not self.engine.output:
            return
        try:
            await self.stream.send_all(self.engine.data_to_send())
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def _linger(self) -> None:
        """Give the peer a moment to read our close and hang up first."""
        with trio.move_on_after(LINGER):
            while await self.stream.receive_some(RECEIVE_SIZE):
                pass

    async def _pump(self) -> None:
        engine = self.engine
        gateway = self.gateway
        while True:
            peer_idle = engine.peer_idle_timeout
            heartbeat_at = self._last_send + peer_idle / 2 if peer_idle else math.inf
            self._polling = gateway.publishers_starved
            wake_at = min(heartbeat_at, trio.current_time() + POLL_INTERVAL if self._polling else math.inf)
            if not self._woken:
                with trio.move_on_at(wake_at):
                    await self._lot.park()
            self._woken = False
            if trio.current_time() >= heartbeat_at and not engine.close_sent:
                engine.heartbeat()
            if gateway.publishers_starved:
                gateway.poll_publishers()
            await self._flush(wait=False)

    async def _flush(self, wait: bool) -> None:
        """Fill from the channels and write everything pending, one send per round."""
        if not await self._turn.take(wait):
            return
        gateway = self.gateway
        engine = self.engine
        now_ns = self.nsqd.now_ns
        try:
            while True:
                gateway.fill(now_ns())
                if gateway.stopped_short:  # other connections run before the next round
                    await trio.lowlevel.checkpoint()
                if not engine.output:
                    if gateway.stopped_short:
                        continue
                    return
                data = engine.data_to_send()
                engine.write_blocked = True  # the channels wake their other consumers meanwhile
                try:
                    with trio.fail_after(self.idle_timeout or math.inf):
                        await self.stream.send_all(data)
                finally:
                    engine.write_blocked = False
                self._last_send = trio.current_time()
        finally:
            self._turn.give_back()
