"""A small blocking NSQ V2 client over a plain socket, and reconnecting with backoff.

Executors and the driver run inside Spark's Python workers, which are plain
synchronous processes: a blocking socket with explicit timeouts is all they
need. Heartbeats are
answered wherever frames are read, so a connection stays alive as long as its
owner reads it now and then. A ``CLOSE_WAIT`` from the daemon (it is shutting
down) is noted in :attr:`Connection.closing` and kept from the frames.

Errors come in two kinds: :class:`ConnectionLost` when trying again on a new
connection may help (the socket broke or could not be opened, the daemon is
draining for a restart, it stopped answering), and :class:`NSQError` for the
rest. :class:`Backoff` paces the new attempts and gives up after the
``reconnectTimeout`` option.
"""

from __future__ import annotations

import json
import socket
import struct
import time

import numpy as np

FRAME_RESPONSE, FRAME_ERROR, FRAME_MESSAGE = 0, 1, 2
HEARTBEAT = b"_heartbeat_"
CLOSE_WAIT = b"CLOSE_WAIT"
USER_AGENT = "nsq_spark/0.2"

_HEAD = struct.Struct(">ii")
_SIZE = struct.Struct(">i")
_RECV_SIZE = 1 << 20
#: a receive chunk with less room than this is replaced by a new one
_MIN_ROOM = 64 << 10
#: the socket receive buffer asked for (the kernel caps it at net.core.rmem_max)
RECV_BUFFER = 4 << 20
#: frames scanned one by one between two looks for a run of frames of one size
SCAN_STRIDE = 256
#: first and longest pause between attempts to reach a daemon
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 2.0


class NSQError(Exception):
    """The daemon answered with an error frame, or with something unexpected."""


class ConnectionLost(NSQError):
    """The connection broke, could not be made, or the daemon is going away: try a new one."""


class Declined(ConnectionLost):
    """The daemon declined a publish for now (it is draining for a restart, or full); the connection stays."""


class Draining(ConnectionLost):
    """The daemon refused a subscription because it is draining: its ``CLOSE_WAIT`` to the
    connections it had may still be on the way."""


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"nsqd address {address!r} is not host:port (a port from 1 to 65535)")
    return host.strip("[]"), int(port)


def body_command(line: str, body: bytes) -> bytes:
    return line.encode() + b"\n" + _SIZE.pack(len(body)) + body


def identify_command(**fields) -> bytes:
    return body_command("IDENTIFY", json.dumps({"user_agent": USER_AGENT, **fields}).encode())


def mpub_body(bodies: list[bytes]) -> bytes:
    pack = _SIZE.pack
    return b"".join([pack(len(bodies)), *[pack(len(b)) + b for b in bodies]])


def error_frame(address: str, data: bytes) -> NSQError:
    """The exception for an error frame: publishing or subscribing while the daemon drains is worth retrying."""
    text = data.decode(errors="replace")
    code = text.split(" ", 1)[0]
    if code in ("E_PUB_FAILED", "E_MPUB_FAILED", "E_DPUB_FAILED"):
        return Declined(f"nsqd {address}: {text}")
    if code == "E_SUB_FAILED" and text.endswith("exiting"):
        return Draining(f"nsqd {address}: {text}")
    return NSQError(f"nsqd {address}: {text}")


class Connection:
    """One NSQ V2 connection: send commands, read frames (message runs in bulk), answer heartbeats."""

    def __init__(self, address: str, timeout: float = 10.0) -> None:
        self.address = address
        self.timeout = timeout
        #: the daemon sent CLOSE_WAIT: it delivers nothing more and closes the connection soon
        self.closing = False
        try:
            self.sock = _connect(parse_address(address), timeout)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to nsqd at {address}: {exc}") from exc
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        #: received bytes go to ``_buf[_end:]``; ``_buf[_pos:_end]`` is not parsed yet
        self._buf = bytearray(_RECV_SIZE)
        self._pos = self._end = 0
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
            raise ConnectionLost(f"nsqd {self.address}: send failed: {exc}") from exc

    def command(self, line: str) -> None:
        self.send(line.encode() + b"\n")

    def fill(self, timeout: float | None) -> bool:
        """Receive more bytes; False when nothing came within ``timeout``.

        Bytes are received into a chunk that is never moved nor written over,
        so runs of message frames are handed on as views of it, without a
        copy. When a chunk has little room left, what is not parsed yet
        starts a new one (big enough for the frame it begins).
        """
        buf, pos, end = self._buf, self._pos, self._end
        if len(buf) - end < _MIN_ROOM:
            rest = end - pos
            frame = 4 + _SIZE.unpack_from(buf, pos)[0] if rest >= 4 else 0
            self._buf = bytearray(max(_RECV_SIZE, 2 * rest, frame + _MIN_ROOM))
            self._buf[:rest] = buf[pos:end]
            self._pos, self._end = 0, rest
        self.sock.settimeout(timeout)
        try:
            with memoryview(self._buf) as view:
                received = self.sock.recv_into(view[self._end:])
        except (BlockingIOError, TimeoutError):
            return False
        except OSError as exc:
            raise ConnectionLost(f"nsqd {self.address}: receive failed: {exc}") from exc
        if not received:
            raise ConnectionLost(f"nsqd {self.address} closed the connection")
        self._end += received
        return True

    def _handled(self, pos: int, size: int, kind: int) -> bool:
        """Answer a heartbeat or note a CLOSE_WAIT at ``pos``; False for any other frame."""
        if kind != FRAME_RESPONSE or size - 4 not in (len(HEARTBEAT), len(CLOSE_WAIT)):
            return False
        data = self._buf[pos + 8:pos + 4 + size]
        if data == HEARTBEAT:
            self.command("NOP")
        elif data == CLOSE_WAIT:
            self.closing = True
        else:
            return False
        return True

    def next_frame(self) -> tuple[int, bytes] | None:
        """The next complete frame in the buffer, or None; heartbeats and CLOSE_WAIT are handled here."""
        buf, end = self._buf, self._end
        while self._pos + 8 <= end:
            pos = self._pos
            size, kind = _HEAD.unpack_from(buf, pos)
            if pos + 4 + size > end:
                return None
            self._pos = pos + 4 + size
            if not self._handled(pos, size, kind):
                return kind, bytes(buf[pos + 8:pos + 4 + size])
        return None

    def take_messages(self, columns, limit: int) -> int:
        """Move up to ``limit`` consecutive message frames from the buffer into ``columns``.

        Stops at the first frame that is not a message (heartbeats and
        CLOSE_WAIT are handled on the way) or is not complete yet, and returns
        how many it took. This is the hot path: :func:`scan_messages` finds
        where the frames start, and the bytes of a run of them are handed
        over in one copy.
        """
        buf = self._buf
        pos, end, taken = self._pos, self._end, 0
        while True:
            start = pos
            starts, pos = scan_messages(buf, pos, end, limit - taken)
            if len(starts):
                columns.add_run(memoryview(buf)[start:pos], starts, start)
                taken += len(starts)
            if taken >= limit or pos + 8 > end:
                break
            size, kind = _HEAD.unpack_from(buf, pos)
            if pos + 4 + size > end or not self._handled(pos, size, kind):
                break
            pos += 4 + size  # a heartbeat or CLOSE_WAIT between messages: the run goes on after it
        self._pos = pos
        return taken

    def frame_waiting(self) -> bool:
        """Whether the buffer starts with a complete frame that is not a message (nor a heartbeat)."""
        buf, end = self._buf, self._end
        while self._pos + 8 <= end:
            pos = self._pos
            size, kind = _HEAD.unpack_from(buf, pos)
            if kind == FRAME_MESSAGE or pos + 4 + size > end:
                return False
            if not self._handled(pos, size, kind):
                return True
            self._pos = pos + 4 + size
        return False

    def read_frames(self, timeout: float | None) -> list[tuple[int, bytes]]:
        """The frames that have arrived, waiting up to ``timeout`` seconds for at least one.

        ``timeout=0`` only looks; an empty list means nothing came in time.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        frames: list[tuple[int, bytes]] = []
        while True:
            frame = self.next_frame()
            while frame is not None:
                frames.append(frame)
                frame = self.next_frame()
            if frames:
                return frames
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not self.fill(remaining) and remaining is not None and remaining <= 0.001:
                return frames

    def read_frame(self, timeout: float | None = None) -> tuple[int, bytes]:
        """The next frame, within ``timeout`` seconds (default: the connection's timeout)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            frame = self.next_frame()
            if frame is not None:
                return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.fill(remaining):
                if time.monotonic() >= deadline:
                    raise ConnectionLost(f"nsqd {self.address}: no answer within {limit:g} s")

    def response(self) -> bytes:
        """The next response frame; an error frame raises."""
        kind, data = self.read_frame()
        if kind == FRAME_ERROR:
            raise error_frame(self.address, data)
        if kind != FRAME_RESPONSE:
            raise NSQError(f"nsqd {self.address}: expected a response, got a message")
        return data

    # ------------------------------------------------------------ verbs
    def identify(self, **fields) -> dict:
        self.send(identify_command(**fields))
        return self.identified()

    def identified(self) -> dict:
        """The answer to ``IDENTIFY``: the negotiated features (empty without feature negotiation)."""
        data = self.response()
        return json.loads(data) if data.startswith(b"{") else {}

    def subscribe(self, topic: str, channel: str) -> None:
        self.command(f"SUB {topic} {channel}")
        self.expect_ok()

    def expect_ok(self) -> None:
        data = self.response()
        if data != b"OK":
            raise NSQError(f"nsqd {self.address}: expected OK, got {data!r}")


def _connect(address: tuple[str, int], timeout: float) -> socket.socket:
    """``socket.create_connection`` with a receive buffer of :data:`RECV_BUFFER` set before connecting.

    The window a connection starts with follows its receive buffer: with the
    default one, a new connection is sent a segment in small pieces, many
    sends and receives, until the kernel has grown it.
    """
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
            sock.settimeout(timeout)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error or OSError(f"no address for {address[0]}")


def scan_messages(buf: bytearray, pos: int, end: int, limit: int) -> tuple[np.ndarray, int]:
    """Where the complete message frames in ``buf[pos:end]`` start, up to ``limit`` of them or another frame.

    Returns the positions and where the scan stopped. Frames are found one
    by one (a frame's size says where the next starts), except that a run of
    frames of one size is found in bulk: when the next frame has the size of
    this one, numpy compares the heads (size and type) at every multiple of
    that size ahead, and takes the run up to the first that differs. Messages
    of one size are common (fixed-width records, benchmarks); for others the
    check costs one comparison every :data:`SCAN_STRIDE` frames.
    """
    pieces: list = []
    found = 0
    unpack = _HEAD.unpack_from
    while found < limit and pos + 8 <= end:
        size, kind = unpack(buf, pos)
        step = 4 + size
        if kind == FRAME_MESSAGE and pos + step + 8 <= end and buf[pos:pos + 8] == buf[pos + step:pos + step + 8]:
            count = min((end - pos) // step, limit - found)
            heads = np.frombuffer(buf, np.uint8, count * step, pos).reshape(count, step)[:, :8]
            same = (heads == heads[0]).all(axis=1)
            run = count if same.all() else int(same.argmin())
            del heads, same  # the bytearray may not be resized while numpy looks at it
            pieces.append(np.arange(pos, pos + run * step, step, dtype=np.int64))
            pos += run * step
            found += run
        one_by_one: list[int] = []
        add = one_by_one.append
        for _ in range(min(SCAN_STRIDE, limit - found)):
            if pos + 8 > end:
                break
            size, kind = unpack(buf, pos)
            following = pos + 4 + size
            if kind != FRAME_MESSAGE or following > end:
                break
            add(pos)
            pos = following
        else:
            pieces.append(one_by_one)
            found += len(one_by_one)
            continue
        pieces.append(one_by_one)
        found += len(one_by_one)
        break
    if not pieces:
        return np.empty(0, dtype=np.int64), pos
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces]), pos


class Backoff:
    """When to try reaching a daemon again, and when to give up.

    Pauses start at :data:`BACKOFF_FIRST` and double up to :data:`BACKOFF_MAX`;
    :meth:`failed` raises once the daemon has been unreachable for
    ``give_up`` seconds (the ``reconnectTimeout`` option) without a success.
    """

    def __init__(self, give_up: float, option: str = "reconnectTimeout") -> None:
        self.give_up = give_up
        #: what sets ``give_up``, for the error
        self.option = option
        self.since: float | None = None
        self.delay = 0.0
        self.next_try = 0.0

    def failed(self, exc: ConnectionLost) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.since >= self.give_up:
            why = "nsqd kept declining" if isinstance(exc, Declined) else "without nsqd"
            raise ConnectionLost(f"gave up after {self.give_up:g} s ({self.option}) {why}: {exc}") from exc
        self.delay = min(max(self.delay * 2, BACKOFF_FIRST), BACKOFF_MAX)
        self.next_try = now + self.delay

    def succeeded(self) -> None:
        self.since, self.delay, self.next_try = None, 0.0, 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.next_try

    def wait(self) -> None:
        time.sleep(max(self.next_try - time.monotonic(), 0.0))


def retrying(backoff: Backoff, operation, on_lost=None):
    """``operation()`` until it does not lose its connection, pausing between attempts.

    ``on_lost`` is called after each loss (to drop broken connections).
    Raises once ``backoff`` gives up.
    """
    while True:
        try:
            result = operation()
        except ConnectionLost as exc:
            if on_lost is not None:
                on_lost()
            backoff.failed(exc)
            backoff.wait()
            continue
        backoff.succeeded()
        return result
