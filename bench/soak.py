#!/usr/bin/env python3
"""Soak: the daemon's memory and descriptors under the churn long-lived clients and attackers make.

Starts ``python -m nsqd`` (TCP, HTTP, AMQP, TLS) as a subprocess and repeats
rounds of client life cycles against it with real clients (raw sockets with
TLS, snappy and deflate, plain HTTP, python-qpid-proton), then reads the
daemon's VmRSS (``/proc/<pid>/status``), its open descriptors
(``/proc/<pid>/fd``) and its topic, channel and client counts (``/stats``).
Every queue is emptied at the end of a round, so a daemon without leaks
stays flat once warmed up. One round:

* consumers: IDENTIFY plain, snappy, deflate, TLS, TLS + snappy, short
  heartbeats; SUB to a channel, an ``#ephemeral`` channel or an ephemeral
  topic; RDY, FIN / REQ (with and without delay) / TOUCH some, keep one in
  flight, then leave by RST, by CLS, in the middle of a command, or while
  messages are being pushed; consumers that stay one round and see their
  messages time out;
* publishers: PUB, MPUB, DPUB; bad commands (fatal errors), a body cut off
  by RST; HTTP /pub and /mpub with and without keep-alive, a cut HTTP body,
  bad requests;
* HTTP admin: topic and channel create, pause, unpause, empty, delete;
* leases: LEASE, then LFIN, LREQ or timeout from another connection;
* AMQP: proton senders and receivers, accept / release / modify, detach,
  close, RST; a raw AMQP header cut off; senders left without credit by a
  topic at its limit;
* request and reply: long-lived connections (TCP and AMQP) publish to each
  requester's ``#ephemeral`` topic.

``--malloc`` adds the daemon's own figures to every round (glibc's bytes in
use and free, Python's blocks), to tell a leak from the allocator keeping
freed memory. ``--diagnose`` runs the daemon under tracemalloc and prints,
every ``--every`` rounds, the allocation sites and object types that grew
since warm-up (slow: for finding a leak, not for figures). bench/README.md
has the cycles in detail.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import pickle
import signal
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from nsq_bench import FRAME_MESSAGE, BenchError, Conn, Daemon, command, free_port, mpub  # noqa: E402

#: the daemon's entry under --diagnose and --malloc: on SIGUSR2 it pickles glibc's malloc figures
#: (mallinfo2: bytes in use, and free bytes the heap keeps), Python's allocated blocks and, under
#: tracemalloc (SOAK_TRACE=1), object type counts and a snapshot
DIAGNOSE_ENTRY = """
import collections, ctypes, gc, os, pickle, runpy, signal, sys, tracemalloc
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
trace = os.environ.get("SOAK_TRACE") == "1"
if trace:
    tracemalloc.start(8)
path = os.environ["SOAK_DUMP"]
def dump(signum, frame):
    gc.collect()
    info = libc.mallinfo2()
    figures = {"malloc_used": info.uordblks + info.hblkhd, "malloc_free": info.fordblks,
               "python_blocks": sys.getallocatedblocks()}
    counts = snapshot = None
    if trace:
        counts = collections.Counter(type(o).__module__ + "." + type(o).__qualname__ for o in gc.get_objects())
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    with open(path + ".tmp", "wb") as f:
        pickle.dump((figures, counts, snapshot), f)
    os.replace(path + ".tmp", path)
signal.signal(signal.SIGUSR2, dump)
sys.argv[0] = "nsqd"
runpy.run_module("nsqd", run_name="__main__", alter_sys=True)
"""

TOPIC = "soak"
CHANNELS = [f"c{i}" for i in range(3)]
LEASE_CHANNEL = "leases"
AMQP_TOPIC = "soak_amqp"
#: a topic at its message limit: publishers are refused, AMQP senders get no credit
FULL_TOPIC = "soak_full"
#: cycles per round (times --scale)
PLAN = [("consumer", 12), ("publisher", 4), ("http_publisher", 2), ("admin", 2), ("lease", 3), ("amqp", 3),
        ("linger", 1), ("reply", 4), ("amqp_reply", 2), ("amqp_full", 2)]
UPGRADES = [{}, {"snappy": True}, {"deflate": 6}, {"tls": "ca"}, {"tls": "ca", "snappy": True}, {}]


def rst(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), as a crashed or killed client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def messages(conn: Conn, count: int) -> list[bytes]:
    """The ids of the next ``count`` messages (responses in between are skipped)."""
    ids = []
    while len(ids) < count:
        kind, data = conn.frame()
        if kind == FRAME_MESSAGE:
            ids.append(data[10:26])
        elif data == b"_heartbeat_":
            conn.send(b"NOP\n")
    return ids


class Soak:
    def __init__(self, daemon: Daemon, amqp_port: int, scale: int, only: list[str] | None = None) -> None:
        self.daemon = daemon
        self.tcp = daemon.address
        self.http = daemon.http_address
        self.amqp_address = ("127.0.0.1", amqp_port)
        self.scale = scale
        #: the cycles of a round: (name, how many per round at scale 1)
        self.plan = [(name, count) for name, count in PLAN if not only or name in only]
        self.cycle = 0
        self.lingering: list[Conn] = []
        self.open_leases: list[str] = []
        self.keepalive = http.client.HTTPConnection(*self.http, timeout=30)
        for channel in [*CHANNELS, LEASE_CHANNEL]:  # so that every publish has somewhere to go, and is emptied
            self.request("POST", f"/channel/create?topic={TOPIC}&channel={channel}")
        self.request("POST", f"/channel/create?topic={AMQP_TOPIC}&channel=a")
        self.request("POST", f"/topic/create?topic={FULL_TOPIC}")
        self.request("POST", f"/topic/limits?topic={FULL_TOPIC}&max_messages=1&overflow=reject")
        self.request("POST", f"/pub?topic={FULL_TOPIC}", b"fills it")
        #: long-lived connections that publish replies to requesters' ephemeral topics
        self.reply_server: Conn | None = None
        self.amqp_server = None

    # ------------------------------------------------------------ helpers
    def conn(self, upgrade: dict | None = None, **identify) -> Conn:
        features = dict(upgrade or {})
        if features.get("tls"):
            features["tls"] = self.daemon.ca_file
        return Conn(self.tcp, "soak", features, identify)

    def request(self, method: str, path: str, body: bytes = b"", keepalive: bool = True) -> int:
        if keepalive:
            conn = self.keepalive
        else:
            conn = http.client.HTTPConnection(*self.http, timeout=30)
        conn.request(method, path, body=body, headers={} if keepalive else {"Connection": "close"})
        response = conn.getresponse()
        response.read()
        if not keepalive:
            conn.close()
        return response.status

    def stats(self) -> dict:
        self.keepalive.request("GET", "/stats?format=json")
        return json.loads(self.keepalive.getresponse().read())

    # ------------------------------------------------------------- cycles
    def consumer(self, i: int) -> None:
        """One consumer's life: SUB, take some, settle some, leave in one of four ways."""
        kind = i % 3
        topic, channel = (TOPIC, CHANNELS[i // 3 % len(CHANNELS)]) if kind == 0 else \
            (TOPIC, f"e{i}#ephemeral") if kind == 1 else (f"soak_e{i}#ephemeral", "c#ephemeral")
        identify = {"heartbeat_interval": 1000} if i % len(UPGRADES) == 5 else {}
        conn = self.conn(UPGRADES[i % len(UPGRADES)], **identify)
        conn.subscribe(topic, channel)
        conn.send(mpub(topic, [b"m%d" % n for n in range(8)]))
        conn.expect_ok("MPUB")
        conn.send(command("RDY", "6"))
        ids = messages(conn, 6)
        conn.send(b"".join([command("FIN", ids[0].decode()), command("FIN", ids[1].decode()),
                            command("FIN", ids[2].decode()), command("REQ", ids[3].decode(), "0"),
                            command("REQ", ids[4].decode(), "200"), command("TOUCH", ids[5].decode())]))
        end = (i // 3) % 4
        if end == 0:
            rst(conn.sock)
        elif end == 1:
            conn.send(b"CLS\n")
            while conn.frame() != (0, b"CLOSE_WAIT"):  # messages may still come first
                pass
            conn.close()
        elif end == 2:
            conn.send(b"FIN 0123")  # a command cut in half
            rst(conn.sock)
        else:
            conn.send(mpub(topic, [b"x" * 1000] * 50) + command("RDY", "100"))
            rst(conn.sock)  # while those are pushed

    def linger(self, i: int) -> None:
        """A consumer that holds its messages past msg_timeout, closed a round later; every other one
        on an ``#ephemeral`` channel of its own, as nsq_tail reads."""
        conn = self.conn(msg_timeout=1000)
        conn.subscribe(TOPIC, CHANNELS[i % len(CHANNELS)] if i % 2 else f"tail{i}#ephemeral")
        conn.send(command("PUB", TOPIC, body=b"held") + command("RDY", "2"))
        self.lingering.append(conn)

    def publisher(self, i: int) -> None:
        conn = self.conn()
        conn.send(command("PUB", TOPIC, body=b"p%d" % i))
        conn.expect_ok("PUB")
        conn.send(mpub(TOPIC, [b"m"] * 20))
        conn.expect_ok("MPUB")
        conn.send(command("DPUB", TOPIC, "100", body=b"d"))
        conn.expect_ok("DPUB")
        bad = i % 4
        if bad == 0:
            conn.send(b"BOGUS\n")
        elif bad == 1:
            conn.send(b"PUB bad!name\n")
        elif bad == 2:
            conn.send(b"MPUB " + TOPIC.encode() + b"\n" + struct.pack(">ii", 8, -1) + b"\x00" * 4)
        else:
            conn.send(b"PUB " + TOPIC.encode() + b"\n" + struct.pack(">i", 1000) + b"y" * 100)
            rst(conn.sock)  # cut mid-body
            return
        try:
            conn.response()
        except BenchError:
            pass  # the error frame, as expected
        conn.close()

    def http_publisher(self, i: int) -> None:
        keep = i % 2 == 0
        assert self.request("POST", f"/pub?topic={TOPIC}", b"h%d" % i, keep) == 200
        body = b"\n".join([b"hm"] * 10)
        assert self.request("POST", f"/mpub?topic={TOPIC}", body, keep) == 200
        assert self.request("POST", f"/pub?topic={TOPIC}&defer=100", b"hd", keep) == 200
        assert self.request("POST", "/pub?topic=bad!name", b"x", keep) == 400
        with socket.create_connection(self.http, timeout=30) as sock:  # a body cut off
            sock.sendall(b"POST /pub?topic=%s HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" % TOPIC.encode()
                         + b"z" * 100)
            rst(sock)

    def admin(self, i: int) -> None:
        keep = i % 2 == 0
        topic = f"soak_admin{i % 7}"
        for path in (f"/topic/create?topic={topic}", f"/channel/create?topic={topic}&channel=a",
                     f"/channel/create?topic={topic}&channel=b", f"/topic/pause?topic={topic}",
                     f"/channel/pause?topic={topic}&channel=a"):
            assert self.request("POST", path, b"", keep) == 200, path
        assert self.request("POST", f"/mpub?topic={topic}", b"a\nb\nc", keep) == 200
        for path in (f"/topic/unpause?topic={topic}", f"/channel/unpause?topic={topic}&channel=a",
                     f"/channel/empty?topic={topic}&channel=a", f"/topic/empty?topic={topic}",
                     f"/channel/delete?topic={topic}&channel=b"):
            assert self.request("POST", path, b"", keep) == 200, path
        assert self.request("POST", f"/channel/delete?topic={topic}&channel=zz", b"", keep) == 404
        assert self.request("POST", f"/topic/delete?topic={topic}", b"", keep) == 200

    def lease(self, i: int) -> None:
        """Open a lease, take messages into it and drop the connection; an earlier lease is
        finished, requeued or left to time out from this connection."""
        conn = self.conn(leases=True, msg_timeout=1000)
        conn.subscribe(TOPIC, LEASE_CHANNEL)
        if self.open_leases:
            name = self.open_leases.pop(0)
            verb = ("LFIN", "LREQ", None)[i % 3]
            if verb:
                conn.send(command(verb, name, *(["0"] if verb == "LREQ" else [])))
                conn.response()
        name = f"l{i}"
        conn.send(command("PUB", TOPIC, body=b"lease") + command("LEASE", name) + command("RDY", "3"))
        conn.response()  # OK of the PUB
        conn.response()  # the lease's JSON
        messages(conn, 1)
        self.open_leases.append(name)
        rst(conn.sock)

    def amqp(self, i: int) -> None:
        from proton import Delivery, Message

        ephemeral = i % 4 == 3
        topic = f"soak_ae{i}#ephemeral" if ephemeral else AMQP_TOPIC
        channel = "c#ephemeral" if ephemeral else "a"
        conn, sock = _amqp_connect(self.amqp_address)
        receiver = conn.create_receiver(f"/topics/{topic}/channels/{channel}", credit=5)
        sender = conn.create_sender(f"/topics/{topic}")
        for n in range(6):
            sender.send(Message(body=b"a%d" % n, inferred=True))
        for _ in range(5):
            receiver.receive(timeout=30)
        receiver.accept()
        receiver.accept()
        receiver.release(delivered=False)
        receiver.fetcher.unsettled[0].local.failed = True
        receiver.settle(Delivery.MODIFIED)  # one stays unsettled
        end = i % 3
        if end == 0:
            sender.close()
            receiver.close()
            conn.close()
        elif end == 1:
            conn.close()
        else:
            rst(sock)  # the client dies: the daemon sees a reset
        with socket.create_connection(self.amqp_address, timeout=30) as sock:  # a header, then a frame cut off
            sock.sendall(b"AMQP\x00\x01\x00\x00" + struct.pack(">IBBH", 512, 2, 0, 0) + b"\x00\x53")
            sock.recv(8)
            rst(sock)

    def reply(self, i: int) -> None:
        """Request and reply: a requester's ephemeral topic, published to by a long-lived server connection."""
        if self.reply_server is None:
            self.reply_server = self.conn()
        requester = self.conn()
        topic = f"reply{i}#ephemeral"
        requester.subscribe(topic, "c#ephemeral")
        requester.send(command("RDY", "1"))
        self.reply_server.send(command("PUB", topic, body=b"reply"))
        self.reply_server.expect_ok("PUB")
        messages(requester, 1)
        requester.close()  # the topic vanishes with its channel

    def amqp_reply(self, i: int) -> None:
        """The same over AMQP: the server attaches a sender per reply, on one long-lived connection."""
        from proton import Message
        from proton.utils import BlockingConnection

        address = f"{self.amqp_address[0]}:{self.amqp_address[1]}"
        if self.amqp_server is None:
            self.amqp_server = BlockingConnection(address, timeout=30)
        requester = BlockingConnection(address, timeout=30)
        topic = f"areply{i}#ephemeral"
        receiver = requester.create_receiver(f"/topics/{topic}/channels/c#ephemeral", credit=1)
        sender = self.amqp_server.create_sender(f"/topics/{topic}")
        sender.send(Message(body=b"reply", inferred=True))
        sender.close()
        receiver.receive(timeout=30)
        receiver.accept()
        requester.close()

    def amqp_full(self, i: int) -> None:
        """A sender attached to a full topic waits for credit; the client gives up and goes."""
        conn, sock = _amqp_connect(self.amqp_address)
        conn.create_sender(f"/topics/{FULL_TOPIC}")
        if i % 2:
            conn.close()
        else:
            rst(sock)

    # -------------------------------------------------------------- round
    def round(self) -> int:
        """One round of cycles; returns how many client life cycles it ran."""
        for conn in self.lingering:
            rst(conn.sock)
        self.lingering = []
        done = 0
        for name, count in self.plan:
            cycle = getattr(self, name)
            for _ in range(count * self.scale):
                cycle(self.cycle)
                self.cycle += 1
                done += 1
        for channel in [*CHANNELS, LEASE_CHANNEL]:
            self.request("POST", f"/channel/empty?topic={TOPIC}&channel={channel}")
        self.request("POST", f"/channel/empty?topic={AMQP_TOPIC}&channel=a")
        return done


def _amqp_connect(address: tuple[str, int]):
    """A proton BlockingConnection and its socket (proton keeps Python sockets), to reset it."""
    from proton.utils import BlockingConnection

    before = _sockets_to(address[1])
    conn = BlockingConnection(f"{address[0]}:{address[1]}", timeout=30)
    (sock,) = [s for s in _sockets_to(address[1]) if s not in before]
    return conn, sock


def _sockets_to(port: int) -> list[socket.socket]:
    import gc
    return [o for o in gc.get_objects() if isinstance(o, socket.socket) and o.fileno() >= 0 and _peer_port(o) == port]


def _peer_port(sock: socket.socket) -> int | None:
    try:
        return sock.getpeername()[1]
    except OSError:
        return None


# ---------------------------------------------------------------- figures
def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise BenchError("no VmRSS")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def counts(stats: dict) -> tuple[int, int, int]:
    topics = stats["topics"]
    channels = sum(len(t["channels"]) for t in topics)
    clients = sum(len(c["clients"]) for t in topics for c in t["channels"]) + len(stats.get("producers", []))
    return len(topics), channels, clients


def slope(values: list[float]) -> float:
    """Least-squares growth per round."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sum((x - mean_x) ** 2 for x in range(n))


class Diagnosis:
    """The daemon's own figures (see ``DIAGNOSE_ENTRY``); with tracemalloc, what grew since the first."""

    def __init__(self, pid: int, path: Path) -> None:
        self.pid, self.path, self.base = pid, path, None

    def take(self):
        self.path.unlink(missing_ok=True)
        os.kill(self.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 120
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise BenchError("no diagnosis dump from the daemon")
            time.sleep(0.05)
        with open(self.path, "rb") as f:
            return pickle.load(f)

    def figures(self) -> str:
        figures = self.take()[0]
        return (f"  malloc used {figures['malloc_used'] / 1024:8.0f} KiB  free {figures['malloc_free'] / 1024:6.0f} KiB"
                f"  python blocks {figures['python_blocks']}")

    def report(self, top: int = 12) -> None:
        _, counts_now, snapshot = self.take()
        if self.base is None:
            self.base = counts_now, snapshot
            return
        counts_then, snapshot_then = self.base
        grown = collections.Counter(counts_now)
        grown.subtract(counts_then)
        print("  objects grown:", ", ".join(f"{name} +{n}" for name, n in grown.most_common(top) if n > 0))
        for diff in snapshot.compare_to(snapshot_then, "traceback")[:top]:
            if diff.size_diff <= 0:
                continue
            frames = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in list(diff.traceback)[-4:][::-1])
            print(f"  {diff.size_diff / 1024:+9.1f} KiB {diff.count_diff:+7d} blocks  {frames}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of rounds (default 180)")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many rounds instead")
    p.add_argument("--warmup", type=int, default=10, help="rounds left out of the trend (default 10)")
    p.add_argument("--scale", type=int, default=1, help="cycles per round, multiplied (default 1)")
    p.add_argument("--only", default="", help="comma-separated cycles to run (default: all of "
                   + ", ".join(name for name, _ in PLAN) + ")")
    p.add_argument("--durable", action="store_true", help="run the daemon with --durable")
    p.add_argument("--nsqd-args", default="", help="more daemon flags")
    p.add_argument("--malloc", action="store_true",
                   help="print the daemon's malloc bytes in use and free, and Python's blocks, every round")
    p.add_argument("--diagnose", action="store_true", help="tracemalloc in the daemon: print what grew")
    p.add_argument("--every", type=int, default=10, help="rounds between diagnoses (default 10)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    amqp_port = free_port()
    args = [f"--amqp-address=127.0.0.1:{amqp_port}", "--log-level=warn", *opts.nsqd_args.split()]
    if opts.durable:
        args.append("--durable")
    dump = Path(f"/tmp/soak-dump-{os.getpid()}.pickle")
    instrumented = opts.diagnose or opts.malloc
    os.environ.update(SOAK_DUMP=str(dump), SOAK_TRACE="1" if opts.diagnose else "0")
    daemon = Daemon(args, keep=False, tls=True, entry=("-c", DIAGNOSE_ENTRY) if instrumented else ("-m", "nsqd"))
    soak = Soak(daemon, amqp_port, opts.scale, [n for n in opts.only.split(",") if n])
    diagnosis = Diagnosis(daemon.pid, dump) if instrumented else None
    rss: list[int] = []
    fds: list[int] = []
    try:
        t0 = time.monotonic()
        number = 0
        while (opts.rounds and number < opts.rounds) or (not opts.rounds and time.monotonic() - t0 < opts.duration):
            start = time.monotonic()
            cycles = soak.round()
            time.sleep(0.3)  # the daemon notices the last hang-ups
            number += 1
            rss.append(rss_kib(daemon.pid))
            fds.append(fd_count(daemon.pid))
            topics, channels, clients = counts(soak.stats())
            print(f"round {number:4d}: rss {rss[-1] / 1024:7.1f} MiB  fds {fds[-1]:4d}  topics {topics:3d}  "
                  f"channels {channels:3d}  clients {clients:3d}  {cycles} cycles in "
                  f"{time.monotonic() - start:5.2f} s  ({number / (time.monotonic() - t0):.2f} rounds/s)"
                  + (diagnosis.figures() if opts.malloc else ""), flush=True)
            if opts.diagnose and (number == opts.warmup or
                                  (number > opts.warmup and (number - opts.warmup) % opts.every == 0)):
                diagnosis.report()
    finally:
        daemon.stop()
        dump.unlink(missing_ok=True)
    after = rss[opts.warmup:]
    if len(after) >= 2:
        print(f"after warm-up ({len(after)} rounds, {soak.cycle} cycles in all): rss {after[0] / 1024:.1f} → "
              f"{after[-1] / 1024:.1f} MiB (max {max(after) / 1024:.1f}), trend {slope(after):+.1f} KiB/round; "
              f"fds {fds[opts.warmup]} → {fds[-1]} (max {max(fds[opts.warmup:])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
