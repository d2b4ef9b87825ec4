"""The limits of docs/limits.md over real sockets: connections, command deadlines,
memory of partial bodies, and floods that must not hold the event loop."""

from __future__ import annotations

import json
import resource
import socket
import ssl
import struct
import subprocess
import sys
import time
import zlib

import pytest
import snappy
import trio

from amqp_gateway.errors import RESOURCE_LIMIT_EXCEEDED
from nsqd.options import Options

from .conftest import HTTPClient, http_port
from .support import FRAME_ERROR, FRAME_RESPONSE, NSQConnection, free_port, running_nsqd, tcp_port
from .test_amqp_raw import Client
from .test_parity import ca, certs  # noqa: F401  (fixtures)


# ------------------------------------------------------------ connections
@pytest.mark.parametrize("soft,expected", [
    (256, 128),          # at most half stays in reserve
    (1024, 768),         # at least 256 descriptors stay in reserve
    (65536, 49152),      # a quarter stays in reserve
    (resource.RLIM_INFINITY, 786432),  # "unlimited" counts as 2**20
])
def test_max_connections_default_follows_the_descriptor_limit(monkeypatch, soft, expected):
    monkeypatch.setattr("resource.getrlimit", lambda which: (soft, resource.RLIM_INFINITY))
    assert Options().max_connections == expected


async def test_excess_tcp_clients_get_e_too_many_connections(tmp_path):
    async with running_nsqd(tmp_path, max_connections=2) as nsqd:
        first = await NSQConnection.open(tcp_port(nsqd))
        second = await NSQConnection.open(tcp_port(nsqd))
        await first.pub("t", b"a")
        await second.pub("t", b"b")
        third = await NSQConnection.open(tcp_port(nsqd))
        assert await third.read_frame() == (FRAME_ERROR, b"E_TOO_MANY_CONNECTIONS max connections (2) reached")
        await third.expect_closed()
        await first.close()
        with trio.fail_after(5):
            while nsqd.connection_slots.used > 1:
                await trio.sleep(0.01)
        again = await NSQConnection.open(tcp_port(nsqd))
        await again.pub("t", b"c")  # a slot freed is a slot taken
        assert nsqd.topics["t"].message_count == 3


async def test_excess_amqp_clients_are_closed_with_resource_limit_exceeded(tmp_path):
    async with running_nsqd(tmp_path, amqp_address="127.0.0.1:0", max_connections=2) as nsqd:
        port = nsqd.amqp_addresses[0][1]
        nsq = await NSQConnection.open(tcp_port(nsqd))  # TCP and AMQP share the budget
        amqp = await Client.connect(port)
        assert amqp.conn.open_received and not amqp.conn.finished
        refused = await Client.connect(port, begin=False)
        await refused.until(lambda: refused.conn.close_received)
        closed = [e for e in refused.events if type(e).__name__ == "ConnectionClosed"]
        error = closed[0].error
        assert (error.condition, error.description) == (RESOURCE_LIMIT_EXCEEDED, "max connections (2) reached")
        refused_tcp = await NSQConnection.open(tcp_port(nsqd))
        assert (await refused_tcp.read_frame())[1] == b"E_TOO_MANY_CONNECTIONS max connections (2) reached"
        await nsq.pub("t", b"still served")


def _limited_daemon(tmp_path, nofile: int):
    """``python -m nsqd`` with a descriptor limit, logging to a file."""
    tcp, http = free_port(), free_port()
    log = open(tmp_path / "nsqd.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{tcp}", f"--http-address=127.0.0.1:{http}",
         "--amqp-address=", "--shutdown-grace=0", f"--data-path={tmp_path / 'data'}", "--log-level=error"],
        stdout=subprocess.DEVNULL, stderr=log,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    return proc, tcp, http


def _wait_listening(port: int, proc) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("daemon did not start")


async def test_http_stays_reachable_under_a_flood_of_idle_tcp_sockets(tmp_path):
    proc, tcp, http = _limited_daemon(tmp_path, 1024)
    sockets = []
    try:
        _wait_listening(http, proc)
        for _ in range(1100):  # more than the daemon has descriptors
            sockets.append(socket.create_connection(("127.0.0.1", tcp)))
        client = HTTPClient(http)
        with trio.fail_after(5):
            response = await client.get("/ping")
        assert (response.status, response.body) == (200, b"OK")
        # the 768 slots are taken by the first sockets; the last ones were refused
        last = sockets[-1]
        last.settimeout(5)
        data = b""
        while len(data) < 8 or len(data) < 4 + struct.unpack(">i", data[:4])[0]:
            data += last.recv(4096)
        assert data[8:] == b"E_TOO_MANY_CONNECTIONS max connections (768) reached"
        assert proc.poll() is None
    finally:
        for s in sockets:
            s.close()
        proc.terminate()
        proc.wait(30)


# --------------------------------------------------------------- deadlines
async def test_a_trickled_body_is_cut_at_the_command_deadline(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.identify(heartbeat_interval=1000)  # a whole command now has 2 s
        start = trio.current_time()
        await conn.send(b"MPUB t\n" + struct.pack(">i", 1000) + b"x" * 10)
        with trio.fail_after(6):
            while True:  # one byte every 0.3 s keeps a per-byte deadline alive forever
                await trio.sleep(0.3)
                try:
                    await conn.send(b"x")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                if not nsqd.clients:
                    break
        await conn.expect_closed()
        assert 1.9 <= trio.current_time() - start < 4
        assert not nsqd.clients


async def test_with_heartbeats_disabled_idle_is_fine_but_a_started_command_has_client_timeout(tmp_path):
    async with running_nsqd(tmp_path, client_timeout=1.0) as nsqd:
        idle = await NSQConnection.open(tcp_port(nsqd))
        await idle.identify(heartbeat_interval=-1)
        partial = await NSQConnection.open(tcp_port(nsqd))
        await partial.identify(heartbeat_interval=-1)
        await partial.send(b"PUB t\n" + struct.pack(">i", 100) + b"half")
        start = trio.current_time()
        await partial.expect_closed(timeout=5)
        assert 0.9 <= trio.current_time() - start < 3
        await trio.sleep(1.0)
        await idle.pub("t", b"still here")  # 2 s idle without heartbeats: as in nsqd, no deadline


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_partial_bodies_are_freed_when_the_deadline_cuts_them(tmp_path):
    proc, tcp, _ = _limited_daemon(tmp_path, 4096)
    sockets = []
    try:
        _wait_listening(tcp, proc)
        await trio.sleep(0.5)
        base = _rss_mb(proc.pid)
        identify = json.dumps({"heartbeat_interval": 1000}).encode()
        for _ in range(20):  # 20 MPUBs of 5 MiB, 4 MiB of each sent
            s = socket.create_connection(("127.0.0.1", tcp))
            s.sendall(b"  V2IDENTIFY\n" + struct.pack(">i", len(identify)) + identify)
            s.sendall(b"MPUB t\n" + struct.pack(">i", 5 * 1024 * 1024) + b"\0" * (4 * 1024 * 1024))
            sockets.append(s)
        await trio.sleep(0.5)
        held = _rss_mb(proc.pid)
        assert held - base > 60, (base, held)
        for s in sockets:  # the deadline (2 s) cuts every one of them
            s.settimeout(5)
            while s.recv(65536):
                pass
        await trio.sleep(0.5)
        assert _rss_mb(proc.pid) - base < 30, (base, held, _rss_mb(proc.pid))
    finally:
        for s in sockets:
            s.close()
        proc.terminate()
        proc.wait(30)


# ------------------------------------------------------------------ floods
async def _pings_during(nsqd, flood_done: trio.Event, count: int = 20) -> list[float]:
    http = HTTPClient(http_port(nsqd))
    times = []
    for _ in range(count):
        start = time.perf_counter()
        response = await http.get("/ping")
        times.append(time.perf_counter() - start)
        assert response.status == 200
    assert not flood_done.is_set(), "the flood was over before the pings: nothing was measured"
    return times


def _compressed(kind: str, raw: bytes) -> bytes:
    if kind == "deflate":
        c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
        return c.compress(raw) + c.flush(zlib.Z_SYNC_FLUSH)
    return snappy.StreamCompressor().add_chunk(raw)


class _Decompressed:
    """Reads the frames of a compressed connection."""

    def __init__(self, conn: NSQConnection, kind: str, pending: bytes) -> None:
        self.conn = conn
        self.d = zlib.decompressobj(-zlib.MAX_WBITS) if kind == "deflate" else snappy.StreamDecompressor()
        self.buf = bytearray(self.d.decompress(pending))

    async def frame(self) -> tuple[int, bytes]:
        while len(self.buf) < 8 or len(self.buf) < 4 + struct.unpack_from(">i", self.buf)[0]:
            chunk = await self.conn.stream.receive_some(65536)
            assert chunk, "connection closed"
            self.buf += self.d.decompress(chunk)
        size, kind = struct.unpack_from(">ii", self.buf)
        data = bytes(self.buf[8:4 + size])
        del self.buf[:4 + size]
        return kind, data


async def _compressed_connection(nsqd, kind: str) -> _Decompressed:
    conn = await NSQConnection.open(tcp_port(nsqd))
    await conn.command("IDENTIFY", json.dumps({"feature_negotiation": True, kind: True}).encode())
    kind_, data = await conn.read_frame()
    assert kind_ == FRAME_RESPONSE and json.loads(data)[kind] is True
    reader = _Decompressed(conn, kind, bytes(conn._buf))
    assert await reader.frame() == (FRAME_RESPONSE, b"OK")
    return reader


async def test_a_10_kb_deflated_flood_does_not_delay_ping(tmp_path):
    async with running_nsqd(tmp_path, http_address="127.0.0.1:0") as nsqd:
        reader = await _compressed_connection(nsqd, "deflate")
        flood = _compressed("deflate", b"NOP\n" * (10 * 1024 * 1024 // 4) + b"PUB t\n\0\0\0\x04done")
        assert len(flood) < 11_000  # 10 KB that expand to 10 MB: 2.6 million commands
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            async def publish():
                await reader.conn.send(flood)
                assert await reader.frame() == (FRAME_RESPONSE, b"OK")
                done.set()

            nursery.start_soon(publish)
            times = await _pings_during(nsqd, done)
        assert max(times) < 0.1, sorted(times)
        assert nsqd.topics["t"].message_count == 1


async def test_a_snappy_flood_is_worked_through_in_steps(tmp_path):
    async with running_nsqd(tmp_path, http_address="127.0.0.1:0") as nsqd:
        reader = await _compressed_connection(nsqd, "snappy")
        flood = _compressed("snappy", b"NOP\n" * (2 * 1024 * 1024) + b"PUB t\n\0\0\0\x04done")
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            async def publish():
                await reader.conn.send(flood)
                assert await reader.frame() == (FRAME_RESPONSE, b"OK")
                done.set()

            nursery.start_soon(publish)
            times = await _pings_during(nsqd, done, count=5)
        assert max(times) < 0.1, sorted(times)


@pytest.mark.parametrize("chunk,why", [
    (b"\x00\xff\xff\xff" + b"\0" * 64, "a chunk claiming 16 MiB"),
    (b"\x00\x0a\x00\x00" + b"\0\0\0\0" + b"\xff\xff\xff\xff\x0f" + b"\0", "a block claiming 4 GiB"),
    (b"\x02\x01\x00\x00\x00", "a reserved unskippable chunk"),
])
async def test_a_bad_snappy_chunk_drops_the_connection_before_buffering(tmp_path, chunk, why):
    async with running_nsqd(tmp_path) as nsqd:
        reader = await _compressed_connection(nsqd, "snappy")
        await reader.conn.send(b"\xff\x06\x00\x00sNaPpY" + chunk)
        await reader.conn.expect_closed()
        assert not nsqd.clients, why


@pytest.mark.parametrize("kind", ["snappy", "deflate"])
async def test_a_stream_that_turns_bad_inside_a_body_gets_nsqds_error_for_the_body(tmp_path, kind):
    """Go's read of the body fails and its error is written through the compressed writer, which
    still works; we had closed without a frame. What came before the damage is read first, also
    when both came in one read."""
    async with running_nsqd(tmp_path) as nsqd:
        reader = await _compressed_connection(nsqd, kind)
        head = _compressed(kind, b"PUB t\n" + struct.pack(">i", 100) + b"x" * 10)
        # a chunk with a bad checksum; a deflate block of a type that does not exist
        bad = b"\x01\x18\x00\x00" + b"\0\0\0\0" + b"y" * 20 if kind == "snappy" else b"\xff" * 16
        await reader.conn.send(head + bad)
        assert await reader.frame() == (FRAME_ERROR, b"E_BAD_MESSAGE PUB failed to read message body")
        await reader.conn.expect_closed()

@pytest.mark.parametrize("first,second,error", [
    ("deflate", "deflate", "compression is already enabled"),
    ("snappy", "snappy", "compression is already enabled"),
    ("snappy", "deflate", "compression is already enabled"),
    ("deflate", "tls_v1", "TLS must come first and only once"),
])
async def test_a_stream_is_upgraded_once_so_a_client_cannot_nest_layers(tmp_path, certs, first, second, error):  # noqa: F811
    """A client repeating IDENTIFY nested a layer each time, until the daemon ran out of stack and exited."""
    async with running_nsqd(tmp_path / "d", tls_cert=certs["tls_cert"], tls_key=certs["tls_key"]) as nsqd:
        reader = await _compressed_connection(nsqd, first)
        identify = json.dumps({"feature_negotiation": True, second: True}).encode()
        await reader.conn.send(_compressed(first, b"IDENTIFY\n" + struct.pack(">i", len(identify)) + identify))
        assert await reader.frame() == (FRAME_ERROR, f"E_IDENTIFY_FAILED IDENTIFY failed {error}".encode())
        with trio.fail_after(5):
            while nsqd.clients:
                await trio.sleep(0.01)


async def test_a_flood_of_tiny_commands_over_tls_does_not_delay_ping(tmp_path, certs):  # noqa: F811
    async with running_nsqd(tmp_path / "d", http_address="127.0.0.1:0", tls_cert=certs["tls_cert"],
                            tls_key=certs["tls_key"]) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        resp = await conn.identify(feature_negotiation=True, tls_v1=True)
        assert resp["tls_v1"] is True
        tls = trio.SSLStream(conn.stream, ssl.create_default_context(cafile=certs["ca"]),
                             server_hostname="127.0.0.1")
        await tls.do_handshake()
        conn.stream = tls
        assert await conn.read_frame() == (FRAME_RESPONSE, b"OK")
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            async def publish():
                await conn.send(b"NOP\n" * (1024 * 1024) + b"PUB t\n\0\0\0\x04done")
                assert await conn.read_frame(timeout=60) == (FRAME_RESPONSE, b"OK")
                done.set()

            nursery.start_soon(publish)
            await trio.sleep(0.2)  # the first megabytes are in
            times = await _pings_during(nsqd, done, count=5)
        assert max(times) < 0.1, sorted(times)


async def test_closing_a_connection_never_raises_into_the_nursery_all_connections_share():
    from nsqd.slots import close_stream

    class Stale(trio.abc.AsyncResource):
        async def aclose(self):
            raise trio.ClosedResourceError("another task closed this fd")

    class Buggy(trio.abc.AsyncResource):
        async def aclose(self):
            raise RuntimeError("a bug")

    await close_stream(Stale())
    await close_stream(Buggy(), remote="127.0.0.1:1")


async def test_an_accept_loop_takes_every_connection_waiting_per_wake_up():
    """Trio's accept yields after each connection, and each pass of the scheduler serves every
    busy connection too: with 250 clients pipelining requests, new HTTP clients waited 11-19 s
    in the backlog. An accept now also takes what else is waiting, up to BURST, and what it
    cannot take (none waiting, or a failure) is left to the next accept."""
    from nsqd.accept import BURST, Acceptor

    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    acceptor = Acceptor(listener)
    clients = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(BURST + 5)]
    await trio.sleep(0.1)  # the kernel completed every handshake
    first = await acceptor.accept()
    assert len(first) == BURST
    assert len(await acceptor.accept()) == 5
    with trio.move_on_after(0.2) as waiting:  # none left: it waits, as accept does
        await acceptor.accept()
    assert waiting.cancelled_caught
    for stream in first:  # working streams, each to its own client
        await stream.send_all(b"x")
    assert [await client.receive_some(1) for client in clients[:BURST]] == [b"x"] * BURST
    acceptor.close()
    await listener.aclose()
    for stream in [*first, *clients]:
        await stream.aclose()
