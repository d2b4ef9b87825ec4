"""Test support: run the real daemon in-process and talk NSQ V2 to it over TCP."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import trio

from nsqd.nsqd import NSQD
from nsqd.options import Options

FRAME_RESPONSE, FRAME_ERROR, FRAME_MESSAGE = 0, 1, 2


def make_options(data_path, **overrides) -> Options:
    fields = dict(tcp_address="127.0.0.1:0", http_address="", https_address="", amqp_address="", amqps_address="",
                  data_path=str(data_path), shutdown_grace=0.0)
    fields.update(overrides)
    return Options(**fields)


@asynccontextmanager
async def running_nsqd(data_path, **overrides):
    """The daemon serving on ephemeral loopback ports for the duration of the block."""
    nsqd = NSQD(make_options(data_path, **overrides))
    async with trio.open_nursery() as nursery:
        await nursery.start(nsqd.serve)
        try:
            yield nsqd
        finally:
            nsqd.request_shutdown()


def tcp_port(nsqd: NSQD) -> int:
    return nsqd.tcp_addresses[0][1]


class Message:
    def __init__(self, data: bytes) -> None:
        self.timestamp, self.attempts = struct.unpack_from(">qH", data, 0)
        self.id = data[10:26]
        self.body = data[26:]


class NSQConnection:
    """A minimal, strict NSQ V2 client for tests: every frame is checked."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = bytearray()
        self.heartbeats = 0

    @classmethod
    async def open(cls, port: int, magic: bytes = b"  V2") -> "NSQConnection":
        conn = cls(await trio.open_tcp_stream("127.0.0.1", port))
        if magic:
            await conn.stream.send_all(magic)
        return conn

    async def close(self) -> None:
        await self.stream.aclose()

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def command(self, line: str | bytes, body: bytes | None = None) -> None:
        if isinstance(line, str):
            line = line.encode()
        data = line + b"\n"
        if body is not None:
            data += struct.pack(">i", len(body)) + body
        await self.send(data)

    async def read_frame(self, timeout: float = 5) -> tuple[int, bytes]:
        with trio.fail_after(timeout):
            while True:
                if len(self._buf) >= 8:
                    size, kind = struct.unpack_from(">ii", self._buf, 0)
                    if len(self._buf) >= 4 + size:
                        data = bytes(self._buf[8:4 + size])
                        del self._buf[:4 + size]
                        return kind, data
                chunk = await self.stream.receive_some(65536)
                if not chunk:
                    raise EOFError("connection closed by the daemon")
                self._buf += chunk

    async def read_non_heartbeat(self, timeout: float = 5) -> tuple[int, bytes]:
        while True:
            kind, data = await self.read_frame(timeout)
            if kind == FRAME_RESPONSE and data == b"_heartbeat_":
                self.heartbeats += 1
                await self.command("NOP")
                continue
            return kind, data

    async def expect_response(self, expected: bytes = b"OK") -> None:
        kind, data = await self.read_non_heartbeat()
        assert (kind, data) == (FRAME_RESPONSE, expected)

    async def expect_error(self, prefix: str) -> bytes:
        kind, data = await self.read_non_heartbeat()
        assert kind == FRAME_ERROR, (kind, data)
        assert data.startswith(prefix.encode()), data
        return data

    async def read_message(self, timeout: float = 5) -> Message:
        kind, data = await self.read_non_heartbeat(timeout)
        assert kind == FRAME_MESSAGE, (kind, data)
        return Message(data)

    async def expect_closed(self, timeout: float = 5) -> None:
        with trio.fail_after(timeout):
            while True:
                try:
                    chunk = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return
                if not chunk:
                    return

    # ------------------------------------------------------------ verbs
    async def identify(self, **fields) -> dict | bytes:
        await self.command("IDENTIFY", json.dumps(fields).encode())
        kind, data = await self.read_non_heartbeat()
        assert kind == FRAME_RESPONSE, data
        return json.loads(data) if data.startswith(b"{") else data

    async def sub(self, topic: str, channel: str) -> None:
        await self.command(f"SUB {topic} {channel}")
        await self.expect_response()

    async def pub(self, topic: str, body: bytes) -> None:
        await self.command(f"PUB {topic}", body)
        await self.expect_response()

    async def mpub(self, topic: str, bodies: list[bytes]) -> None:
        await self.command(f"MPUB {topic}", mpub_body(bodies))
        await self.expect_response()

    async def dpub(self, topic: str, delay_ms: int, body: bytes) -> None:
        await self.command(f"DPUB {topic} {delay_ms}", body)
        await self.expect_response()


async def consume_distinct(port: int, topic: str, channel: str, count: int, *, rdy: int = 300,
                           timeout: float = 30) -> set[bytes]:
    """Subscribe on a new connection and FIN until ``count`` distinct bodies arrived; returns them."""
    conn = await NSQConnection.open(port)
    await conn.sub(topic, channel)
    await conn.command(f"RDY {rdy}")
    got: set[bytes] = set()
    with trio.fail_after(timeout):
        while len(got) < count:
            msg = await conn.read_message()
            got.add(msg.body)
            await conn.command(b"FIN " + msg.id)
    return got


async def consume_until_quiet(port: int, topic: str, channel: str = "c", *, rdy: int = 1000,
                              idle: float = 1.0) -> list[bytes]:
    """Subscribe on a new connection and FIN everything, in the order delivered, until nothing
    comes for ``idle`` seconds; the bodies."""
    conn = await NSQConnection.open(port)
    await conn.sub(topic, channel)
    await conn.command(f"RDY {rdy}")
    got = []
    while True:
        try:
            msg = await conn.read_message(timeout=idle)
        except trio.TooSlowError:
            await conn.close()
            return got
        got.append(msg.body)
        await conn.command(b"FIN " + msg.id)


def mpub_body(bodies: list[bytes]) -> bytes:
    return struct.pack(">i", len(bodies)) + b"".join(struct.pack(">i", len(b)) + b for b in bodies)


def _ports_outside_ephemeral_range() -> range:
    """Ports no outgoing connection is given: a port the kernel hands out for ``bind(0)`` is in the
    ephemeral range, where any ``connect`` (this suite's own, or a poll of the port itself, which
    can connect to itself) may take it before the daemon we start listens there."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(10000, low) if low - 10000 >= 4096 else range(high + 1, 65536)


_PORTS = _ports_outside_ephemeral_range()
_next_port = _PORTS.start + (os.getpid() * 7919) % len(_PORTS)


def free_port() -> int:
    """A port for a daemon this suite starts: free now, outside the ephemeral range, and never the
    same twice in one test process."""
    global _next_port
    for _ in range(len(_PORTS)):
        port, _next_port = _next_port, _next_port + 1
        if _next_port >= _PORTS.stop:
            _next_port = _PORTS.start
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free port outside the ephemeral range")


#: daemons started as subprocesses by the test running now: any still alive after it are killed
#: (a test that fails half-way leaves no daemon behind; see conftest.py)
SPAWNED: list[subprocess.Popen] = []


def wait_for_ports(proc: subprocess.Popen, ports, describe_exit, timeout: float = 20) -> None:
    """Wait until a daemon subprocess accepts connections on every port (127.0.0.1); if it exits
    first, fail with ``describe_exit()`` (its log); past ``timeout``, TimeoutError."""
    deadline = time.monotonic() + timeout
    for port in ports:
        while True:
            assert proc.poll() is None, describe_exit()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise TimeoutError("daemon did not start") from None
                time.sleep(0.05)


class Daemon:
    """``python -m nsqd`` as a real subprocess."""

    def __init__(self, data_path, *args):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{self.port}", "--http-address=", "--https-address=",
             "--amqp-address=",
             "--shutdown-grace=0",
             f"--data-path={data_path}", "--log-level=warn", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        SPAWNED.append(self.proc)
        #: the ports to wait for: TCP, and HTTP and AMQP when given (their listeners come up after TCP's)
        self.ready_ports = [self.port]
        for flag in ("--http-address=", "--amqp-address="):
            given = [arg[len(flag):] for arg in args if arg.startswith(flag)]
            if given and given[-1]:
                self.ready_ports.append(int(given[-1].rpartition(":")[2]))

    async def wait_ready(self) -> None:
        with trio.fail_after(20):
            for port in self.ready_ports:
                while True:
                    assert self.proc.poll() is None, self.proc.stderr.read().decode()
                    try:
                        stream = await trio.open_tcp_stream("127.0.0.1", port)
                    except OSError:
                        await trio.sleep(0.05)
                        continue
                    await stream.aclose()
                    break

    def wait_ready_sync(self, timeout: float = 20) -> None:
        wait_for_ports(self.proc, self.ready_ports, lambda: self.proc.stderr.read().decode(), timeout)

    async def stop(self, sig=signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return await trio.to_thread.run_sync(self.proc.wait, 30)
