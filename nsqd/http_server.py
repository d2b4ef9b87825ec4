"""The HTTP/1.1 server under the HTTP API: h11 on Trio, one task per connection.

h11 parses and serialises (sans-I/O); this module only moves bytes and
keeps time. A connection's task does everything in turn: read a request
head, call the app, write its answer, again for the next (keep-alive,
pipelining). Nothing else writes to the stream, so there are no concurrent
sends, and whatever goes wrong ends inside that task: client faults are
logged in one line, a bug in the app with its traceback, and the daemon
carries on.

Limits (:class:`Limits`, defaults in :data:`DEFAULT_LIMITS`), each with its
policy when reached:

* ``max_connections`` (256): at the cap the oldest connection that is waiting
  for a request head (idle keep-alive, just connected, or a head still
  arriving) is closed to make room; failing that, the one that has waited
  longest (and at least a second) for more of its request body gets
  ``503 {"message":"TOO_MANY_CONNECTIONS"}`` and is closed; when every
  connection is busy otherwise, the newcomer gets that 503 and is closed
  (HTTPS: closed without a handshake). A request the app holds waiting on
  another server (``Request.waiting_elsewhere``: the auth server) counts as a
  stalled body, and so does an answer the client does not take (it is
  closed, since it does not read). A flood of idle sockets, stalled bodies,
  clients that never read or requests waiting on an auth server that never
  answers thus never locks out /ping.
* ``max_head_size`` (16 KiB): a request head that h11 holds incomplete past
  it (its ``max_incomplete_event_size``), or a complete one whose target,
  header names and values add up to more, gets ``431 HEADER_TOO_BIG``.
* ``idle_timeout`` (5 s): the first byte of a request (also the first one on
  a new connection) must arrive within it, else the connection is closed
  without a word (keep-alive idle timeout).
* ``head_timeout`` (10 s, from the same start): the whole head, and the TLS
  handshake on HTTPS, must arrive within it, else ``408 REQUEST_TIMEOUT``.
* ``body_timeout`` (60 s): the whole body, counted from the end of the head,
  not per read: a trickling client is cut off with ``408 REQUEST_TIMEOUT``.
  Bodies are read only as the app asks for them, never past its limit.
* ``send_timeout`` (30 s): a client must take each answer within it, else the
  connection is dropped.

When the server stops (the daemon's shutdown cancels it), connections that
wait for a request close at once; a request already in the app gets
:data:`STOP_ANSWER_TIME` to be answered (with ``Connection: close``), so a
publish that was stored is confirmed rather than cut off.

Malformed requests get h11's status (400, or 501 for an unknown transfer
coding; 505 for an HTTP major version other than 1, HTTP/2's preface
included; 400 too for a path with a malformed ``%`` escape, as Go's
net/http) with an nsqd-style JSON message, then the connection is closed. A
connection closed while the client may still be sending is shut down for
writing and drained for up to :data:`LINGER_TIMEOUT`, so the client reads
our answer instead of a reset.
"""

from __future__ import annotations

import http
import math
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from email.utils import formatdate
from functools import partial
from urllib.parse import unquote

import h11
import structlog
import trio

from . import tls
from .accept import accept_loop
from .options import split_host_port
from .tcp import peer_address

#: the status line's reason phrase, as Go's net/http writes it ("HTTP/1.1 200 OK"): Python's
#: phrases, but for those Go words otherwise (and Python 3.13 renamed: 413 "Content Too Large")
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus} | {
    413: b"Request Entity Too Large", 414: b"Request URI Too Long", 416: b"Requested Range Not Satisfiable",
    418: b"I'm a teapot", 422: b"Unprocessable Entity"}

log = structlog.get_logger("nsqd.http")

#: bytes read from the socket per receive
RECEIVE_SIZE = 64 * 1024
#: a chunked body may average this few bytes a chunk over its first CHUNKS_BEFORE_AVERAGE chunks, no
#: fewer after: h11 spends microseconds on each chunk, so a body of 1-byte chunks costs 40 times
#: the bytes it carries (5 MiB of them: about 20 s of the event loop)
MIN_AVERAGE_CHUNK = 16
CHUNKS_BEFORE_AVERAGE = 65536
#: how long a connection must have waited for more of its body, on another server or for its client
#: to take an answer before it may be closed to make room
BODY_EVICTION_WAIT = 1.0
#: body events handled in a row from what is already buffered before other tasks get a turn
EVENTS_PER_TURN = 1024
#: time and bytes spent draining a client before closing on it
LINGER_TIMEOUT = 1.0
LINGER_BYTES = 1024 * 1024
#: connections being answered 503 at once; beyond, excess ones are closed at once
MAX_REFUSING = 16
#: seconds between two log lines about refused connections
REFUSAL_LOG_INTERVAL = 10.0
#: when the server stops, how long a request already being handled has to be answered
STOP_ANSWER_TIME = 1.0


@dataclass(frozen=True)
class Limits:
    """The server's limits; the module docstring says what happens at each."""

    max_connections: int = 256
    max_head_size: int = 16 * 1024
    idle_timeout: float = 5.0
    head_timeout: float = 10.0
    body_timeout: float = 60.0
    send_timeout: float = 30.0


DEFAULT_LIMITS = Limits()


class RequestAborted(Exception):
    """The request body could not be read; the server deals with the client itself."""


class ClientGone(RequestAborted):
    """The client disconnected before its request body was read."""


class Evicted(RequestAborted):
    """The request waited elsewhere too long while the server was full: answered 503 and closed."""


class BadRequest(RequestAborted):
    """The body broke the protocol or its deadline: answered with ``status`` and closed."""

    def __init__(self, status: int, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail or message


class BrokenBody(BadRequest):
    """The body's chunk framing broke, or the client stopped sending before its end. In Go the
    handler's read fails and nsqd's handlers answer that themselves (``500 INTERNAL_ERROR``, a
    binary ``/mpub``'s ``413``): the app may catch it; if not, the server answers 500."""

    def __init__(self, detail: str) -> None:
        super().__init__(500, "INTERNAL_ERROR", detail)
        #: what of the body the app had read before it broke off (set by the app's reader)
        self.received = b""


@dataclass
class Request:
    """One request as the app sees it; ``receive`` gives the body piece by piece."""

    method: str
    path: str  # percent-decoded
    raw_query: bytes
    headers: Sequence[tuple[bytes, bytes]]  # names in lower case, as h11 gives them
    secure: bool
    remote: str  # "host:port"
    receive: Callable[[], Awaitable[bytes]]  # the next piece of body; b"" once it is complete
    #: a context for a wait on another server (the auth server): at the cap, a request that has
    #: waited there longest (and at least BODY_EVICTION_WAIT) is cancelled, answered 503 and closed
    #: (:class:`Evicted` leaves the context), as a stalled body is
    waiting_elsewhere: Callable[[], AbstractContextManager[None]] = nullcontext


@dataclass
class Response:
    """The app's answer; the server adds Content-Length, Date and Connection."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


App = Callable[[Request], Awaitable[Response]]

#: a ``%`` not followed by two hex digits
BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
#: a URI scheme and its colon, which makes a target not starting with ``/`` an absolute URI
URI_SCHEME = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*:")
#: the bytes Go's net/http takes in a Host header (httpguts.ValidHostHeader); it may be empty
HOST = re.compile(rb"[A-Za-z0-9!$%&'()*+,\-.:;=\[\]_~]*")
#: a line feed with no carriage return before it
_BARE_LF = re.compile(rb"(?<!\r)\n")
#: CR or LF bytes at the start of what follows a POST's body that are skipped (RFC 9112 section 2.2's
#: tolerance for old clients that end a body with a line end, as Go's net/http: at most 4)
STRAY_LINE_ENDS = 4
_ORDINARY_FAULTS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
#: what Go's net/http answers plain HTTP on a TLS port with, when the first five bytes say so
PLAIN_HTTP_ON_HTTPS = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
_PLAIN_HTTP_STARTS = (b"GET /", b"HEAD ", b"POST ", b"PUT /", b"OPTIO")
_STATUS_MESSAGES = {400: "BAD_REQUEST", 431: "HEADER_TOO_BIG", 501: "NOT_IMPLEMENTED"}


def error_response(status: int, message: str) -> Response:
    """The server's own answers, in nsqd's JSON error style."""
    body = b'{"message":"%s"}' % message.encode()
    return Response(status, [(b"Content-Type", b"application/json; charset=utf-8")], body)


async def open_listener(address: str) -> trio.SocketListener:
    """A listener on "host:port"; an empty host means every IPv4 interface, port 0 any port."""
    host, port = split_host_port(address)
    family, type_, proto, _, sockaddr = (await trio.socket.getaddrinfo(
        host or "0.0.0.0", port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE))[0]
    sock = trio.socket.socket(family, type_, proto)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        await sock.bind(sockaddr)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


class HTTPServer:
    """Serves ``app`` on one listener until cancelled (HTTPS when given a TLS context)."""

    def __init__(self, app: App, limits: Limits = DEFAULT_LIMITS, tls_context: ssl.SSLContext | None = None) -> None:
        self.app = app
        self.limits = limits
        self.tls_context = tls_context
        #: the connections counted against max_connections
        self._connections: set[_Connection] = set()
        #: every connection whose task runs, those closed to make room included (a stop covers them)
        self._running: set[_Connection] = set()
        #: connections waiting for a request head, oldest wait first: the ones closed at the cap
        self._waiting: dict[_Connection, None] = {}
        #: connections waiting for more of a request body, on another server for the app or for the
        #: client to take an answer, and since when, longest wait first: closed at the cap once they
        #: have waited BODY_EVICTION_WAIT and no connection waits for a head
        self._stalled: dict[_Connection, float] = {}
        self._refusing = 0
        self._refused = 0
        self._refusal_logged_at = -REFUSAL_LOG_INTERVAL
        self._date = (0, b"")

    async def serve(self, listener: trio.abc.Listener, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept until cancelled; every connection runs in this call's handler nursery."""
        async with listener, trio.open_nursery() as handlers:
            task_status.started()
            try:
                await accept_loop(listener, partial(self._admit, handlers=handlers), log, "HTTP ")
            finally:  # cancelled: the daemon stops
                deadline = trio.current_time() + STOP_ANSWER_TIME
                for connection in list(self._running):
                    connection.stop(deadline)

    def _admit(self, stream: trio.SocketStream, handlers: trio.Nursery) -> None:
        """Serve a new connection, making room at the cap; or refuse it."""
        if len(self._connections) >= self.limits.max_connections and not self._evict_one():
            self._count_refusal()
            if self._refusing < MAX_REFUSING and self.tls_context is None:
                self._refusing += 1
                handlers.start_soon(self._refuse, stream)
            else:
                stream.socket.close()
            return
        connection = _Connection(self, stream)
        self._connections.add(connection)
        self._running.add(connection)
        handlers.start_soon(connection.run)

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for a request, else the one that has
        waited longest, and at least BODY_EVICTION_WAIT, for more of its body, on another server
        or for its client to take an answer; False if none."""
        if self._waiting:
            connection = next(iter(self._waiting))
            del self._waiting[connection]
        elif self._stalled and next(iter(self._stalled.values())) <= trio.current_time() - BODY_EVICTION_WAIT:
            connection = next(iter(self._stalled))
            del self._stalled[connection]
        else:
            return False
        self._waiting.pop(connection, None)  # a connection answering a bad head is in both
        self._stalled.pop(connection, None)
        self._connections.discard(connection)
        connection.evict()
        return True

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """Answer 503 to a connection over the cap, before reading its request."""
        try:
            with trio.move_on_after(LINGER_TIMEOUT):
                refusal = error_response(503, "TOO_MANY_CONNECTIONS")
                await stream.send_all(self.serialise(h11.Connection(h11.SERVER), refusal, close=True))
                await _linger(stream)
        except _ORDINARY_FAULTS:
            pass
        finally:
            self._refusing -= 1
            await _close(stream)

    def _count_refusal(self) -> None:
        """Log refusals at most every REFUSAL_LOG_INTERVAL seconds, with how many there were."""
        self._refused += 1
        now = trio.current_time()
        if now >= self._refusal_logged_at + REFUSAL_LOG_INTERVAL:
            log.warning("HTTP connections refused: too many connections", refused=self._refused,
                        limit=self.limits.max_connections)
            self._refused = 0
            self._refusal_logged_at = now

    def serialise(self, conn: h11.Connection, response: Response, *, close: bool = False,
                  head_only: bool = False, keep_alive_1_0: bool = False) -> bytes:
        """The response's bytes; ``close`` asks the client to close (h11 adds it where HTTP needs it).

        Header names are written as Go's net/http writes them (``Content-Type``).
        ``keep_alive_1_0``: the HTTP/1.0 request asked for ``Connection: keep-alive``,
        and unless ``close``, the answer says it is kept, as Go's does.
        """
        headers = [*response.headers, (b"Content-Length", b"%d" % len(response.body)), (b"Date", self.date())]
        if close:
            headers.append((b"Connection", b"close"))
        data = conn.send(h11.Response(status_code=response.status, headers=headers,
                                      reason=_REASONS.get(response.status, b"")))
        if conn.their_http_version == b"1.0":  # Go's net/http answers in the request's version; to
            # a 1.0 peer it writes Connection only to keep the connection (h11 always closes it)
            kept = b"\r\nConnection: keep-alive\r\n" if keep_alive_1_0 and not close else b"\r\n"
            data = b"HTTP/1.0" + data[8:].replace(b"\r\nConnection: close\r\n", kept, 1)
        if response.body and not head_only:
            data += conn.send(h11.Data(data=response.body))
        return data + conn.send(h11.EndOfMessage())

    def date(self) -> bytes:
        """The Date header's value, formatted once a second."""
        now = int(time.time())
        if now != self._date[0]:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]


class _Connection:
    """One client connection: requests in turn, each answered before the next is read.

    One cancel scope covers the connection's life; its deadline moves with the
    phase (as Go's connection deadlines do): waiting for a request (idle, then
    head), reading the body, sending the answer, none while the app works.
    When it fires, the phase says what the client is owed. Making room at the
    cap cancels the same scope, only ever while the connection waits.
    """

    def __init__(self, server: HTTPServer, stream: trio.SocketStream) -> None:
        self.server = server
        self.limits = server.limits
        self.raw_stream = stream
        self.stream: trio.abc.Stream = stream
        self.remote = peer_address(stream)
        self.h11 = self._new_h11()
        self._scope = trio.CancelScope()
        #: outside ``_scope``: keeps the server's stop from cutting off a request being answered
        #: (``stop`` gives it a deadline instead)
        self._shield = trio.CancelScope(shield=True)
        self._stopping = False
        #: a deadline passed and ``_scope`` is over: what the phase calls for is being answered
        self._answering_deadline = False
        #: the scope of the app's wait on another server, while it lasts
        self._elsewhere: trio.CancelScope | None = None
        self._phase = "idle"  # what the deadline guards: handshake, idle, head, app, body or send
        self._evicted = False
        self._linger = False  # the client may still be sending when we close
        self._body_deadline = 0.0
        self._peer_closed = False
        #: the last answer kept an HTTP/1.0 connection open (its request asked for keep-alive)
        self._kept_1_0 = False
        #: the request being answered is a HEAD: its answers, errors too, carry no body
        self._head_request = False
        #: how many more CR or LF bytes may be skipped before the next request line (after a POST)
        self._stray_allowed = 0
        #: the request body's chunks (chunked bodies) and bytes so far, and events since a turn was given
        self._body_chunks = self._body_bytes = self._body_events = 0

    def evict(self) -> None:
        """Close this connection (it waits for a request, its body or on another server) to make
        room for a new one."""
        self._evicted = True
        if self._elsewhere is not None:
            self._elsewhere.cancel()  # only the wait: the app's request ends in Evicted
        elif self._answering_deadline:
            self._shield.cancel()  # its 408 (the client does not take it): close now
        else:
            self._scope.cancel()

    def stop(self, deadline: float) -> None:
        """The server stops: close now if waiting for a request, else answer it by ``deadline``."""
        self._stopping = True
        if self in self.server._waiting:
            self._shield.cancel()
        else:
            self._shield.deadline = deadline

    @contextmanager
    def _waiting_elsewhere(self) -> Iterator[None]:
        """Request.waiting_elsewhere: the app waits on another server; evictable at the cap."""
        if self._evicted:
            raise Evicted()
        waiting = self.server._stalled
        with trio.CancelScope() as scope:
            self._elsewhere = scope
            waiting[self] = trio.current_time()
            try:
                yield
            finally:
                waiting.pop(self, None)
                self._elsewhere = None
        if scope.cancelled_caught:
            raise Evicted()

    async def run(self) -> None:
        try:
            with self._shield:
                with self._scope:
                    await self._serve()
                if self._scope.cancelled_caught:
                    self._answering_deadline = True
                    await self._deadline_passed()
        except _ORDINARY_FAULTS as exc:
            self._linger = False
            log.info("HTTP connection dropped", client=self.remote, error=str(exc) or type(exc).__name__)
        except Exception:
            self._linger = False
            log.exception("HTTP connection failed", client=self.remote)
        finally:
            self.server._connections.discard(self)
            self.server._running.discard(self)
            self.server._waiting.pop(self, None)
            self.server._stalled.pop(self, None)
            try:
                if self._linger:
                    await _linger(self.raw_stream)
            finally:
                await _close(self.stream)

    async def _serve(self) -> None:
        if self.server.tls_context is not None:
            self._wait()
            self._set_deadline("handshake", trio.current_time() + self.limits.head_timeout)
            stream = tls.TLSStream(self.raw_stream, self.server.tls_context)
            self.stream = stream
            try:
                await stream.do_handshake()
            except ssl.SSLError:
                if stream.head[:5] in _PLAIN_HTTP_STARTS:  # as Go's net/http, in plain HTTP, then close
                    await self._send_raw(PLAIN_HTTP_ON_HTTPS)
                raise
        while True:
            request = await self._read_head()
            if request is None or not await self._answer(request) or self._stopping:
                return
            if self.h11.our_state is h11.MUST_CLOSE and not self._kept_1_0:
                return
            self._next_cycle(after_post=request.method == b"POST")

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head_size)

    def _next_cycle(self, after_post: bool) -> None:
        """Ready for the next request. What the client sent already goes into a fresh h11
        connection where h11 cannot go on with it: after an answer to HTTP/1.0 kept alive (h11 has
        no HTTP/1.0 keep-alive), and when it starts with stray line ends after a POST's body (h11
        would refuse them as an empty request line; up to STRAY_LINE_ENDS are skipped, by
        :meth:`_feed`, of those held and of those still to come)."""
        data, closed = self.h11.trailing_data
        stray = after_post and (data[:1] in (b"\r", b"\n") or not (data or closed))
        self._stray_allowed = STRAY_LINE_ENDS if stray else 0
        if self.h11.our_state is h11.MUST_CLOSE or (stray and data):
            self.h11 = self._new_h11()
            if data:
                self._feed(data)
            if closed:
                self.h11.receive_data(b"")
        else:
            self.h11.start_next_cycle()

    def _feed(self, data: bytes) -> bool:
        """Hand received bytes to h11, less the stray line ends still allowed; False if none are left."""
        if self._stray_allowed and data:
            skip = _leading_line_ends(data[:self._stray_allowed])
            self._stray_allowed = self._stray_allowed - skip if skip == len(data) else 0
            data = data[skip:]
            if not data:
                return False
        self.h11.receive_data(data)
        return True

    def _set_deadline(self, phase: str, deadline: float) -> None:
        self._phase = phase
        self._scope.deadline = deadline

    def _wait(self) -> None:
        """The connection now waits for a request: closable at the cap, oldest wait first."""
        self.server._waiting[self] = None

    async def _deadline_passed(self) -> None:
        """Answer what the phase whose deadline passed calls for (the connection then closes)."""
        if self._evicted and self._phase == "body":
            log.info("HTTP connection stalled in its body closed to make room", client=self.remote)
            with trio.move_on_after(self.limits.send_timeout):
                await self._send_final(error_response(503, "TOO_MANY_CONNECTIONS"))
        elif self._evicted:
            log.debug("HTTP connection closed to make room", client=self.remote)
        elif self._phase in ("head", "body"):
            log.info(f"HTTP request {self._phase} timed out", client=self.remote)
            with trio.move_on_after(self.limits.send_timeout):
                await self._send_final(error_response(408, "REQUEST_TIMEOUT"))
        elif self._phase != "idle":
            log.info(f"HTTP {self._phase} timed out", client=self.remote)

    async def _read_head(self) -> h11.Request | None:
        """The next request head; None when the connection should end (after any answer owed)."""
        conn = self.h11
        limits = self.limits
        start = trio.current_time()
        head_deadline = start + limits.head_timeout
        started = bool(conn.trailing_data[0])
        self._head_request = False
        self._wait()
        try:
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    status = exc.error_status_hint
                    log.info("bad HTTP request", client=self.remote, status=status, error=str(exc))
                    await self._send_final(error_response(status, _STATUS_MESSAGES.get(status, "BAD_REQUEST")))
                    return None
                if event is h11.NEED_DATA:
                    if started:
                        self._set_deadline("head", head_deadline)
                    else:
                        self._set_deadline("idle", min(head_deadline, start + limits.idle_timeout))
                    if not self._feed(await self.stream.receive_some(RECEIVE_SIZE)):
                        continue  # stray line ends only
                    started = True
                elif type(event) is h11.Request:
                    self._head_request = event.method == b"HEAD"
                    self._set_deadline("app", math.inf)
                    refusal = _refusal(event, limits.max_head_size)
                    if refusal is not None:
                        log.info("bad HTTP request", client=self.remote, status=refusal.status,
                                 error=refusal.body.decode())
                        await self._send_final(refusal)
                        return None
                    return event
                else:
                    return None  # ConnectionClosed
        finally:
            self.server._waiting.pop(self, None)

    async def _answer(self, event: h11.Request) -> bool:
        """Call the app and send its answer; False when the connection is to be dropped."""
        target = event.target
        if target == b"*" and event.method == b"OPTIONS":  # about the server itself: Go's answers it
            await self._send_answer(event, Response(200, [], b""))
            return True
        if target[:1] != b"/":  # absolute form (as proxies send it): its path, as Go's router takes it
            authority = target.partition(b"://")[2]
            target = b"/" + authority.partition(b"/")[2] if authority else target
        path, _, query = target.partition(b"?")
        request = Request(
            method=event.method.decode("ascii"),
            path=unquote(path.decode("ascii")),
            raw_query=query,
            headers=event.headers,
            secure=self.server.tls_context is not None,
            remote=self.remote,
            receive=self._receive_body,
            waiting_elsewhere=self._waiting_elsewhere,
        )
        self._body_deadline = trio.current_time() + self.limits.body_timeout
        self._body_chunks = self._body_bytes = 0
        try:
            response = await self.server.app(request)
        except ClientGone:
            log.info("HTTP client left mid-request", client=self.remote)
            return False
        except Evicted:
            log.info("HTTP request waiting on another server closed to make room", client=self.remote)
            await self._send_final(error_response(503, "TOO_MANY_CONNECTIONS"))
            return False
        except BadRequest as exc:
            log.info("bad HTTP request body", client=self.remote, status=exc.status, error=exc.detail)
            await self._send_final(error_response(exc.status, exc.message))
            return False
        await self._send_answer(event, response)
        return True

    async def _send_answer(self, event: h11.Request, response: Response) -> None:
        """Send the answer to ``event``, closing unless its body was read whole and the server goes on."""
        complete = self._body_complete()
        self._linger = not complete
        close = not complete or self._stopping
        keep_alive_1_0 = event.http_version == b"1.0" and _asks_keep_alive(event.headers)
        await self._send(self.server.serialise(self.h11, response, close=close, head_only=event.method == b"HEAD",
                                               keep_alive_1_0=keep_alive_1_0))
        self._kept_1_0 = keep_alive_1_0 and not close

    def _body_complete(self) -> bool:
        """Whether the request's body has been read whole, taking what is already buffered."""
        conn = self.h11
        try:
            while conn.their_state is h11.SEND_BODY:
                if conn.next_event() is h11.NEED_DATA:
                    return False
        except h11.RemoteProtocolError:
            return False
        return conn.their_state is not h11.ERROR  # a body that broke off (BrokenBody)

    async def _receive_body(self) -> bytes:
        """The next piece of the request body, b"" when complete (Request.receive)."""
        conn = self.h11
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                if self._peer_closed:  # it may only have shut down its sending side: answered all the same
                    raise BrokenBody("the client closed before its body ended") from None
                raise BrokenBody(str(exc)) from None
            if type(event) is h11.Data:
                data = event.data
                if event.chunk_start:  # the chunks before it are whole
                    done = self._body_chunks
                    if done >= CHUNKS_BEFORE_AVERAGE and self._body_bytes < done * MIN_AVERAGE_CHUNK:
                        raise BadRequest(400, "CHUNKS_TOO_SMALL", (
                            f"{done} chunks of {self._body_bytes / done:.1f} bytes on average "
                            f"(at least {MIN_AVERAGE_CHUNK} past {CHUNKS_BEFORE_AVERAGE} chunks)"))
                    self._body_chunks = done + 1
                self._body_bytes += len(data)
                self._body_events += 1
                if self._body_events >= EVENTS_PER_TURN:
                    self._body_events = 0
                    await trio.lowlevel.checkpoint()
                return data
            if event is not h11.NEED_DATA:
                return b""  # EndOfMessage; PAUSED once it has been seen
            if _BARE_LF.search(conn.trailing_data[0]):
                # h11 waits for the CRLF that ends a chunk's line, and gets a bare LF: it would wait
                # until the body deadline (Go's read fails at once, since CVE-2025-22871)
                raise BrokenBody("a line of the chunked body ends with a bare LF")
            if conn.they_are_waiting_for_100_continue:  # as Go's: the status line alone
                await self._send(conn.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")))
            self._set_deadline("body", self._body_deadline)
            waiting = self.server._stalled
            waiting[self] = trio.current_time()
            try:
                data = await self.stream.receive_some(RECEIVE_SIZE)
            except _ORDINARY_FAULTS:
                raise ClientGone() from None
            finally:
                waiting.pop(self, None)
            self._set_deadline("app", math.inf)
            self._peer_closed = not data
            conn.receive_data(data)

    async def _send_final(self, response: Response) -> None:
        """An error answer after which the connection closes (lingering: the client may be sending)."""
        self._linger = True
        await self._send(self.server.serialise(self.h11, response, close=True, head_only=self._head_request))

    async def _send_raw(self, data: bytes) -> None:
        """Bytes on the socket itself, under the send deadline (no TLS: it failed)."""
        self._set_deadline("send", trio.current_time() + self.limits.send_timeout)
        await self.raw_stream.send_all(data)

    async def _send(self, data: bytes) -> None:
        self._set_deadline("send", trio.current_time() + self.limits.send_timeout)
        server = self.server
        # closable at the cap while the client does not take it (if still counted, and not
        # waiting for a head already: a bad head's answer)
        stalled = self in server._connections and self not in server._waiting
        if stalled:
            server._stalled[self] = trio.current_time()
        try:
            await self.stream.send_all(data)
        finally:
            if stalled:
                server._stalled.pop(self, None)


def _refusal(event: h11.Request, max_head_size: int) -> Response | None:
    """What h11 lets through but Go's net/http refuses: a complete head over the limit, HTTP other
    than 1.x, a target that is neither a path, ``*`` nor an absolute URI (``GET ping``), a path
    with a malformed ``%`` escape, a malformed or repeated Host header."""
    target = event.target
    if len(target) + sum(len(name) + len(value) for name, value in event.headers) > max_head_size:
        return error_response(431, "HEADER_TOO_BIG")  # h11 only limits heads still incomplete
    if not event.http_version.startswith(b"1."):  # h11 takes any digit.digit
        return error_response(505, "HTTP_VERSION_NOT_SUPPORTED")
    if target[:1] != b"/" and target != b"*" and not URI_SCHEME.match(target):
        return error_response(400, "BAD_REQUEST")
    if BAD_ESCAPE.search(target.partition(b"?")[0]):  # Go's ParseRequestURI refuses it
        return error_response(400, "BAD_REQUEST")
    hosts = expects = 0
    for name, value in event.headers:  # Go's server refuses what it cannot meet, as RFC 9110 allows
        if name == b"host":
            hosts += 1
            if hosts > 1 or not HOST.fullmatch(value):
                return error_response(400, "BAD_REQUEST")
        elif name == b"expect" and not expects:  # Go reads the first Expect header only
            expects = 1
            if b"100-continue" not in (t.strip() for t in value.lower().split(b",")):
                return Response(417, [], b"")  # Go's server meets only 100-continue, wherever in the list
    return None


def _asks_keep_alive(headers) -> bool:
    """Whether a ``Connection`` header lists ``keep-alive`` (Go's ``wantsHttp10KeepAlive``)."""
    return any(name == b"connection" and b"keep-alive" in (token.strip().lower() for token in value.split(b","))
               for name, value in headers)


def _leading_line_ends(data: bytes) -> int:
    """How many bytes at the start of ``data`` are CR or LF."""
    return len(data) - len(data.lstrip(b"\r\n"))


async def _linger(stream: trio.SocketStream) -> None:
    """Stop sending and read what the client still sends, so closing does not reset our answer."""
    with trio.move_on_after(LINGER_TIMEOUT):
        try:
            await stream.send_eof()
            drained = 0
            while drained < LINGER_BYTES:
                data = await stream.receive_some(RECEIVE_SIZE)
                if not data:
                    return
                drained += len(data)
        except _ORDINARY_FAULTS:
            return


async def _close(stream: trio.abc.Stream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1):
        try:
            await stream.aclose()
        except _ORDINARY_FAULTS:
            pass
