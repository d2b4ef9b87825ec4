"""Model-based test: random operations on the daemon's channels, checked against a reference model.

Hypothesis drives a state machine that starts ``python -m nsqd`` (one
second ``--msg-timeout``, a 50 ms queue scan, a memory queue of 0, 3 or
10,000 messages) and a small pure-Python model of two topics with a few
channels, and applies random operations over real sockets: PUB, MPUB and
DPUB over TCP and HTTP, SUB from several consumers (some with output
buffering), RDY (0 and past ``--max-rdy-count``, which closes the
connection), FIN, REQ with and without a delay, TOUCH, FIN of a message the
consumer does not hold, CLS, disconnects, channel and topic pause, empty,
create and delete, waits that let messages time out, and a restart
(SIGTERM, then the same data path).

After every step each consumer is read up to a barrier (a FIN of an id
never used, answered ``E_FIN_FAILED``), the daemon is given time to settle
(bounded polling), and ``/stats`` must agree with the model: topic
``depth``, ``message_count``, ``message_bytes``, ``paused``; channel
``depth``, ``in_flight_count``, ``deferred_count``, ``message_count``,
``requeue_count``, ``timeout_count``, ``client_count``, ``paused``; client
``ready_count``, ``in_flight_count``, ``message_count``, ``finish_count``,
``requeue_count`` and ``state``, each as Go nsqd defines it
(``nsqd/stats.go``, ``channel.go``, ``client_v2.go``). Every delivery must
be of a message the channel holds, with its body and id, ``attempts`` one
more than its deliveries so far, never after its FIN, never before its
DPUB or REQ delay, never on a paused channel or past the consumer's RDY;
and a channel with messages and a consumer with room must deliver. At the
end every channel is drained: everything published and not finished
(emptied or deleted) comes back.

Time: a message's timeout and a deferred message's due time are known only
within a window (from when the daemon may have taken or deferred it to
when the queue scan must have acted), so operations wait until no window is
open, and ``/stats`` is compared only outside them.

The model follows the differences from Go that docs/compatibility.md lists:
a consumer that goes away gives its messages back at once (counted as
timeouts), and deferred messages keep their due time across a restart and
in their topic's backlog (after a restart they count as depth until read).

Knobs: ``NSQD_MODEL_EXAMPLES`` (default 5, about 15 s) examples of
``NSQD_MODEL_STEPS`` (default 20) steps each, derandomized so every run is
the same; ``NSQD_MODEL_SEED=<n>`` runs another sequence, from that seed
(``NSQD_MODEL_EXAMPLES=30 NSQD_MODEL_SEED=1`` takes a few minutes).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from .support import FRAME_ERROR, FRAME_MESSAGE, FRAME_RESPONSE, Message, free_port, mpub_body

EXAMPLES = int(os.environ.get("NSQD_MODEL_EXAMPLES", "5"))
STEPS = int(os.environ.get("NSQD_MODEL_STEPS", "20"))
SEED = os.environ.get("NSQD_MODEL_SEED")

MSG_TIMEOUT = 1.0
SCAN = 0.05
MAX_RDY = 8
#: how late the daemon may act on a due time (scheduling on a busy machine)
SLACK = 0.3
#: an operation is started only when no time window opens within this long
OP_MARGIN = 0.2
#: how long a step may take to settle before the model and the daemon are declared apart
SETTLE_TIMEOUT = 5.0
TOPICS = ("ta", "tb")
CHANNELS = ("c1", "c2", "c3")
MAX_CONSUMERS = 5
#: a message id never given out: FIN of it is the barrier
BARRIER_ID = b"model-barrier-00"

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ the daemon
class Daemon:
    """``python -m nsqd`` with loopback TCP and HTTP on free ports; the log goes to a file."""

    def __init__(self, data_path: Path, mem_queue_size: int) -> None:
        self.data_path = data_path
        self.args = [f"--data-path={data_path}", f"--mem-queue-size={mem_queue_size}", "--msg-timeout=1s",
                     "--queue-scan-interval=50ms", f"--max-rdy-count={MAX_RDY}", "--shutdown-grace=0",
                     "--https-address=", "--log-level=warn"]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.tcp, self.http = free_port(), free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with open(self.data_path.parent / "nsqd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{self.tcp}",
                 f"--http-address=127.0.0.1:{self.http}", *self.args],
                stdout=subprocess.DEVNULL, stderr=log, env=env)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, "the daemon exited at start"
            try:
                if self.request("GET", "/ping")[0] == 200:
                    socket.create_connection(("127.0.0.1", self.tcp), timeout=1).close()
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(30) == 0
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def request(self, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=10)
        try:
            conn.request(method, target, body=body if method == "POST" else None)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post(self, target: str, body: bytes = b"") -> None:
        status, answer = self.request("POST", target, body)
        assert status == 200, (target, status, answer)

    def stats(self) -> dict:
        status, answer = self.request("GET", "/stats?format=json&include_mem=false")
        assert status == 200, answer
        return json.loads(answer)


class Conn:
    """A blocking NSQ V2 connection; heartbeats are answered on the way."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(b"  V2")
        self.buf = bytearray()

    def command(self, line: str | bytes, body: bytes | None = None) -> None:
        data = (line.encode() if isinstance(line, str) else line) + b"\n"
        if body is not None:
            data += struct.pack(">i", len(body)) + body
        self.sock.sendall(data)

    def frame(self) -> tuple[int, bytes] | None:
        """The next frame other than a heartbeat; None once the daemon closed the connection."""
        while True:
            if len(self.buf) >= 8:
                size, kind = struct.unpack_from(">ii", self.buf, 0)
                if len(self.buf) >= 4 + size:
                    data = bytes(self.buf[8:4 + size])
                    del self.buf[:4 + size]
                    if (kind, data) == (FRAME_RESPONSE, b"_heartbeat_"):
                        self.command("NOP")
                        continue
                    return kind, data
            try:
                chunk = self.sock.recv(65536)
            except ConnectionError:
                chunk = b""
            if not chunk:
                return None
            self.buf += chunk

    def close(self) -> None:
        self.sock.close()


# ------------------------------------------------------------------ the model
@dataclass
class Copy:
    """One message in one channel: queued, deferred or in flight."""

    state: str
    attempts: int = 0
    consumer: Consumer | None = None
    msg_id: bytes = b""
    #: deferred: when it may be and must have been made due; in flight: when it may and must time out
    window: tuple[float, float] | None = None
    #: deferred and on disk since a restart: depth until a consumer reads it back (docs/compatibility.md)
    unread: bool = False


@dataclass
class ChannelModel:
    paused: bool = False
    copies: dict[bytes, Copy] = field(default_factory=dict)
    finished: set[bytes] = field(default_factory=set)
    message_count: int = 0
    requeue_count: int = 0
    timeout_count: int = 0


@dataclass
class TopicModel:
    paused: bool = False
    channels: dict[str, ChannelModel] = field(default_factory=dict)
    #: what the topic keeps while it has no channel or is paused: body -> due window (None: not deferred)
    backlog: dict[bytes, tuple[float, float] | None] = field(default_factory=dict)
    #: the id the daemon gave each body (the same in every channel)
    ids: dict[bytes, bytes] = field(default_factory=dict)
    message_count: int = 0
    message_bytes: int = 0


@dataclass(eq=False)
class Consumer:
    name: str
    conn: Conn
    topic: str
    channel: str
    buffered: bool
    rdy: int = 0
    closing: bool = False
    held: dict[bytes, Copy] = field(default_factory=dict)
    message_count: int = 0
    finish_count: int = 0
    requeue_count: int = 0
    #: when the last barrier answered was sent: what arrives after it was taken after that
    synced_at: float = 0.0


def deferred_window(sent: float, acked: float, delay: float) -> tuple[float, float]:
    return sent + delay, acked + delay + SCAN + SLACK


class Model:
    def __init__(self) -> None:
        self.topics: dict[str, TopicModel] = {}
        self.consumers: list[Consumer] = []

    def channel_of(self, consumer: Consumer) -> ChannelModel | None:
        topic = self.topics.get(consumer.topic)
        return None if topic is None else topic.channels.get(consumer.channel)

    def topic(self, name: str) -> TopicModel:
        return self.topics.setdefault(name, TopicModel())

    def channel(self, topic_name: str, name: str) -> ChannelModel:
        topic = self.topic(topic_name)
        channel = topic.channels.get(name)
        if channel is None:
            channel = topic.channels[name] = ChannelModel()
            self.release_backlog(topic)
        return channel

    # ---------------------------------------------------------------- publishing
    def publish(self, topic_name: str, bodies: list[bytes], window: tuple[float, float] | None = None) -> None:
        topic = self.topic(topic_name)
        topic.message_count += len(bodies)
        topic.message_bytes += sum(map(len, bodies))
        for body in bodies:
            topic.backlog[body] = window
        self.release_backlog(topic)

    def release_backlog(self, topic: TopicModel) -> None:
        if not topic.channels or topic.paused:
            return
        for channel in topic.channels.values():
            channel.message_count += len(topic.backlog)
            for body, window in topic.backlog.items():
                channel.copies[body] = Copy("deferred", window=window) if window else Copy("queued")
        topic.backlog.clear()

    # ---------------------------------------------------------------- consumers
    def give_back(self, consumer: Consumer) -> None:
        """A consumer left: what it held goes back to its channel at once (docs/compatibility.md),
        counted as Go counts these messages when they time out."""
        channel = self.channel_of(consumer)
        for copy in consumer.held.values():
            copy.state, copy.consumer, copy.window = "queued", None, None
        if channel is not None:
            channel.timeout_count += len(consumer.held)
        consumer.held.clear()
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        consumer.conn.close()

    def drop_consumers(self, topic_name: str, channel_name: str | None = None) -> None:
        """The daemon closed these consumers (their channel is gone): nothing is given back."""
        for consumer in list(self.consumers):
            if consumer.topic == topic_name and channel_name in (None, consumer.channel):
                self.consumers.remove(consumer)
                consumer.conn.close()

    # ---------------------------------------------------------------- time
    def windows(self):
        for topic in self.topics.values():
            for channel in topic.channels.values():
                for copy in channel.copies.values():
                    if copy.window is not None:
                        yield copy.window

    def open_until(self, start: float, end: float) -> float | None:
        """The end of the last time window that overlaps [start, end], or None."""
        ends = [hi for lo, hi in self.windows() if lo <= end and hi >= start]
        return max(ends) if ends else None

    def advance(self, now: float) -> None:
        """Apply what must have happened by ``now``: due deferred messages, timeouts."""
        for topic in self.topics.values():
            for channel in topic.channels.values():
                for copy in channel.copies.values():
                    if copy.window is None or copy.window[1] >= now:
                        continue
                    if copy.state == "flight":
                        self.time_out(channel, copy)
                    else:
                        copy.state, copy.window, copy.unread = "queued", None, False

    def time_out(self, channel: ChannelModel, copy: Copy) -> None:
        channel.timeout_count += 1
        del copy.consumer.held[copy.msg_id]
        copy.state, copy.consumer, copy.window = "queued", None, None

    def stable(self) -> bool:
        """Every channel that can deliver has: no queued message waits for a consumer with room."""
        for name, topic in self.topics.items():
            if topic.backlog and topic.channels and not topic.paused:
                return False
            for channel_name, channel in topic.channels.items():
                if channel.paused or not any(c.state == "queued" for c in channel.copies.values()):
                    continue
                for consumer in self.consumers:
                    if (consumer.topic, consumer.channel) == (name, channel_name) and not consumer.closing \
                            and len(consumer.held) < consumer.rdy:
                        return False
        return True

    # ---------------------------------------------------------------- deliveries
    def delivered(self, consumer: Consumer, msg: Message, now: float) -> None:
        """Check one delivery against the model and apply it."""
        where = f"{consumer.name} on {consumer.topic}/{consumer.channel}"
        channel = self.channel_of(consumer)
        assert channel is not None, f"delivery to {where}, whose channel is gone"
        topic = self.topics[consumer.topic]
        body = msg.body
        assert body not in channel.finished, f"{body!r} delivered to {where} after its FIN"
        copy = channel.copies.get(body)
        assert copy is not None, f"{where} got {body!r}, which its channel does not hold"
        known = topic.ids.setdefault(body, msg.id)
        assert msg.id == known, f"{body!r} came with id {msg.id!r}, before with {known!r}"
        assert not channel.paused, f"{body!r} delivered to {where} while the channel is paused"
        assert not consumer.closing, f"{body!r} delivered to {where} after CLS"
        if copy.state == "deferred":
            assert now >= copy.window[0], f"{body!r} delivered {copy.window[0] - now:.3f}s before its time"
            copy.unread = False
        elif copy.state == "flight":
            assert now >= copy.window[0], f"{body!r} delivered again to {where} while still in flight"
            self.time_out(channel, copy)
        if len(consumer.held) >= consumer.rdy:  # room made by held messages that timed out meanwhile?
            expired = sorted((c for c in consumer.held.values() if c.window[0] <= now), key=lambda c: c.window[0])
            for held in expired[:len(consumer.held) - consumer.rdy + 1]:
                self.time_out(channel, held)
        assert len(consumer.held) < consumer.rdy, \
            f"{where} got {body!r} with {len(consumer.held)} in flight and RDY {consumer.rdy}"
        assert msg.attempts == copy.attempts + 1, \
            f"{body!r} delivered with attempts {msg.attempts}, after {copy.attempts} deliveries"
        copy.attempts += 1
        copy.state, copy.consumer, copy.msg_id = "flight", consumer, msg.id
        copy.window = (consumer.synced_at + MSG_TIMEOUT, now + MSG_TIMEOUT + SCAN + SLACK)
        consumer.held[msg.id] = copy
        consumer.message_count += 1

    def finish(self, consumer: Consumer, msg_id: bytes) -> None:
        """FIN: the message leaves its channel for good."""
        consumer.conn.command(b"FIN " + msg_id)
        channel = self.channel_of(consumer)
        copy = consumer.held.pop(msg_id)
        body = next(body for body, c in channel.copies.items() if c is copy)
        del channel.copies[body]
        channel.finished.add(body)
        consumer.finish_count += 1

    # ---------------------------------------------------------------- /stats
    def differences(self, stats: dict) -> list[str]:
        out: list[str] = []

        def same(where: str, got: dict, expected: dict) -> None:
            for key, value in expected.items():
                if got.get(key) != value:
                    out.append(f"{where} {key}: daemon {got.get(key)!r}, model {value!r}")

        def by_name(where: str, items: list[dict], key: str, names) -> dict[str, dict]:
            found = {item[key]: item for item in items}
            if set(found) != set(names):
                out.append(f"{where}: daemon {sorted(found)}, model {sorted(names)}")
            return found

        topics = by_name("topics", stats["topics"], "topic_name", self.topics)
        for name, topic in self.topics.items():
            got = topics.get(name)
            if got is None:
                continue
            same(name, got, {"depth": len(topic.backlog), "message_count": topic.message_count,
                             "message_bytes": topic.message_bytes, "paused": topic.paused})
            channels = by_name(f"{name} channels", got["channels"], "channel_name", topic.channels)
            for channel_name, channel in topic.channels.items():
                got_channel = channels.get(channel_name)
                if got_channel is None:
                    continue
                where = f"{name}/{channel_name}"
                states = [c.state for c in channel.copies.values()]
                consumers = [c for c in self.consumers if (c.topic, c.channel) == (name, channel_name)]
                unread = sum(c.unread for c in channel.copies.values())
                depth = states.count("queued")
                if unread and depth <= got_channel["depth"] <= depth + unread:  # read back or not yet
                    depth = got_channel["depth"]
                same(where, got_channel, {
                    "depth": depth, "in_flight_count": states.count("flight"),
                    "deferred_count": states.count("queued") + states.count("deferred") - depth,
                    "message_count": channel.message_count,
                    "requeue_count": channel.requeue_count, "timeout_count": channel.timeout_count,
                    "client_count": len(consumers), "paused": channel.paused})
                clients = by_name(f"{where} clients", got_channel["clients"], "client_id", [c.name for c in consumers])
                for consumer in consumers:
                    if consumer.name in clients:
                        same(f"{where} {consumer.name}", clients[consumer.name], {
                            "ready_count": 0 if consumer.closing else consumer.rdy,
                            "in_flight_count": len(consumer.held), "message_count": consumer.message_count,
                            "finish_count": consumer.finish_count, "requeue_count": consumer.requeue_count,
                            "state": 4 if consumer.closing else 3})
        return out


# ------------------------------------------------------------------ the machine
bodies = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=5)
pick = st.integers(min_value=0, max_value=99)


class ChannelMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.directory = Path(tempfile.mkdtemp(prefix="nsqd-model-"))
        self.daemon: Daemon | None = None
        self.publisher: Conn | None = None
        self.serial = 0

    @initialize(mem_queue_size=st.sampled_from([10_000, 3, 0]), sizes=bodies, rdy=st.integers(1, MAX_RDY))
    def start(self, mem_queue_size, sizes, rdy):
        """The daemon, with messages and two consumers to start from (one of them buffered)."""
        self.daemon = Daemon(self.directory / "data", mem_queue_size)
        self.daemon.start()
        self.publisher = Conn(self.daemon.tcp)
        self.pub_tcp(TOPICS[0], sizes, True)
        self.step(lambda: self.subscribe("consumer", TOPICS[0], CHANNELS[0], rdy, False))
        self.step(lambda: self.subscribe("consumer", TOPICS[0], CHANNELS[1], 1, True))

    def teardown(self):
        try:
            if self.daemon is not None and self.daemon.proc is not None:
                self.drain_everything()
        finally:
            for consumer in self.model.consumers:
                consumer.conn.close()
            if self.publisher is not None:
                self.publisher.close()
            if self.daemon is not None:
                self.daemon.kill()
            shutil.rmtree(self.directory, ignore_errors=True)

    # ---------------------------------------------------------------- helpers
    def new_bodies(self, topic: str, sizes: list[int]) -> list[bytes]:
        out = []
        for size in sizes:
            self.serial += 1
            out.append(b"%s.%d." % (topic.encode(), self.serial) + bytes(range(97, 97 + size % 26)) * (1 + size // 26))
        return out

    def quiesce(self) -> None:
        """Wait until no time window opens during the next operation."""
        while True:
            now = time.monotonic()
            end = self.model.open_until(now, now + OP_MARGIN)
            if end is None:
                return
            self.sync_all()
            time.sleep(min(max(end - now, 0.0), 0.02) + 0.001)

    def read_until(self, consumer: Consumer, expected_kind: int, prefix: bytes) -> bytes | None:
        """Read deliveries until a frame other than a message; returns its data (None: closed)."""
        while True:
            frame = consumer.conn.frame()
            if frame is None:
                return None
            kind, data = frame
            if kind == FRAME_MESSAGE:
                self.model.delivered(consumer, Message(data), time.monotonic())
                continue
            assert kind == expected_kind and data.startswith(prefix), \
                f"{consumer.name}: expected {prefix!r}, got {kind} {data!r}"
            return data

    def sync_all(self) -> None:
        """Every consumer read up to a barrier; a consumer the daemon closed must be one the model dropped."""
        consumers = list(self.model.consumers)
        sent = {}
        for consumer in consumers:
            sent[consumer] = time.monotonic()
            consumer.conn.command(b"FIN " + BARRIER_ID)
        for consumer in consumers:
            answer = self.read_until(consumer, FRAME_ERROR, b"E_FIN_FAILED")
            assert answer is not None, f"{consumer.name}: the daemon closed the connection"
            consumer.synced_at = sent[consumer]

    def barrier(self, consumer: Consumer) -> None:
        """Read this consumer's deliveries up to the answer to a FIN of an id no one holds."""
        consumer.conn.command(b"FIN " + BARRIER_ID)
        self.read_until(consumer, FRAME_ERROR, b"E_FIN_FAILED")

    def settle(self) -> None:
        """Read every consumer until the daemon is stable and /stats agrees with the model."""
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while True:
            self.sync_all()
            now = time.monotonic()
            if self.model.open_until(now - 0.01, now + 0.05) is not None:
                assert now < deadline + SETTLE_TIMEOUT, "time windows stay open"
                time.sleep(0.01)
                continue
            self.model.advance(now)
            problems = ["a channel has messages and a consumer with room"] if not self.model.stable() else []
            if not problems:
                stats = self.daemon.stats()
                after = time.monotonic()
                if self.model.open_until(now, after) is not None:
                    continue
                problems = self.model.differences(stats)
                if not problems:
                    return
            assert time.monotonic() < deadline, "\n".join(problems)
            time.sleep(0.01)

    def consumer(self, index: int) -> Consumer:
        return self.model.consumers[index % len(self.model.consumers)]

    def holder(self, index: int) -> Consumer:
        """The consumer at ``index``, or the next one that holds messages."""
        consumers = self.model.consumers
        return next(c for c in consumers[index % len(consumers):] + consumers if c.held)

    def subscribe(self, prefix: str, topic: str, channel: str, rdy: int, buffered: bool) -> Consumer:
        self.serial += 1
        conn = Conn(self.daemon.tcp)
        consumer = Consumer(f"{prefix}{self.serial}", conn, topic, channel, buffered)
        conn.command("IDENTIFY", json.dumps({"client_id": consumer.name, "hostname": "model",
                                             "output_buffer_timeout": 50 if buffered else -1}).encode())
        assert conn.frame() == (FRAME_RESPONSE, b"OK")
        conn.command(f"SUB {topic} {channel}")
        assert conn.frame() == (FRAME_RESPONSE, b"OK")
        self.model.channel(topic, channel)
        self.model.consumers.append(consumer)
        consumer.synced_at = time.monotonic()
        consumer.rdy = rdy
        conn.command(f"RDY {rdy}")
        return consumer

    def held_id(self, consumer: Consumer, index: int) -> bytes:
        ids = list(consumer.held)
        return ids[index % len(ids)]

    def step(self, action) -> None:
        self.quiesce()
        action()
        self.settle()

    # ---------------------------------------------------------------- publishing
    @rule(topic=st.sampled_from(TOPICS), sizes=bodies, multi=st.booleans())
    def pub_tcp(self, topic, sizes, multi):
        def action():
            batch = self.new_bodies(topic, sizes if multi else sizes[:1])
            if multi:
                self.publisher.command(f"MPUB {topic}", mpub_body(batch))
            else:
                self.publisher.command(f"PUB {topic}", batch[0])
            assert self.publisher.frame() == (FRAME_RESPONSE, b"OK")
            self.model.publish(topic, batch)
        self.step(action)

    @rule(topic=st.sampled_from(TOPICS), sizes=bodies, form=st.sampled_from(["pub", "text", "binary"]))
    def pub_http(self, topic, sizes, form):
        def action():
            batch = self.new_bodies(topic, sizes[:1] if form == "pub" else sizes)
            if form == "pub":
                self.daemon.post(f"/pub?topic={topic}", batch[0])
            elif form == "text":
                self.daemon.post(f"/mpub?topic={topic}", b"\n".join(batch) + b"\n")
            else:
                self.daemon.post(f"/mpub?topic={topic}&binary=true", mpub_body(batch))
            self.model.publish(topic, batch)
        self.step(action)

    @rule(topic=st.sampled_from(TOPICS), size=st.integers(0, 40), delay_ms=st.sampled_from([100, 300, 700]),
          over_http=st.booleans())
    def dpub(self, topic, size, delay_ms, over_http):
        def action():
            (body,) = self.new_bodies(topic, [size])
            sent = time.monotonic()
            if over_http:
                self.daemon.post(f"/pub?topic={topic}&defer={delay_ms}", body)
            else:
                self.publisher.command(f"DPUB {topic} {delay_ms}", body)
                assert self.publisher.frame() == (FRAME_RESPONSE, b"OK")
            self.model.publish(topic, [body], deferred_window(sent, time.monotonic(), delay_ms / 1000))
        self.step(action)

    # ---------------------------------------------------------------- consumers
    @precondition(lambda self: len(self.model.consumers) < MAX_CONSUMERS)
    @rule(topic=st.sampled_from(TOPICS), channel=st.sampled_from(CHANNELS), rdy=st.integers(0, MAX_RDY),
          buffered=st.booleans())
    def sub(self, topic, channel, rdy, buffered):
        self.step(lambda: self.subscribe("consumer", topic, channel, rdy, buffered))

    @precondition(lambda self: self.model.consumers)
    @rule(which=pick, rdy=st.sampled_from([0, 1, 2, 3, MAX_RDY, MAX_RDY + 1]))
    def set_rdy(self, which, rdy):
        def action():
            consumer = self.consumer(which)
            consumer.conn.command(f"RDY {rdy}")
            if consumer.closing:
                return  # ignored after CLS, as in Go
            if rdy <= MAX_RDY:
                consumer.rdy = rdy
                return
            self.read_until(consumer, FRAME_ERROR, b"E_INVALID RDY count %d out of range 0-%d" % (rdy, MAX_RDY))
            assert consumer.conn.frame() is None, "RDY past the maximum must close the connection"
            self.model.give_back(consumer)
        self.step(action)

    @precondition(lambda self: any(c.held for c in self.model.consumers))
    @rule(which=pick, index=pick)
    def fin(self, which, index):
        def action():
            consumer = self.holder(which)
            self.model.finish(consumer, self.held_id(consumer, index))
        self.step(action)

    @precondition(lambda self: any(c.held for c in self.model.consumers))
    @rule(which=pick, index=pick, delay_ms=st.sampled_from([0, 0, 150, 500]))
    def req(self, which, index, delay_ms):
        def action():
            consumer = self.holder(which)
            msg_id = self.held_id(consumer, index)
            sent = time.monotonic()
            consumer.conn.command(b"REQ %s %d" % (msg_id, delay_ms))
            copy = consumer.held.pop(msg_id)  # the room it makes may be filled before the barrier
            copy.consumer = None
            copy.state, copy.window = ("deferred", (sent + delay_ms / 1000, math.inf)) if delay_ms else ("queued", None)
            self.model.channel_of(consumer).requeue_count += 1
            consumer.requeue_count += 1
            self.barrier(consumer)
            if delay_ms:
                copy.window = deferred_window(sent, time.monotonic(), delay_ms / 1000)
        self.step(action)

    @precondition(lambda self: any(c.held for c in self.model.consumers))
    @rule(which=pick, index=pick)
    def touch(self, which, index):
        def action():
            consumer = self.holder(which)
            msg_id = self.held_id(consumer, index)
            sent = time.monotonic()
            consumer.conn.command(b"TOUCH " + msg_id)
            self.barrier(consumer)
            consumer.held[msg_id].window = (sent + MSG_TIMEOUT, time.monotonic() + MSG_TIMEOUT + SCAN + SLACK)
        self.step(action)

    @precondition(lambda self: self.model.consumers)
    @rule(which=pick, other=pick)
    def fin_not_held(self, which, other):
        """FIN of a message another consumer holds, or that was finished: E_FIN_FAILED with Go's reason."""
        def action():
            consumer = self.consumer(which)
            channel = self.model.channel_of(consumer)
            theirs = [c.msg_id for c in channel.copies.values() if c.state == "flight" and c.consumer is not consumer]
            done = [self.model.topics[consumer.topic].ids[b] for b in channel.finished]
            if theirs:
                msg_id, reason = theirs[other % len(theirs)], b"client does not own message"
            elif done:
                msg_id, reason = done[other % len(done)], b"ID not in flight"
            else:
                return
            consumer.conn.command(b"FIN " + msg_id)
            self.read_until(consumer, FRAME_ERROR, b"E_FIN_FAILED FIN %s failed %s" % (msg_id, reason))
        self.step(action)

    @precondition(lambda self: any(not c.closing for c in self.model.consumers))
    @rule(which=pick)
    def cls(self, which):
        def action():
            consumer = next(c for c in self.model.consumers[which % len(self.model.consumers):] + self.model.consumers
                            if not c.closing)
            consumer.conn.command("CLS")
            self.read_until(consumer, FRAME_RESPONSE, b"CLOSE_WAIT")
            consumer.closing = True
        self.step(action)

    @precondition(lambda self: self.model.consumers)
    @rule(which=pick)
    def disconnect(self, which):
        self.step(lambda: self.model.give_back(self.consumer(which)))

    # ---------------------------------------------------------------- administration
    @rule(topic=st.sampled_from(TOPICS), channel=st.sampled_from(CHANNELS),
          verb=st.sampled_from(["pause", "unpause", "empty", "delete", "create"]))
    def channel_admin(self, topic, channel, verb):
        def action():
            status, answer = self.daemon.request("POST", f"/channel/{verb}?topic={topic}&channel={channel}")
            model_topic = self.model.topics.get(topic)
            if model_topic is None:
                assert (status, answer) == (404, b'{"message":"TOPIC_NOT_FOUND"}'), (verb, status, answer)
                return
            if verb == "create":
                assert status == 200, answer
                self.model.channel(topic, channel)
                return
            model_channel = model_topic.channels.get(channel)
            if model_channel is None:
                assert (status, answer) == (404, b'{"message":"CHANNEL_NOT_FOUND"}'), (verb, status, answer)
                return
            assert status == 200, answer
            if verb in ("pause", "unpause"):
                model_channel.paused = verb == "pause"
            elif verb == "empty":
                model_channel.copies.clear()
                for consumer in self.model.consumers:
                    if (consumer.topic, consumer.channel) == (topic, channel):
                        consumer.held.clear()
            else:
                del model_topic.channels[channel]
                self.model.drop_consumers(topic, channel)
        self.step(action)

    @rule(topic=st.sampled_from(TOPICS), verb=st.sampled_from(["pause", "unpause", "empty", "delete", "create"]))
    def topic_admin(self, topic, verb):
        def action():
            status, answer = self.daemon.request("POST", f"/topic/{verb}?topic={topic}")
            model_topic = self.model.topics.get(topic)
            if verb == "create":
                assert status == 200, answer
                self.model.topic(topic)
                return
            if model_topic is None:
                assert (status, answer) == (404, b'{"message":"TOPIC_NOT_FOUND"}'), (verb, status, answer)
                return
            assert status == 200, answer
            if verb in ("pause", "unpause"):
                model_topic.paused = verb == "pause"
                self.model.release_backlog(model_topic)
            elif verb == "empty":
                model_topic.backlog.clear()
            else:
                del self.model.topics[topic]
                self.model.drop_consumers(topic)
        self.step(action)

    @rule(seconds=st.sampled_from([0.3, 1.2]))
    def wait(self, seconds):
        def action():
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                self.sync_all()
                self.model.advance(time.monotonic())
                time.sleep(0.02)
        self.step(action)

    @precondition(lambda self: self.model.topics)
    @rule()
    def restart(self):
        """SIGTERM and start again on the same data path: counters start over, nothing is lost."""
        def action():
            self.daemon.stop()
            for consumer in list(self.model.consumers):
                for copy in consumer.held.values():
                    copy.state, copy.consumer, copy.window = "queued", None, None
                consumer.held.clear()
                consumer.conn.close()
            self.model.consumers.clear()
            self.publisher.close()
            self.daemon.start()
            self.publisher = Conn(self.daemon.tcp)
            started = time.monotonic()
            for topic in self.model.topics.values():
                topic.message_count = topic.message_bytes = 0
                for channel in topic.channels.values():
                    channel.message_count = channel.requeue_count = channel.timeout_count = 0
                    for copy in channel.copies.values():
                        if copy.window is not None:
                            copy.window = (copy.window[0], max(copy.window[1], started + SCAN + SLACK))
                            copy.unread = True
        self.step(action)

    # ---------------------------------------------------------------- the end
    def drain_everything(self) -> None:
        """At-least-once: every message published and not finished is delivered, then the queues are empty."""
        self.quiesce()
        for consumer in list(self.model.consumers):
            self.model.give_back(consumer)
        self.settle()
        for name, topic in list(self.model.topics.items()):
            if topic.paused:
                self.daemon.post(f"/topic/unpause?topic={name}")
                topic.paused = False
                self.model.release_backlog(topic)
            for channel_name, channel in topic.channels.items():
                if channel.paused:
                    self.daemon.post(f"/channel/unpause?topic={name}&channel={channel_name}")
                    channel.paused = False
                consumer = self.subscribe("drain", name, channel_name, MAX_RDY, False)
                deadline = time.monotonic() + 10
                while channel.copies:
                    self.sync_all()
                    self.model.advance(time.monotonic())
                    for msg_id in list(consumer.held):
                        self.model.finish(consumer, msg_id)
                    assert time.monotonic() < deadline, f"{name}/{channel_name} never delivered {list(channel.copies)}"
                    time.sleep(0.01)
                self.settle()
                self.model.give_back(consumer)
        self.settle()


settings_ = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=SEED is None,
                     database=None, suppress_health_check=list(HealthCheck), print_blob=True)
if SEED is not None:
    ChannelMachine = seed(int(SEED))(ChannelMachine)
ChannelMachine.TestCase.settings = settings_
test_channels_agree_with_the_model = ChannelMachine.TestCase
