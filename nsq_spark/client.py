"""A small blocking NSQ V2 client over a plain socket.

Executors and the driver run inside Spark's Python workers, which are plain
synchronous processes: a blocking socket with explicit timeouts is all they
need, and it keeps the package free of extra dependencies. Heartbeats are
answered wherever frames are read, so a connection stays alive as long as its
owner reads it now and then.
"""

from __future__ import annotations

import json
import socket
import struct
import time

FRAME_RESPONSE, FRAME_ERROR, FRAME_MESSAGE = 0, 1, 2
HEARTBEAT = b"_heartbeat_"
USER_AGENT = "nsq_spark/0.1"

_HEAD = struct.Struct(">ii")
_SIZE = struct.Struct(">i")
_RECV_SIZE = 1 << 20


class NSQError(Exception):
    """The daemon answered with an error frame, or the connection broke."""


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"nsqd address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def body_command(line: str, body: bytes) -> bytes:
    return line.encode() + b"\n" + _SIZE.pack(len(body)) + body


def mpub_body(bodies: list[bytes]) -> bytes:
    pack = _SIZE.pack
    return b"".join([pack(len(bodies)), *[pack(len(b)) + b for b in bodies]])


class Connection:
    """One NSQ V2 connection: send commands, read frames, answer heartbeats."""

    def __init__(self, address: str, timeout: float = 10.0) -> None:
        self.address = address
        self.timeout = timeout
        try:
            self.sock = socket.create_connection(parse_address(address), timeout=timeout)
        except OSError as exc:
            raise NSQError(f"cannot connect to nsqd at {address}: {exc}") from exc
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self._pos = 0
        self._pending: list[tuple[int, bytes]] = []
        self.send(b"  V2")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ bytes
    def send(self, data: bytes) -> None:
        self.sock.settimeout(self.timeout)
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise NSQError(f"nsqd {self.address}: send failed: {exc}") from exc

    def command(self, line: str) -> None:
        self.send(line.encode() + b"\n")

    def _fill(self, timeout: float | None) -> bool:
        """Receive more bytes; False when nothing came within ``timeout``."""
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(_RECV_SIZE)
        except (BlockingIOError, TimeoutError):
            return False
        except OSError as exc:
            raise NSQError(f"nsqd {self.address}: receive failed: {exc}") from exc
        if not chunk:
            raise NSQError(f"nsqd {self.address} closed the connection")
        self._buf += chunk
        return True

    def _parse(self) -> list[tuple[int, bytes]]:
        """Every complete frame in the buffer; heartbeats are answered and left out."""
        frames: list[tuple[int, bytes]] = []
        buf, pos, end = self._buf, self._pos, len(self._buf)
        unpack = _HEAD.unpack_from
        heartbeat = False
        with memoryview(buf) as view:
            while pos + 8 <= end:
                size, kind = unpack(buf, pos)
                if pos + 4 + size > end:
                    break
                data = bytes(view[pos + 8:pos + 4 + size])
                pos += 4 + size
                if kind == FRAME_RESPONSE and data == HEARTBEAT:
                    heartbeat = True
                    continue
                frames.append((kind, data))
        self._pos = pos
        if heartbeat:
            self.command("NOP")
        return frames

    def read_frames(self, timeout: float | None) -> list[tuple[int, bytes]]:
        """The frames that have arrived, waiting up to ``timeout`` seconds for at least one.

        ``timeout=0`` only looks; an empty list means nothing came in time.
        """
        if self._pending:
            frames, self._pending = self._pending, []
            return frames + self._parse()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frames = self._parse()
            if frames:
                return frames
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not self._fill(remaining) and remaining is not None and remaining <= 0.001:
                return frames

    def read_frame(self, timeout: float | None = None) -> tuple[int, bytes]:
        """The next frame, within ``timeout`` seconds (default: the connection's timeout)."""
        limit = self.timeout if timeout is None else timeout
        frames = self.read_frames(limit)
        if not frames:
            raise NSQError(f"nsqd {self.address}: no answer within {limit:g} s")
        self.unread(frames[1:])
        return frames[0]

    def unread(self, frames: list[tuple[int, bytes]]) -> None:
        """Give frames back: the next read returns them first."""
        self._pending[:0] = frames

    def response(self) -> bytes:
        """The next response frame; an error frame raises :class:`NSQError`."""
        kind, data = self.read_frame()
        if kind == FRAME_ERROR:
            raise NSQError(f"nsqd {self.address}: {data.decode(errors='replace')}")
        if kind != FRAME_RESPONSE:
            raise NSQError(f"nsqd {self.address}: expected a response, got a message")
        return data

    # ------------------------------------------------------------ verbs
    def identify(self, **fields) -> dict:
        self.send(body_command("IDENTIFY", json.dumps({"user_agent": USER_AGENT, **fields}).encode()))
        data = self.response()
        return json.loads(data) if data.startswith(b"{") else {}

    def subscribe(self, topic: str, channel: str) -> None:
        self.command(f"SUB {topic} {channel}")
        self.expect_ok()

    def expect_ok(self) -> None:
        data = self.response()
        if data != b"OK":
            raise NSQError(f"nsqd {self.address}: expected OK, got {data!r}")


def lease_consumer(address: str, topic: str, channel: str, msg_timeout_ms: int,
                   timeout: float = 10.0) -> Connection:
    """A connection subscribed to ``topic``/``channel`` with the lease extension on."""
    conn = Connection(address, timeout)
    try:
        features = conn.identify(feature_negotiation=True, leases=True, msg_timeout=msg_timeout_ms)
        if features.get("leases") is not True:
            raise NSQError(f"nsqd {address} does not support leases (IDENTIFY leases)")
        conn.subscribe(topic, channel)
    except BaseException:
        conn.close()
        raise
    return conn
