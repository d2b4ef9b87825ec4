"""The HTTP server under the API (nsqd/http_server.py): hostile and unusual clients over real sockets.

No client may end the daemon or disturb other clients; every limit answers
as docs/http.md says. Limits are made small per test through
``http_server.DEFAULT_LIMITS`` (the ``daemon`` fixture), or the defaults are
run in virtual time (``autojump_clock``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import socket
import ssl
import time

import pytest
import structlog
import trio
import trustme

from nsqd import http_server

from .conftest import HTTPResponse, http_port
from .support import NSQConnection, running_nsqd, tcp_port


@pytest.fixture
async def daemon(request, tmp_path, monkeypatch):
    """The daemon with HTTP on an ephemeral port; ``request.param`` overrides server limits."""
    limits = dataclasses.replace(http_server.DEFAULT_LIMITS, **getattr(request, "param", {}))
    monkeypatch.setattr(http_server, "DEFAULT_LIMITS", limits)
    async with running_nsqd(tmp_path / "nsqd", http_address="127.0.0.1:0", max_msg_size=64,
                            max_body_size=256) as nsqd:
        yield nsqd


class Raw:
    """A raw HTTP/1.1 client: bytes out exactly as given, responses parsed one by one."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buf = bytearray()

    @classmethod
    async def open(cls, port: int) -> Raw:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _fill(self) -> bool:
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            data = b""
        self.buf += data
        return bool(data)

    async def response(self, timeout: float = 5, *, to_head: bool = False) -> HTTPResponse:
        """The next response (a 1xx counts as one); its body is framed by Content-Length (none for HEAD)."""
        with trio.fail_after(timeout):
            while b"\r\n\r\n" not in self.buf:
                if not await self._fill():
                    raise EOFError(f"connection closed; received {bytes(self.buf)!r}")
            head, _, _ = bytes(self.buf).partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = len(head) + 4 + (0 if to_head else int(headers.get("content-length", 0)))
            while len(self.buf) < length:
                if not await self._fill():
                    raise EOFError("connection closed mid-body")
            body = bytes(self.buf[len(head) + 4:length])
            del self.buf[:length]
            return HTTPResponse(status, headers, body)

    async def closed(self, timeout: float = 5) -> bool:
        """True once the server closed the connection with nothing more sent."""
        with trio.fail_after(timeout):
            while await self._fill():
                pass
        return not self.buf

    async def aclose(self) -> None:
        await self.stream.aclose()


async def exchange(port: int, data: bytes) -> HTTPResponse:
    """One raw request on its own connection; the answer."""
    client = await Raw.open(port)
    try:
        await client.send(data)
        return await client.response()
    finally:
        await client.aclose()


def json_error(response: HTTPResponse, status: int, message: str) -> None:
    assert (response.status, response.json()) == (status, {"message": message})
    assert response.headers["content-type"] == "application/json; charset=utf-8"


def topic_depth(nsqd, name: str) -> int:
    topic = nsqd.topics.get(name)
    return topic.depth if topic is not None else 0


# ------------------------------------------------------------- crash-proof


async def test_stray_bytes_after_connection_close_never_end_the_daemon(daemon):
    """hypercorn died with BusyResourceError after 4-8 of these; TCP clients keep working throughout."""
    port = http_port(daemon)
    consumer = await NSQConnection.open(tcp_port(daemon))
    producer = await NSQConnection.open(tcp_port(daemon))
    await consumer.sub("t", "c")
    await consumer.command("RDY 1000")
    received = []

    async def consume() -> None:
        while len(received) < 200:
            message = await consumer.read_message()
            received.append(message.body)
            await consumer.command(b"FIN " + message.id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        for i in range(200):
            client = await Raw.open(port)
            request = b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            if i % 2:  # the stray bytes in the same write, or just after it
                await client.send(request + b"GARBAGE")
            else:
                await client.send(request)
                await client.send(b"GARBAGE" * (i % 7 + 1))
            response = await client.response()
            assert (response.status, response.body) == (200, b"OK")
            assert await client.closed()
            await client.aclose()
            await producer.pub("t", b"%d" % i)
    assert received == [b"%d" % i for i in range(200)]
    await consumer.close()
    await producer.close()


@pytest.mark.parametrize("request_bytes,status,message", [
    (b"GARBAGE\r\n\r\n", 400, "BAD_REQUEST"),
    (b"GET /ping\r\n\r\n", 400, "BAD_REQUEST"),
    (b"GET /ping HTTP/1.1\r\n\r\n", 400, "BAD_REQUEST"),  # no Host
    (b"GET /ping HTTP/2.0\r\nHost: x\r\n\r\n", 505, "HTTP_VERSION_NOT_SUPPORTED"),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, "HTTP_VERSION_NOT_SUPPORTED"),  # the HTTP/2 preface
    (b"GET /p ing HTTP/1.1\r\nHost: x\r\n\r\n", 400, "BAD_REQUEST"),
    (b"GET /ping HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400, "BAD_REQUEST"),
    (b"GET /ping HTTP/1.1\r\nHost: x\r\n: empty name\r\n\r\n", 400, "BAD_REQUEST"),
    (b"GET /ping HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400, "BAD_REQUEST"),
    (b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "BAD_REQUEST"),
    (b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx", 400,
     "BAD_REQUEST"),
    (b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "NOT_IMPLEMENTED"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32) + b"\r\n\r\n", 400, "BAD_REQUEST"),  # TLS hello
])
async def test_malformed_requests_get_4xx_json_then_close(daemon, request_bytes, status, message):
    port = http_port(daemon)
    with structlog.testing.capture_logs() as logs:
        client = await Raw.open(port)
        await client.send(request_bytes)
        json_error(await client.response(), status, message)
        assert await client.closed()
        await client.aclose()
        assert (await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")).body == b"OK"
    assert not [entry for entry in logs if entry["log_level"] in ("error", "critical")]
    assert [entry["status"] for entry in logs if entry["event"] == "bad HTTP request"] == [status]
    assert list(daemon.topics) == []


async def test_oversized_head_is_431_and_the_daemon_serves_on(daemon):
    port = http_port(daemon)
    response = await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    json_error(response, 431, "HEADER_TOO_BIG")
    # many small headers that never end: cut at the limit as well
    client = await Raw.open(port)
    await client.send(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
    for _ in range(25):
        await client.send(b"X-Header: value\r\n" * 100)
        await trio.sleep(0.01)
    json_error(await client.response(), 431, "HEADER_TOO_BIG")
    await client.aclose()
    # a complete head over the limit that arrives in one piece, right after a body
    client = await Raw.open(port)
    await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx"
                      b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 16_400 + b"\r\n\r\n")
    assert (await client.response()).body == b"OK"
    json_error(await client.response(), 431, "HEADER_TOO_BIG")
    assert await client.closed()
    # a head below the limit is fine
    response = await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 16_000 + b"\r\n\r\n")
    assert (response.status, response.body) == (200, b"OK")


def api_error(response: HTTPResponse, status: int, message: str) -> None:
    """An error the API answered (not the server alone): nsqd's header too."""
    json_error(response, status, message)
    assert response.headers["x-nsq-content-type"] == "nsq; version=1.0"


async def test_malformed_chunked_body_is_go_nsqds_answer_to_a_failed_read(daemon):
    """In Go the handler's read fails: nsqd answers 500 (text /mpub, /pub, PUT /config) with its
    own headers, a binary /mpub 413 naming the part its reader could not read; then it closes."""
    chunked = b"POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    mpub = b"\x00\x00\x00\x02\x00\x00\x00\x03abc\x00\x00\x00\x03def"
    cases = [
        (b"/mpub?topic=t", b"4\r\nab\ncd\r\nzz\r\n", 500, "INTERNAL_ERROR"),
        (b"/pub?topic=t", b"zz\r\nab\r\n", 500, "INTERNAL_ERROR"),
        (b"/mpub?topic=t&binary=true", b"2\r\n\x00\x00\r\nzz\r\n", 413, "BAD_BODY"),
        (b"/mpub?topic=t&binary=true", b"9\r\n" + mpub[:9] + b"\r\nzz\r\n", 413, "BAD_MESSAGE"),
    ]
    for target, body, status, message in cases:
        client = await Raw.open(http_port(daemon))
        await client.send(chunked % target + body)
        response = await client.response()
        api_error(response, status, message)
        assert response.headers["connection"] == "close"
        assert await client.closed()
    client = await Raw.open(http_port(daemon))
    await client.send(b"PUT /config/log_level HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    api_error(await client.response(), 500, "INTERNAL_ERROR")
    assert topic_depth(daemon, "t") == 0


async def test_a_binary_mpub_cut_short_is_413_for_the_part_not_read(daemon):
    """A client that shuts down its sending side mid-body: nsqd's MPUB reader names what failed."""
    mpub = b"\x00\x00\x00\x02\x00\x00\x00\x03abc\x00\x00\x00\x03def"
    for sent, message in ((mpub[:2], "BAD_BODY"), (mpub[:6], "BAD_MESSAGE")):
        client = await Raw.open(http_port(daemon))
        await client.send(b"POST /mpub?topic=t&binary=true HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                          % len(mpub) + sent)
        await client.stream.send_eof()
        api_error(await client.response(), 413, message)
    assert topic_depth(daemon, "t") == 0


async def test_a_chunked_body_with_bare_lf_lines_fails_at_once(daemon):
    """h11 waited for the CRLF until the 60 s body deadline; Go's chunked reader fails at once."""
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\n0\n\n")
    api_error(await client.response(timeout=2), 500, "INTERNAL_ERROR")
    assert topic_depth(daemon, "t") == 0
    # a CRLF line split across reads, and trailers, are still fine
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r")
    await trio.sleep(0.05)
    await client.send(b"\nabc\r\n0\r\nX-Trailer: y\r\n")
    await trio.sleep(0.05)
    await client.send(b"\r\n")
    assert (await client.response()).body == b"OK"
    assert topic_depth(daemon, "t") == 1


async def test_a_chunk_header_over_the_head_limit_breaks_the_body(daemon):
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"1;" + b"e" * 100_000 + b"\r\nx\r\n0\r\n\r\n")
    api_error(await client.response(), 500, "INTERNAL_ERROR")  # Go's chunked reader fails on a long line
    assert topic_depth(daemon, "t") == 0


async def test_a_client_that_shuts_down_mid_body_still_gets_an_answer(daemon):
    """Go's ReadAll fails and nsqd answers 500; the client only shut down its sending side."""
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    await client.stream.send_eof()
    api_error(await client.response(), 500, "INTERNAL_ERROR")
    assert topic_depth(daemon, "t") == 0


async def test_a_chunked_body_of_tiny_chunks_is_refused(tmp_path):
    """Each chunk costs h11 microseconds: past 65,536 chunks a body must average 16 bytes a chunk.
    (Gathered in one buffer, not a list of the pieces: 1-byte chunks held 60 bytes each.)"""
    async with running_nsqd(tmp_path / "nsqd", http_address="127.0.0.1:0") as nsqd:
        port = http_port(nsqd)
        head = b"POST /mpub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        line = b"m" * 15 + b"\n"
        client = await Raw.open(port)  # 70,000 chunks of 16 bytes: one line each
        await client.send(head + b"10\r\n" + line + (b"\r\n10\r\n" + line) * 69_999 + b"\r\n0\r\n\r\n")
        response = await client.response(timeout=30)
        assert (response.status, response.body) == (200, b"OK")
        assert nsqd.topics["t"].message_count == 70_000
        await client.aclose()
        client = await Raw.open(port)  # 70,000 chunks of 1 byte
        await client.send(head + b"1\r\nx\r\n" * 70_000 + b"0\r\n\r\n")
        json_error(await client.response(timeout=30), 400, "CHUNKS_TOO_SMALL")
        await client.aclose()
        assert nsqd.topics["t"].message_count == 70_000


@pytest.mark.parametrize("daemon", [{"max_connections": 4}], indirect=True)
async def test_bodies_stalled_at_the_cap_make_room_for_new_requests(daemon, monkeypatch):
    """At the cap, with no connection waiting for a head, the one stalled longest (and at least
    BODY_EVICTION_WAIT) in its body gets a 503 and is closed: slow bodies never lock out /ping."""
    monkeypatch.setattr(http_server, "BODY_EVICTION_WAIT", 0.2)
    port = http_port(daemon)
    stalled = []
    for _ in range(4):
        client = await Raw.open(port)
        await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        stalled.append(client)
        await trio.sleep(0.05)
    await trio.sleep(0.3)
    assert (await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")).body == b"OK"
    json_error(await stalled[0].response(), 503, "TOO_MANY_CONNECTIONS")
    assert await stalled[0].closed()
    for client in stalled[1:]:  # the others finish their requests
        await client.send(b"defghij")
        assert (await client.response()).body == b"OK"
        await client.aclose()
    assert topic_depth(daemon, "t") == 3


@pytest.mark.parametrize("daemon", [{"max_connections": 4}], indirect=True)
async def test_clients_that_never_read_their_answers_make_room_at_the_cap(daemon, monkeypatch):
    """Pipelined requests whose answers the client never reads held their connections in the
    send phase for send_timeout (30 s), where nothing could close them: 256 such clients gave
    everyone else 503 for as long as they cared to reconnect. The one that waited longest (and
    at least BODY_EVICTION_WAIT) for its client to take an answer is closed to make room."""
    monkeypatch.setattr(http_server, "BODY_EVICTION_WAIT", 0.2)
    port = http_port(daemon)
    readers = []
    for _ in range(4):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await trio.to_thread.run_sync(sock.connect, ("127.0.0.1", port))
        client = Raw(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
        await client.send(b"GET /stats?format=json HTTP/1.1\r\nHost: x\r\n\r\n" * 300)  # never read
        readers.append(client)
    await trio.sleep(0.5)
    assert (await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")).body == b"OK"
    for client in readers:
        await client.aclose()


async def test_seeded_mutations_of_valid_requests_never_take_the_daemon_down(daemon):
    """1000 requests with random bytes flipped, cut or repeated; /ping and publishing carry on."""
    port = http_port(daemon)
    rng = random.Random(11)
    valid = [
        b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
        b"POST /mpub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\na\nb\r\n0\r\n\r\n",
        b"GET /stats?format=json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"PUT /config/log_level HTTP/1.0\r\nContent-Length: 4\r\n\r\ninfo",
    ]
    statuses = set()
    with structlog.testing.capture_logs() as logs:
        for i in range(1000):
            data = bytearray(rng.choice(valid) * rng.choice((1, 1, 2)))
            for _ in range(rng.randint(1, 4)):
                position = rng.randrange(len(data))
                action = rng.random()
                if action < 0.5:
                    data[position] = rng.randrange(256)
                elif action < 0.75:
                    del data[position:position + rng.randint(1, 8)]
                else:
                    data[position:position] = data[position:position + rng.randint(1, 40)]
            client = await Raw.open(port)
            try:
                await client.send(bytes(data))
                await client.stream.send_eof()  # a cut request ends here instead of waiting for more
                statuses.add((await client.response()).status)
            except (EOFError, trio.BrokenResourceError):
                pass
            finally:
                await client.aclose()
    assert 400 in statuses and 200 in statuses
    assert not [entry for entry in logs if entry["log_level"] in ("error", "critical")]
    assert (await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")).body == b"OK"
    producer = await NSQConnection.open(tcp_port(daemon))
    await producer.pub("after", b"still here")
    assert topic_depth(daemon, "after") == 1
    await producer.close()


# ------------------------------------------------------------------ limits


@pytest.mark.parametrize("daemon", [{"idle_timeout": 0.3, "head_timeout": 0.6}], indirect=True)
async def test_idle_connection_is_closed_silently_and_a_slow_head_gets_408(daemon):
    port = http_port(daemon)
    idle = await Raw.open(port)
    start = trio.current_time()
    assert await idle.closed(timeout=3)  # no bytes, just closed
    assert 0.25 <= trio.current_time() - start < 2

    slow = await Raw.open(port)
    start = trio.current_time()
    for byte in b"GET /ping ":  # a byte every 0.1 s: never idle, head never done
        await slow.send(bytes([byte]))
        await trio.sleep(0.1)
    json_error(await slow.response(), 408, "REQUEST_TIMEOUT")
    assert 0.5 <= trio.current_time() - start < 2.5


@pytest.mark.parametrize("daemon", [{"idle_timeout": 0.3}], indirect=True)
async def test_keep_alive_idle_timeout_closes_between_requests(daemon):
    client = await Raw.open(http_port(daemon))
    await client.send(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await client.response()).body == b"OK"
    await trio.sleep(0.1)
    await client.send(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")  # within the idle timeout: same connection
    assert (await client.response()).body == b"OK"
    assert await client.closed(timeout=3)


async def test_trickled_body_is_cut_off_at_the_whole_body_deadline(autojump_clock, daemon):
    """Default limits in virtual time: one byte every 25 s never resets the 60 s body deadline."""
    assert http_server.DEFAULT_LIMITS.body_timeout == 60
    client = await Raw.open(http_port(daemon))
    start = trio.current_time()
    await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nx")
    async with trio.open_nursery() as nursery:
        async def trickle() -> None:
            while True:
                await trio.sleep(25)
                await client.send(b"x")

        nursery.start_soon(trickle)
        response = await client.response(timeout=120)
        nursery.cancel_scope.cancel()
    json_error(response, 408, "REQUEST_TIMEOUT")
    assert 60 <= trio.current_time() - start < 61
    assert topic_depth(daemon, "t") == 0


@pytest.mark.parametrize("daemon", [{"max_connections": 4}], indirect=True)
async def test_connection_cap_answers_503_when_all_are_busy(daemon):
    port = http_port(daemon)
    busy = []
    for _ in range(4):  # each mid-body: not idle, so never closed to make room
        client = await Raw.open(port)
        await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        busy.append(client)
    await trio.sleep(0.1)
    with structlog.testing.capture_logs() as logs:
        response = await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    json_error(response, 503, "TOO_MANY_CONNECTIONS")
    assert [entry["refused"] for entry in logs if entry["event"].startswith("HTTP connections refused")] == [1]
    # the busy ones are unharmed: they finish their requests
    for client in busy:
        await client.send(b"defghij")
        assert (await client.response()).body == b"OK"
        await client.aclose()
    assert topic_depth(daemon, "t") == 4
    assert (await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")).body == b"OK"


class SlowAuthServer:
    """An auth server on loopback that holds each query until ``release`` is set, then grants all."""

    def __init__(self) -> None:
        self.queries: list[str] = []
        self.release = trio.Event()
        self.port = 0

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        self.queries.append(request.split(b"secret=")[1].split(b"&")[0].decode())
        await self.release.wait()
        body = json.dumps({"ttl": 60, "authorizations": [
            {"topic": ".*", "channels": [".*"], "permissions": ["publish", "subscribe"]}]}).encode()
        try:
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        except trio.BrokenResourceError:  # the daemon gave up on this query
            pass
        await stream.aclose()


def authed_pub(secret: str) -> bytes:
    return (b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Length: 5\r\n\r\nhello" % secret.encode())


async def test_requests_waiting_on_a_silent_auth_server_make_room_for_ping(tmp_path, monkeypatch):
    """At the cap, the request that has waited longest (and at least BODY_EVICTION_WAIT) on the
    auth server gets a 503 and is closed: 500 of them held every slot, /ping got 503 for 30 s.
    The request that shared its query asks again."""
    monkeypatch.setattr(http_server, "DEFAULT_LIMITS", dataclasses.replace(http_server.DEFAULT_LIMITS,
                                                                           max_connections=4))
    monkeypatch.setattr(http_server, "BODY_EVICTION_WAIT", 0.2)
    server = SlowAuthServer()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path, http_address="127.0.0.1:0", http_client_request_timeout=60,
                                auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            port = http_port(nsqd)
            waiting = []
            for secret in ("s0", "s0", "s1", "s2"):  # the second shares the first one's query
                client = await Raw.open(port)
                await client.send(authed_pub(secret))
                waiting.append(client)
                await trio.sleep(0.05)
            await trio.sleep(0.3)
            assert server.queries == ["s0", "s1", "s2"]
            with structlog.testing.capture_logs() as logs:
                assert (await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")).body == b"OK"
            json_error(await waiting[0].response(), 503, "TOO_MANY_CONNECTIONS")
            assert await waiting[0].closed()
            assert any("waiting on another server" in entry["event"] for entry in logs)
            await trio.sleep(0.1)
            assert server.queries == ["s0", "s1", "s2", "s0"]
            server.release.set()  # the others are answered as usual, and publish
            for client in waiting[1:]:
                assert (await client.response()).body == b"OK"
                await client.aclose()
            assert topic_depth(nsqd, "t") == 3
            nursery.cancel_scope.cancel()


async def test_requests_that_need_the_same_auth_answer_share_one_query(tmp_path):
    """20 concurrent publishes with one secret asked the auth server 20 times; now once."""
    server = SlowAuthServer()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path, http_address="127.0.0.1:0",
                                auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            port = http_port(nsqd)
            clients = [await Raw.open(port) for _ in range(20)]
            for client in clients:
                await client.send(authed_pub("shared"))
            await trio.sleep(0.3)
            assert server.queries == ["shared"]
            server.release.set()
            for client in clients:
                assert (await client.response()).body == b"OK"
                await client.aclose()
            assert topic_depth(nsqd, "t") == 20 and server.queries == ["shared"]
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("daemon", [{"max_connections": 4}], indirect=True)
async def test_ping_answers_under_a_flood_of_idle_connections(daemon):
    """At the cap the oldest idle connections are closed to make room, so /ping stays reachable."""
    port = http_port(daemon)
    flood = [await Raw.open(port) for _ in range(40)]
    keep_alive = await Raw.open(port)
    await keep_alive.send(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await keep_alive.response()).body == b"OK"
    for _ in range(5):
        assert (await exchange(port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")).body == b"OK"
    # the flood was closed, oldest first and without a word; at most 4 connections stayed open
    assert [await client.closed(timeout=1) for client in flood[:36]] == [True] * 36


# ------------------------------------------------------- HTTP/1.1 features


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(daemon):
    client = await Raw.open(http_port(daemon))
    await client.send(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                      b"POST /mpub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\na\nb\n"
                      b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"GET /stats?format=json&topic=t HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await client.response()).body == b"OK"
    assert (await client.response()).body == b"OK"
    assert (await client.response()).body == b"OK"
    json_error(await client.response(), 404, "NOT_FOUND")
    stats = await client.response()
    assert stats.json()["topics"][0]["depth"] == 3
    # the same connection serves on, until the client says close
    await client.send(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    response = await client.response()
    assert (response.body, response.headers["connection"]) == (b"OK", "close")
    assert await client.closed()


PUB_T = b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
PING = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("pieces", [
    [PUB_T + b"\r\n" + PING],                       # in the same write
    [PUB_T + b"\r\n", PING],                        # then the next request on its own
    [PUB_T, b"\n\n", b"\r\n" + PING],              # four, in pieces
    [PUB_T + b"\r", b"\n\r", b"\n" + PING],
])
async def test_up_to_four_line_ends_after_a_post_body_are_skipped_as_go_does(daemon, pieces):
    """Old clients end a POST body with CRLF; Go's server skips up to 4 such bytes (RFC 9112 2.2)."""
    client = await Raw.open(http_port(daemon))
    for piece in pieces:
        await client.send(piece)
        await trio.sleep(0.05)
    assert (await client.response()).body == b"OK"
    assert (await client.response()).body == b"OK"
    assert topic_depth(daemon, "t") == 1
    await client.send(PUB_T + b"\r\n" + PUB_T)  # again on the same connection
    assert (await client.response()).body == b"OK"
    assert (await client.response()).body == b"OK"
    assert topic_depth(daemon, "t") == 3
    await client.aclose()


@pytest.mark.parametrize("data", [
    PUB_T + b"\r\n\r\n\r\n" + PING,  # more than four
    PING + b"\r\n" + PING,            # after a request that is not a POST
])
async def test_other_line_ends_before_a_request_line_are_a_bad_request(daemon, data):
    client = await Raw.open(http_port(daemon))
    await client.send(data)
    assert (await client.response()).body == b"OK"
    json_error(await client.response(), 400, "BAD_REQUEST")
    assert await client.closed()


async def test_targets_are_routed_on_their_decoded_path(daemon):
    """As Go's router: percent-escapes decoded, an absolute-form target routed on its path."""
    client = await Raw.open(http_port(daemon))
    await client.send(b"GET /p%69ng HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"POST http://127.0.0.1:4151/pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx"
                      b"GET http://x HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"GET * HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await client.response()).body == b"OK"
    assert (await client.response()).body == b"OK"
    json_error(await client.response(), 404, "NOT_FOUND")
    json_error(await client.response(), 404, "NOT_FOUND")  # (OPTIONS * is the server's: see below)
    assert topic_depth(daemon, "t") == 1


async def test_http_1_0_is_answered_and_closed(daemon):
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /pub?topic=t HTTP/1.0\r\nContent-Length: 3\r\n\r\nold")
    response = await client.response()
    assert response.body == b"OK"
    assert "connection" not in response.headers   # Go writes it to HTTP/1.1 peers only
    assert await client.closed()
    assert topic_depth(daemon, "t") == 1


async def test_http_1_0_keep_alive_is_kept_as_gos(daemon):
    """ab -k's requests: HTTP/1.0 asking for keep-alive (Go keeps such a connection when the answer
    has a length, and says so); pipelined ones are answered in turn."""
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /pub?topic=t HTTP/1.0\r\nConnection: Keep-Alive\r\nContent-Length: 3\r\n\r\none"
                      b"GET /nope HTTP/1.0\r\nConnection: close, keep-alive\r\n\r\n")
    with trio.fail_after(5):
        while not client.buf.startswith(b"HTTP/1.0 200 OK\r\n"):
            assert await client._fill(), bytes(client.buf)
    first = await client.response()
    assert first.body == b"OK" and first.headers["connection"] == "keep-alive"
    second = await client.response()
    assert second.status == 404 and second.headers["connection"] == "keep-alive"
    await client.send(b"POST /pub?topic=t HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\n")
    await client.send(b"two\r\n\r\nGET /ping HTTP/1.0\r\n\r\n")  # stray line ends after a POST body too
    assert (await client.response()).body == b"OK"
    last = await client.response()  # no keep-alive asked: answered and closed, as before
    assert last.body == b"OK" and "connection" not in last.headers
    assert await client.closed()
    assert topic_depth(daemon, "t") == 2


async def test_http_1_0_keep_alive_closes_after_an_answer_that_must(daemon):
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /pub HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\nabc")
    response = await client.response()
    assert response.status == 400 and response.headers["connection"] == "keep-alive"  # a normal answer
    await client.send(b"POST /pub?topic=t HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 9999999999\r\n\r\n")
    refused = await client.response()
    assert refused.status == 413 and "connection" not in refused.headers
    assert await client.closed()


@pytest.mark.parametrize("head", [
    b"GET ping HTTP/1.1\r\nHost: x\r\n\r\n",            # neither a path, * nor an absolute URI
    b"GET 1http://x/ping HTTP/1.1\r\nHost: x\r\n\r\n",   # a scheme starts with a letter
    b"GET /ping HTTP/1.1\r\nHost: a b\r\n\r\n",          # Go's httpguts.ValidHostHeader
    b"GET /ping HTTP/1.1\r\nHost: a/b\r\n\r\n",
    b"GET /ping HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",  # too many Host headers
])
async def test_what_gos_server_refuses_before_routing_is_a_bad_request(daemon, head):
    client = await Raw.open(http_port(daemon))
    await client.send(head)
    json_error(await client.response(), 400, "BAD_REQUEST")
    assert await client.closed()


async def test_hosts_and_targets_gos_server_takes(daemon):
    client = await Raw.open(http_port(daemon))
    await client.send(b"GET /ping HTTP/1.1\r\nHost: \r\n\r\n"
                      b"GET /ping HTTP/1.1\r\nHost: [::1]:4151\r\n\r\n"
                      b"GET ping:x HTTP/1.1\r\nHost: x\r\n\r\n")   # an opaque URI: no path to route
    assert (await client.response()).body == b"OK"
    assert (await client.response()).body == b"OK"
    json_error(await client.response(), 404, "NOT_FOUND")


async def test_head_gets_the_headers_without_a_body(daemon):
    client = await Raw.open(http_port(daemon))
    await client.send(b"HEAD /ping HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await client.response(to_head=True)
    assert (head.status, head.headers["allow"], head.body) == (405, "GET, OPTIONS", b"")
    assert int(head.headers["content-length"]) > 0
    assert (await client.response()).body == b"OK"


async def test_a_head_request_the_server_refuses_gets_its_error_without_a_body(daemon):
    """The refusal's JSON body was handed to h11, which refuses a body for a HEAD: the connection
    failed with a traceback and the client got nothing."""
    cases = [
        (b"HEAD /%zz HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"HEAD /ping HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"HEAD ping HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"HEAD /ping HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 15_000 + b"\r\nY: " + b"b" * 2_000 + b"\r\n\r\n", 431),
    ]
    with structlog.testing.capture_logs() as logs:
        for request, status in cases:
            client = await Raw.open(http_port(daemon))
            await client.send(request)
            head = await client.response(to_head=True)
            assert (head.status, head.headers["connection"]) == (status, "close")
            assert int(head.headers["content-length"]) > 0
            assert await client.closed()  # and nothing after the head
    assert not [entry for entry in logs if entry["log_level"] == "error"]


async def test_expect_100_continue_is_answered_before_the_body_is_sent(daemon):
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nExpect: 100-continue\r\n\r\n")
    assert await head_bytes(client) == b"HTTP/1.1 100 Continue\r\n\r\n"  # as Go's: the status line alone
    interim = await client.response()
    assert (interim.status, interim.body) == (100, b"")
    await client.send(b"curled")
    assert (await client.response()).body == b"OK"
    # too big by Content-Length: refused at once, no 100, so the client never sends the body
    await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 65\r\nExpect: 100-continue\r\n\r\n")
    assert (await head_bytes(client)).startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n")  # Go's words
    json_error(await client.response(), 413, "MSG_TOO_BIG")
    assert await client.closed()
    assert topic_depth(daemon, "t") == 1


async def head_bytes(client: Raw) -> bytes:
    """The next response's head as it came, left in the client's buffer."""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in client.buf:
            assert await client._fill(), "connection closed"
    return bytes(client.buf).partition(b"\r\n\r\n")[0] + b"\r\n\r\n"


async def test_chunked_mpub_in_pieces(daemon):
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /mpub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    for piece in (b"one\n", b"two\nthr", b"ee\n"):
        await trio.sleep(0.02)
        await client.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    await client.send(b"0\r\n\r\n")
    assert (await client.response()).body == b"OK"
    assert topic_depth(daemon, "t") == 3
    # over --max-body-size while chunked: 413 without reading the rest
    await client.send(b"POST /mpub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      + b"100\r\n" + b"x\n" * 128 + b"\r\n" + b"10\r\n" + b"y" * 16 + b"\r\n")
    json_error(await client.response(), 413, "BODY_TOO_BIG")
    assert await client.closed()
    assert topic_depth(daemon, "t") == 3


async def test_unread_body_closes_after_the_answer(daemon):
    """/topic/create ignores its body; a body still on its way means the connection cannot be reused."""
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /topic/create?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}")
    response = await client.response()
    assert (response.status, response.headers["connection"]) == (200, "close")
    await client.send(b"x" * 98)  # the rest is drained, not answered with a reset
    assert await client.closed()
    # a body that came with the head is skipped and the connection kept
    client = await Raw.open(http_port(daemon))
    await client.send(b"POST /topic/create?topic=u HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
                      b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert "connection" not in (await client.response()).headers
    assert (await client.response()).body == b"OK"
    assert sorted(daemon.topics) == ["t", "u"]


# -------------------------------------------------------------- plumbing


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    ca = trustme.CA()
    folder = tmp_path_factory.mktemp("https")
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(folder / "cert.pem")
    cert.private_key_pem.write_to_path(folder / "key.pem")
    return {"ca": ca, "cert": str(folder / "cert.pem"), "key": str(folder / "key.pem")}


async def test_https_keep_alive_and_a_plain_client_on_the_https_port(tmp_path, certs):
    async with running_nsqd(tmp_path, https_address="127.0.0.1:0", tls_cert=certs["cert"],
                            tls_key=certs["key"]) as nsqd:
        port = nsqd.https_addresses[0][1]
        context = ssl.create_default_context()
        certs["ca"].configure_trust(context)
        stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), context, server_hostname="127.0.0.1")
        client = Raw(stream)
        await client.send(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nsecret")
        assert (await client.response()).body == b"OK"
        await client.send(b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.response()).json()["tcp_port"] == tcp_port(nsqd)
        await client.aclose()
        # plain HTTP on the HTTPS port: Go's plain answer, closed, and the server serves on
        with structlog.testing.capture_logs() as logs:
            plain = await Raw.open(port)
            await plain.send(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            with trio.fail_after(5):
                while await plain._fill():
                    pass
            assert bytes(plain.buf) == http_server.PLAIN_HTTP_ON_HTTPS
            garbage = await Raw.open(port)  # anything else: closed without a word
            await garbage.send(b"\x00\x01\x02\x03\x04\x05 not tls")
            assert await garbage.closed()
        assert not [entry for entry in logs if entry["log_level"] in ("error", "critical")]
        assert topic_depth(nsqd, "t") == 1


class FlakyListener(trio.abc.Listener):
    """A real listener whose first accepts fail as they do when descriptors run out."""

    def __init__(self, inner: trio.SocketListener, failures: int) -> None:
        self.inner = inner
        self.socket = inner.socket
        self.failures = failures

    async def accept(self):
        if self.failures:
            self.failures -= 1
            await trio.sleep(0)
            raise OSError(24, "Too many open files")
        return await self.inner.accept()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_accept_loop_survives_emfile():
    async def app(request: http_server.Request) -> http_server.Response:
        return http_server.Response(200, [], b"served")

    listener = await http_server.open_listener("127.0.0.1:0")
    port = listener.socket.getsockname()[1]
    server = http_server.HTTPServer(app)
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, FlakyListener(listener, 3))
            response = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            nursery.cancel_scope.cancel()
    assert (response.status, response.body) == (200, b"served")
    assert [entry["event"] for entry in logs if entry["log_level"] == "error"] == [
        "HTTP accept failed, retrying every 0.1 s"]


async def test_a_failing_app_is_logged_with_its_traceback_and_the_server_serves_on():
    calls = []

    async def app(request: http_server.Request) -> http_server.Response:
        calls.append(request.path)
        if request.path == "/bug":
            raise ZeroDivisionError("a bug")
        return http_server.Response(200, [], json.dumps({"path": request.path}).encode())

    listener = await http_server.open_listener("127.0.0.1:0")
    port = listener.socket.getsockname()[1]
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(http_server.HTTPServer(app).serve, listener)
            client = await Raw.open(port)
            await client.send(b"GET /bug HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await client.closed()
            assert (await exchange(port, b"GET /fine HTTP/1.1\r\nHost: x\r\n\r\n")).json() == {"path": "/fine"}
            nursery.cancel_scope.cancel()
    failure = next(entry for entry in logs if entry["event"] == "HTTP connection failed")
    assert failure["log_level"] == "error" and failure["exc_info"] is True
    assert calls == ["/bug", "/fine"]


async def test_an_expectation_other_than_100_continue_is_refused_with_417_as_go_does(daemon):
    port = http_port(daemon)
    response = await exchange(port, b"POST /pub?topic=expect HTTP/1.1\r\nHost: x\r\nExpect: foo\r\n"
                                    b"Content-Length: 3\r\n\r\nabc")
    assert (response.status, response.body) == (417, b"")
    assert response.headers["connection"] == "close"
    assert topic_depth(daemon, "expect") == 0  # the handler never ran
    client = await Raw.open(port)
    try:
        # Go looks for the token in the list, in the first Expect header only
        for expect in (b"100-Continue", b"foo, 100-continue", b"100-continue\r\nExpect: foo"):
            await client.send(b"POST /pub?topic=expect HTTP/1.1\r\nHost: x\r\nExpect: %s\r\n"
                              b"Content-Length: 3\r\n\r\nabc" % expect)
            response = await client.response()
            while response.status == 100:
                response = await client.response()
            assert (response.status, response.body) == (200, b"OK")
    finally:
        await client.aclose()
    assert topic_depth(daemon, "expect") == 3


async def test_options_star_asks_about_the_server_and_gets_an_empty_200(daemon):
    client = await Raw.open(http_port(daemon))
    try:
        await client.send(b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        response = await client.response()
        assert (response.status, response.body, response.headers["content-length"]) == (200, b"", "0")
        assert "content-type" not in response.headers
        assert (await client.response()).body == b"OK"  # the connection goes on
    finally:
        await client.aclose()


async def test_a_stop_answers_the_request_being_handled_and_closes_idle_connections_at_once():
    """The daemon's shutdown cancels the server: a request already in the app (a publish that
    was stored, say) is still answered, with ``Connection: close``; a connection waiting for a
    request closes at once; one that takes too long is cut off at STOP_ANSWER_TIME."""
    entered = {"/slow": trio.Event(), "/hang": trio.Event()}

    async def app(request: http_server.Request) -> http_server.Response:
        if request.path in entered:
            entered[request.path].set()
            await trio.sleep(0.3 if request.path == "/slow" else math.inf)
        return http_server.Response(200, [], request.path.encode())

    listener = await http_server.open_listener("127.0.0.1:0")
    port = listener.socket.getsockname()[1]
    clients = {path: await Raw.open(port) for path in ("/idle", "/slow", "/hang")}
    async with trio.open_nursery() as nursery:
        await nursery.start(http_server.HTTPServer(app).serve, listener)
        await clients["/idle"].send(b"GET /idle HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await clients["/idle"].response()).body == b"/idle"  # kept alive, now idle
        for path in entered:
            await clients[path].send(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
            await entered[path].wait()
        stopped_at = trio.current_time()
        nursery.cancel_scope.cancel()
    took = trio.current_time() - stopped_at
    assert http_server.STOP_ANSWER_TIME <= took < http_server.STOP_ANSWER_TIME + 0.5  # the hung one, cut off
    assert await clients["/idle"].closed()
    answer = await clients["/slow"].response()
    assert (answer.status, answer.body, answer.headers["connection"]) == (200, b"/slow", "close")
    assert await clients["/slow"].closed()
    assert await clients["/hang"].closed()
    for client in clients.values():
        await client.aclose()


# ----------------------------------------------- closing to make room, and stopping, when a send is stuck
def _jam(connection) -> None:
    """Fill the server's side of a connection whose client reads nothing: its next send waits."""
    sock = connection.raw_stream.socket
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    try:
        while True:
            os.write(sock.fileno(), b"x" * 1024)
    except BlockingIOError:
        pass


def _non_reader(port: int) -> socket.socket:
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    client.connect(("127.0.0.1", port))
    return client


async def _serving(app, limits):
    listener = await http_server.open_listener("127.0.0.1:0")
    return http_server.HTTPServer(app, limits), listener, listener.socket.getsockname()[1]


async def _ok_or_wait(request: http_server.Request) -> http_server.Response:
    if request.path == "/wait":
        with request.waiting_elsewhere():
            await trio.sleep_forever()
    return http_server.Response(200, [], b"ok")


async def test_a_stop_also_ends_a_connection_closed_to_make_room_that_is_still_sending():
    """A connection closed at the cap left the counted set but still sent its 503, which a client
    that does not read held for send_timeout: a stop waited that long for it, not a second."""
    server, listener, port = await _serving(_ok_or_wait, http_server.Limits(max_connections=1, send_timeout=8))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listener)
        first = _non_reader(port)
        first.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        await trio.sleep(0.2)
        (connection,) = server._connections
        _jam(connection)
        await trio.sleep(http_server.BODY_EVICTION_WAIT + 0.2)
        _jam(connection)  # still full when its 503 is written
        second = socket.create_connection(("127.0.0.1", port))  # makes room: the first is closed
        await trio.sleep(0.3)
        assert connection not in server._connections and connection in server._running
        stopped_at = trio.current_time()
        nursery.cancel_scope.cancel()
    assert trio.current_time() - stopped_at < http_server.STOP_ANSWER_TIME + 0.5
    first.close()
    second.close()


async def test_a_connection_closed_to_make_room_while_its_408_is_stuck_closes_at_once():
    """Its scope was over (the head deadline had passed), so closing it to make room did nothing:
    uncounted, it kept its socket and task until send_timeout, above the cap."""
    server, listener, port = await _serving(_ok_or_wait, http_server.Limits(
        max_connections=1, head_timeout=0.5, idle_timeout=0.5, send_timeout=6))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listener)
        first = _non_reader(port)
        first.sendall(b"GET / HTTP/1.1\r\n")  # a head that never ends: 408 at head_timeout
        await trio.sleep(0.1)
        (connection,) = server._connections
        for _ in range(8):  # keep the send side full while the 408 is due
            _jam(connection)
            await trio.sleep(0.1)
        await trio.sleep(http_server.BODY_EVICTION_WAIT + 0.1)
        _jam(connection)
        second = socket.create_connection(("127.0.0.1", port))
        with trio.fail_after(http_server.LINGER_TIMEOUT + 1):  # not send_timeout
            while connection.raw_stream.socket.fileno() >= 0:
                await trio.sleep(0.02)
        assert len(server._connections) <= 1
        nursery.cancel_scope.cancel()
    first.close()
    second.close()


async def test_a_connection_answering_a_bad_head_is_closed_to_make_room_once():
    """It waits for a head and, its 400 stuck, for the client too: two newcomers in one accept
    burst closed it twice, and the server went over its cap."""
    server, listener, port = await _serving(_ok_or_wait, http_server.Limits(max_connections=1, send_timeout=20))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listener)
        first = _non_reader(port)
        await trio.sleep(0.1)
        (connection,) = server._connections
        for _ in range(5):
            _jam(connection)
            await trio.sleep(0.05)
        first.sendall(b"GET /%zz HTTP/1.1\r\nHost: x\r\n\r\n")  # answered 400 while waiting for a head
        for _ in range(24):
            _jam(connection)
            await trio.sleep(0.05)
        newcomers = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.1)  # both in the backlog before the server looks: one burst
        await trio.sleep(0.2)
        assert len(server._connections) <= 1
        nursery.cancel_scope.cancel()
    for client in [first, *newcomers]:
        client.close()
