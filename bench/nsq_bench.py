#!/usr/bin/env python3
"""TCP load generator for nsqd, after Go nsq's ``bench_writer`` and ``bench_reader``.

Plain blocking sockets and pre-encoded commands, so the generator costs little
per message; connections are spread over worker processes (``--procs`` per
role) when one process cannot keep up.

Modes (``--mode``):

* ``pub``      writers send synchronous MPUBs (``--batch`` x ``--size`` bytes;
               ``--batch 1`` sends single PUBs) and wait for ``OK``, for
               ``--duration`` seconds; each connection publishes again as
               soon as its own OK arrives, as bench_writer's goroutines do
               (``--writers 100`` is 100 independent publishers);
* ``sub``      readers on one channel with ``RDY --rdy`` FIN every message,
               until ``--count`` messages or ``--duration``;
* ``both``     writers and readers at once (own topic);
* ``latency``  writers paced at ``--rate`` msgs/s stamp each body with the send
               time; readers report end-to-end latency percentiles;
* ``all``      pub, sub (draining what pub left), both, then latency at half
               the measured both-rate, and a summary table.

``--backlog N`` publishes N messages with no consumer and reports the daemon's
memory. ``--spawn`` starts the daemon on free ports with a fresh data dir;
with it (or ``--pid``) each phase reports the daemon's CPU time per message
and RSS (from /proc), and how the machine's CPUs were shared between the
daemon, the generator and other processes. ``--py-spy FILE`` profiles the
daemon. ``--self-test`` runs every mode briefly and checks the counts add up.

``--tls``, ``--snappy`` and ``--deflate`` negotiate nsqd's stream upgrades in
IDENTIFY on every connection, writers' and readers' (TLS first, then one
compression). With ``--spawn --tls`` the daemon gets a throwaway trustme
certificate for 127.0.0.1 and the clients verify it against that CA. The
generator stays on raw sockets: TLS through memory BIOs, one compression call
per write (a whole MPUB, all the FINs of one read) and one decryption and
decompression per socket read; each phase adds a ``wire`` line (bytes before
and after the layers). ``--body random`` sends incompressible bodies.

Result lines have a fixed shape, e.g.::

    pub publish: 447872 msgs/s (89.6 MB/s) over 8.00 s [3583200 msgs, 2 conns, 1 procs, generator cpu 1.08 s]
    pub daemon: cpu 8.44 s (1.70 s sys), 2.36 us/msg (msgs = published + consumed), rss 41.4 MB, ...
    pub machine: 2 cpus, busy 1.21 = nsqd 1.05 + generator 0.13 + other 0.02 (cpus, averaged over 8.0 s)
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import queue
import selectors
import shlex
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import zlib
from array import array
from pathlib import Path

try:
    import snappy  # python-snappy, only for --snappy
except ImportError:  # pragma: no cover
    snappy = None

REPO = Path(__file__).resolve().parent.parent
MAGIC = b"  V2"
HEARTBEAT = b"_heartbeat_"
FRAME_RESPONSE, FRAME_ERROR, FRAME_MESSAGE = 0, 1, 2
HDR = struct.Struct(">II")  # frame size (counts type + data), frame type
U32 = struct.Struct(">I")
I64 = struct.Struct(">q")
RECV_SIZE = 256 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    pass


# ---------------------------------------------------------------- wire format
def command(verb: str, *args: str, body: bytes | None = None) -> bytes:
    line = " ".join((verb,) + args).encode() + b"\n"
    return line if body is None else line + U32.pack(len(body)) + body


def mpub(topic: str, bodies: list[bytes]) -> bytes:
    parts = [U32.pack(len(bodies))]
    for body in bodies:
        parts += (U32.pack(len(body)), body)
    return command("MPUB", topic, body=b"".join(parts))


def features_of(opts) -> dict:
    """The stream upgrades a connection asks for: ``tls`` (CA file, or True for the
    system store), ``snappy``, ``deflate`` (the level, 0 for none)."""
    return {"tls": (opts.tls_ca_file or True) if opts.tls else False, "snappy": opts.snappy,
            "deflate": opts.deflate_level if opts.deflate else 0}


@functools.lru_cache(maxsize=None)
def tls_context(cafile) -> ssl.SSLContext:
    """Client context verifying nsqd's certificate (and its host name or IP)."""
    return ssl.create_default_context(cafile=cafile if isinstance(cafile, str) else None)


class Conn:
    """One blocking connection with a small frame reader for the control path.

    ``features`` (see :func:`features_of`) asks for nsqd's stream upgrades in
    IDENTIFY: TLS, then snappy or deflate on top of it. Upgraded connections
    still use one raw ``recv`` / ``sendall`` per read and write: TLS goes
    through memory BIOs (everything one ``recv`` brought is decrypted at once),
    and each write (a whole MPUB, all the FINs of one read) is compressed as one
    piece. ``send(data)`` and ``recv()`` (plain bytes of one socket read, maybe
    empty while a compressed chunk or TLS record is incomplete) hide the layers;
    on a plain connection they are the socket's own calls. ``identify`` adds
    fields to the IDENTIFY JSON (``msg_timeout``, ``heartbeat_interval``, ``leases``).
    """

    def __init__(self, address: tuple[str, int], client_id: str, features: dict | None = None,
                 identify: dict | None = None) -> None:
        self.sock = socket.create_connection(address, timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.send = self.sock.sendall
        self.recv = self._recv_plain
        self.tls = self._encrypt = self._decompress = None
        self.compression = ""
        #: bytes through the layers (plain) and on the socket (wire), upgraded connections only
        self.plain_sent = self.wire_sent = self.plain_received = self.wire_received = 0
        f = features or {}
        negotiate = bool(f.get("tls") or f.get("snappy") or f.get("deflate"))
        ident = {"client_id": client_id, "hostname": client_id, "user_agent": "nsq_bench/1.0",
                 "feature_negotiation": negotiate}
        if negotiate:
            ident.update(tls_v1=bool(f.get("tls")), snappy=bool(f.get("snappy")),
                         deflate=bool(f.get("deflate")), deflate_level=f.get("deflate") or 6)
        ident.update(identify or {})
        self.sock.sendall(MAGIC + command("IDENTIFY", body=json.dumps(ident).encode()))
        if not negotiate:
            self.expect_ok("IDENTIFY")
            return
        reply = json.loads(self.response())
        for key in ("tls_v1", "snappy", "deflate"):
            if bool(reply.get(key)) != ident[key]:
                raise BenchError(f"IDENTIFY: asked for {key}={ident[key]}, nsqd answered {reply.get(key)!r}"
                                 + (" (start nsqd with --tls-cert and --tls-key)" if key == "tls_v1" else ""))
        if self.buf and f.get("tls"):  # nsqd waits for our ClientHello
            raise BenchError("IDENTIFY: data after the response, before the TLS handshake")
        self.send, self.recv = self._send_layers, self._recv_layers
        if f.get("tls"):
            self._start_tls(tls_context(f["tls"]), address[0])
            self.expect_ok("TLS upgrade")
        if f.get("snappy") or f.get("deflate"):
            self._start_compression(f)
            self.expect_ok("compression upgrade")
        self.plain_sent = self.wire_sent = self.plain_received = self.wire_received = 0

    # -- layers
    def _start_tls(self, context: ssl.SSLContext, host: str) -> None:
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(self._in, self._out, server_hostname=host)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                if self._out.pending:
                    self.sock.sendall(self._out.read())
                data = self.sock.recv(RECV_SIZE)
                if not data:
                    raise BenchError("connection closed by nsqd during the TLS handshake") from None
                self._in.write(data)
        if self._out.pending:
            self.sock.sendall(self._out.read())
        self.tls = tls
        self._encrypt = tls.write
        self.buf = self._decrypt(b"")  # the OK may have come with the last handshake record

    def _decrypt(self, data: bytes) -> bytes:
        if data:
            self._in.write(data)
        chunks, read = [], self.tls.read
        try:
            while True:  # one TLS record per read
                chunks.append(read(RECV_SIZE))
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            raise BenchError("connection closed by nsqd (TLS close_notify)") from None
        if self._out.pending:  # post-handshake messages that want an answer
            self.sock.sendall(self._out.read())
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _start_compression(self, f: dict) -> None:
        if f.get("snappy"):
            self._compress = snappy.StreamCompressor().add_chunk
            self._decompress = snappy.StreamDecompressor().decompress
            self.compression = "snappy"
        else:
            comp = zlib.compressobj(f["deflate"], zlib.DEFLATED, -15)
            c, flush = comp.compress, comp.flush
            self._compress = lambda data: c(data) + flush(zlib.Z_SYNC_FLUSH)
            self._decompress = zlib.decompressobj(-15).decompress
            self.compression = f"deflate level {f['deflate']}"
        # whatever came after the upgrade's OK in the last read is already compressed
        self.buf = self._decompress(self.buf) if self.buf else b""

    def _recv_plain(self) -> bytes:
        data = self.sock.recv(RECV_SIZE)
        if not data:
            raise BenchError("connection closed by nsqd")
        return data

    def _recv_layers(self) -> bytes:
        data = self.sock.recv(RECV_SIZE)
        if not data:
            raise BenchError("connection closed by nsqd")
        self.wire_received += len(data)
        if self.tls is not None:
            data = self._decrypt(data)
        if self._decompress is not None and data:
            data = self._decompress(data)
        self.plain_received += len(data)
        return data

    def _send_layers(self, data: bytes) -> None:
        self.plain_sent += len(data)
        if self._decompress is not None:
            data = self._compress(data)
        if self.tls is not None:
            self._encrypt(data)
            data = self._out.read()
        self.wire_sent += len(data)
        self.sock.sendall(data)

    def describe(self) -> str:
        """The negotiated upgrades, e.g. ``tls TLSv1.3 TLS_AES_256_GCM_SHA384 + snappy``."""
        parts = [f"tls {self.tls.version()} {self.tls.cipher()[0]}"] if self.tls is not None else []
        if self.compression:
            parts.append(self.compression)
        return " + ".join(parts) or "plain"

    def io_counts(self) -> tuple[int, int, int, int]:
        return self.plain_sent, self.wire_sent, self.plain_received, self.wire_received

    # -- frames
    def frame(self) -> tuple[int, bytes]:
        """The next frame, reading the socket until it is whole."""
        while True:
            ftype, data = self.take_frame()
            if ftype is not None:
                return ftype, data
            self.buf += self.recv()

    def take_frame(self) -> tuple[int | None, bytes]:
        """The next frame already received, or ``(None, b"")`` (never reads the socket)."""
        buf = self.buf
        if len(buf) >= 8:
            size, ftype = HDR.unpack_from(buf)
            if len(buf) >= 4 + size:
                self.buf = buf[4 + size:]
                return ftype, buf[8:4 + size]
        return None, b""

    def response(self) -> bytes:
        """The next response frame, answering heartbeats on the way."""
        while True:
            ftype, data = self.frame()
            if ftype == FRAME_ERROR:
                raise BenchError(f"nsqd error: {data.decode(errors='replace')}")
            if ftype == FRAME_RESPONSE and data == HEARTBEAT:
                self.send(b"NOP\n")
                continue
            if ftype == FRAME_RESPONSE:
                return data
            raise BenchError(f"unexpected frame type {ftype}")

    def expect_ok(self, what: str) -> None:
        data = self.response()
        if data != b"OK":
            raise BenchError(f"{what}: expected OK, got {data[:80]!r}")

    def subscribe(self, topic: str, channel: str) -> None:
        self.send(command("SUB", topic, channel))
        self.expect_ok("SUB")

    def close(self) -> None:
        self.sock.close()


def ensure_channel(address, topic: str, channel: str, features: dict | None = None) -> None:
    """Create the topic and channel (as bench.sh does over HTTP) with a SUB and no RDY."""
    conn = Conn(address, "bench-setup", features)
    conn.subscribe(topic, channel)
    conn.close()


def io_totals(conns) -> tuple:
    return tuple(sum(c) for c in zip(*(conn.io_counts() for conn in conns)))


# ---------------------------------------------------------------- workers
def pub_worker(spec: dict, start, results) -> None:
    """Synchronous MPUB (or PUB) publishers, each independent, as bench_writer's pubWorker goroutines.

    In latency mode (``rate``) the writer instead paces rounds: a send on
    every connection, then every OK.
    """
    try:
        address, topic, batch, size = spec["address"], spec["topic"], spec["batch"], spec["size"]
        conns = [Conn(address, "writer", spec["features"]) for _ in range(spec["conns"])]
        rate, limit = spec["rate"], spec["limit"]
        if spec["body"] == "random":  # distinct bodies, no repeat within a compressor's window
            payloads = [mpub(topic, [os.urandom(size) for _ in range(batch)])
                        for _ in range(max(4, -(-256 * 1024 // (batch * size))))]
        elif batch == 1:
            payloads = [command("PUB", topic, body=b"x" * size)]
        else:
            payloads = [mpub(topic, [b"x" * size] * batch)]
        results.put(("ready", spec["id"], None))
        start.wait()
        cpu0, t0 = time.process_time(), time.monotonic()
        end = t0 + spec["duration"]
        if rate:
            sent = publish_paced(conns, topic, batch, size, rate, t0, end, limit)
        else:
            sent = publish_independently(conns, payloads, batch, end, limit)
        t1 = time.monotonic()
        for conn in conns:
            conn.close()
        results.put(("done", spec["id"], {"role": "pub", "msgs": sent, "t0": t0, "t1": t1,
                                          "cpu": time.process_time() - cpu0, "io": io_totals(conns)}))
    except BaseException:
        results.put(("error", spec["id"], traceback.format_exc()))


def publish_paced(conns, topic: str, batch: int, size: int, rate: float, t0: float, end: float,
                  limit: int) -> int:
    """Latency mode: rounds at ``rate``, each body starting with its send time (CLOCK_MONOTONIC, ns)."""
    prefix = f"MPUB {topic}\n".encode() + U32.pack(4 + batch * (4 + size)) + U32.pack(batch)
    item_head, pad = U32.pack(size), b"x" * (size - 8)
    interval = batch * len(conns) / rate
    sent = rounds = 0
    while True:
        due = t0 + rounds * interval
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        payload = prefix + (item_head + I64.pack(time.monotonic_ns()) + pad) * batch
        for conn in conns:
            conn.send(payload)
        for conn in conns:
            conn.expect_ok("MPUB")
        rounds += 1
        sent += batch * len(conns)
        if time.monotonic() >= end or (limit and sent >= limit):
            return sent


def publish_independently(conns, payloads: list[bytes], batch: int, end: float, limit: int) -> int:
    """Each connection publishes again as soon as its own OK arrives.

    One epoll wait serves every connection whose answer came in; returns the
    messages confirmed. After ``end`` (or ``limit``) nothing more is sent
    and the outstanding answers are read.
    """
    selector = selectors.DefaultSelector()
    by_fd = {}
    turn = 0
    for conn in conns:
        selector.register(conn.sock, selectors.EVENT_READ)
        by_fd[conn.sock.fileno()] = conn
        conn.send(payloads[turn % len(payloads)])
        turn += 1
    waiting, confirmed, sending = len(conns), 0, True
    try:
        while waiting:
            events = selector.select(timeout=30)
            if not events:
                raise BenchError(f"no answer from nsqd in 30 s ({waiting} publishes outstanding)")
            for key, _ in events:
                conn = by_fd[key.fd]
                conn.buf += conn.recv()
                while True:
                    ftype, data = conn.take_frame()
                    if ftype is None:
                        break
                    if ftype == FRAME_RESPONSE and data == HEARTBEAT:
                        conn.send(b"NOP\n")
                        continue
                    if ftype != FRAME_RESPONSE or data != b"OK":
                        raise BenchError(f"publish: expected OK, got {data[:80]!r}")
                    confirmed += batch
                    if sending and (time.monotonic() >= end or (limit and confirmed + waiting * batch > limit)):
                        sending = False
                    if sending:
                        conn.send(payloads[turn % len(payloads)])
                        turn += 1
                    else:
                        waiting -= 1
    finally:
        selector.close()
    return confirmed


def sub_worker(spec: dict, start, results, counters, target) -> None:
    """Read messages and FIN each; one FIN write per socket read, as bench_reader's bufio."""
    try:
        conns = [Conn(spec["address"], "reader", spec["features"]) for _ in range(spec["conns"])]
        for conn in conns:
            conn.subscribe(spec["topic"], spec["channel"])
        latency = array("q") if spec["latency"] else None
        slot = spec["slot"]
        sel = selectors.DefaultSelector()
        for conn in conns:
            conn.sock.settimeout(None)
            sel.register(conn.sock, selectors.EVENT_READ, conn)
        results.put(("ready", spec["id"], None))
        start.wait()
        cpu0, t0 = time.process_time(), time.monotonic()
        end = t0 + spec["duration"]
        rdy = command("RDY", str(spec["rdy"]))
        for conn in conns:
            conn.send(rdy)
        got = 0
        t1 = t0
        unpack, stamp = HDR.unpack_from, I64.unpack_from
        while True:
            for key, _ in sel.select(0.05):
                conn = key.data
                data = conn.recv()  # plain bytes of one socket read (decrypted, decompressed)
                if conn.buf:
                    data = conn.buf + data
                now = time.monotonic_ns()
                ids = []
                append = ids.append
                n, p = len(data), 0
                while n - p >= 8:
                    size, ftype = unpack(data, p)
                    q = p + 4 + size
                    if q > n:
                        break
                    if ftype == FRAME_MESSAGE:  # ts(8) attempts(2) id(16) body
                        append(data[p + 18:p + 34])
                        if latency is not None:
                            latency.append(now - stamp(data, p + 34)[0])
                    elif ftype == FRAME_RESPONSE:
                        if data[p + 8:q] == HEARTBEAT:
                            conn.send(b"NOP\n")
                    else:
                        raise BenchError(f"nsqd error: {data[p + 8:q].decode(errors='replace')}")
                    p = q
                conn.buf = data[p:]
                if ids:
                    conn.send(b"FIN " + b"\nFIN ".join(ids) + b"\n")
                    got += len(ids)
                    t1 = time.monotonic()
            counters[slot] = got
            if t1 >= end or time.monotonic() >= end or sum(counters) >= target.value:
                break
        for conn in conns:
            conn.close()
        results.put(("done", spec["id"], {"role": "sub", "msgs": got, "t0": t0, "t1": t1,
                                          "cpu": time.process_time() - cpu0, "io": io_totals(conns),
                                          "latency": latency.tobytes() if latency is not None else b""}))
    except BaseException:
        results.put(("error", spec["id"], traceback.format_exc()))


# ---------------------------------------------------------------- the daemon
def proc_stats(pid: int | None) -> dict:
    """CPU seconds (utime + stime) and VmRSS / VmHWM in MB of a process, from /proc."""
    if not pid:
        return {}
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        user, system = int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK
        stats = {"cpu": user + system, "sys": system}
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    stats[key] = int(value.split()[0]) / 1024
        return stats
    except OSError:
        return {}


def machine_busy() -> float:
    """CPU-seconds all CPUs have spent busy since boot (/proc/stat, less idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK


def _ports_outside_ephemeral_range() -> range:
    """Ports no outgoing connection is given, so none can take a daemon's port before it listens."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(10000, low) if low - 10000 >= 4096 else range(high + 1, 65536)


_PORTS = _ports_outside_ephemeral_range()
_next_port = _PORTS.start + (os.getpid() * 7919) % len(_PORTS)


def free_port() -> int:
    """A port free now, outside the ephemeral range, never the same twice in one process."""
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


def wait_for_port(address, proc, log_path, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"nsqd exited with {proc.returncode}:\n{Path(log_path).read_text()[-3000:]}")
        try:
            socket.create_connection(address, timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise BenchError(f"nsqd not listening on {address[0]}:{address[1]} after {timeout} s")


class Daemon:
    """``python -m nsqd`` on free loopback ports with a fresh data dir; SIGTERM on stop."""

    def __init__(self, extra_args: list[str], keep: bool, tls: bool = False,
                 entry: tuple[str, ...] = ("-m", "nsqd")) -> None:
        self.keep = keep
        self.tmp = Path(tempfile.mkdtemp(prefix="nsq_bench."))
        self.address = ("127.0.0.1", free_port())
        self.http_address = ("127.0.0.1", free_port())
        self.log_path = self.tmp / "nsqd.log"
        self.ca_file = ""
        if tls:
            extra_args = [*self._certificate(), *extra_args]
        cmd = [sys.executable, *entry, "--tcp-address", f"127.0.0.1:{self.address[1]}",
               "--http-address", f"127.0.0.1:{self.http_address[1]}", "--data-path", str(self.tmp / "data"),
               "--https-address=", "--amqp-address=", *extra_args]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        print(f"nsqd: pid {self.pid} on {self.address[0]}:{self.address[1]}: {shlex.join(cmd)}", flush=True)
        wait_for_port(self.address, self.proc, self.log_path)

    def _certificate(self) -> list[str]:
        """A throwaway CA (trustme) and a certificate for 127.0.0.1 signed by it."""
        try:
            import trustme
        except ImportError:
            raise BenchError("--tls with --spawn needs the trustme package (pip install trustme)") from None
        ca = trustme.CA()
        cert = ca.issue_cert(self.address[0])
        cert_file, key_file = self.tmp / "nsqd-cert.pem", self.tmp / "nsqd-key.pem"
        self.ca_file = str(self.tmp / "ca.pem")
        ca.cert_pem.write_to_path(self.ca_file)
        for i, pem in enumerate(cert.cert_chain_pems):
            pem.write_to_path(str(cert_file), append=i > 0)
        cert.private_key_pem.write_to_path(str(key_file))
        return ["--tls-cert", str(cert_file), "--tls-key", str(key_file)]

    def data_bytes(self) -> int:
        return sum(f.stat().st_size for f in (self.tmp / "data").rglob("*") if f.is_file())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
            print(f"nsqd: exited with {code} after SIGTERM", flush=True)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            print("nsqd: did not exit within 60 s of SIGTERM; killed", flush=True)
        if self.keep:
            print(f"nsqd: data and log kept in {self.tmp}", flush=True)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


# ---------------------------------------------------------------- phases
def split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def percentile(sorted_values: array, fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def run_phase(opts, pid, name, topic, *, writers=0, readers=0, rate=0.0, limit=0,
              target=0, duration=None, reader_grace=0.0) -> dict:
    """Run writer and reader processes together; print and return the figures."""
    ctx = mp.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    duration = opts.duration if duration is None else duration
    reader_procs = split(readers, opts.procs) if readers else []
    counters = ctx.Array("q", max(1, len(reader_procs)), lock=False)
    shared_target = ctx.Value("q", target or 2 ** 62, lock=False)
    specs = []
    for i, n in enumerate(reader_procs):
        specs.append(("sub", {"id": len(specs), "slot": i, "address": opts.address, "topic": topic,
                              "channel": opts.channel, "conns": n, "rdy": opts.rdy,
                              "duration": duration + reader_grace, "latency": bool(rate),
                              "features": opts.features}))
    writer_procs = split(writers, opts.procs) if writers else []
    for n in writer_procs:
        share = -(-limit * n // writers) if limit else 0
        specs.append(("pub", {"id": len(specs), "address": opts.address, "topic": topic, "conns": n,
                              "batch": opts.batch, "size": opts.size, "duration": duration,
                              "rate": rate * n / writers if rate else 0.0, "limit": share, "body": opts.body,
                              "features": opts.features}))
    procs = []
    for role, spec in specs:
        if role == "sub":
            args = (spec, start, results, counters, shared_target)
            procs.append(ctx.Process(target=sub_worker, args=args, daemon=True))
        else:
            procs.append(ctx.Process(target=pub_worker, args=(spec, start, results), daemon=True))
    for p in procs:
        p.start()
    done: dict[int, dict] = {}
    try:
        ready = 0
        while ready < len(procs):
            kind, wid, payload = results.get(timeout=60)
            if kind == "error":
                raise BenchError(f"{name}: worker failed during setup:\n{payload}")
            ready += 1
        before, busy0, t_start = proc_stats(pid), machine_busy(), time.monotonic()
        syncs0 = fsyncs(opts)
        start.set()
        pub_ids = {spec["id"] for role, spec in specs if role == "pub"}
        grace = duration + reader_grace + 120 + (opts.timeout if limit else 0)
        while len(done) < len(procs):
            kind, wid, payload = results.get(timeout=grace)
            if kind == "error":
                raise BenchError(f"{name}: worker failed:\n{payload}")
            done[wid] = payload
            if rate and pub_ids and pub_ids <= done.keys():  # latency readers stop once all is read
                shared_target.value = sum(done[i]["msgs"] for i in pub_ids)
        after, busy1, wall = proc_stats(pid), machine_busy(), time.monotonic() - t_start
        syncs1 = fsyncs(opts)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    out = report(name, opts, done.values(), writers, readers, before, after, rate)
    gen = sum(r["cpu"] for r in done.values())
    nsqd = after["cpu"] - before["cpu"] if before and after else 0.0
    other = busy1 - busy0 - gen - nsqd
    who = "nsqd" if before else "nsqd (no --pid: counted in other)"
    print(f"{name} machine: {os.cpu_count()} cpus, busy {(busy1 - busy0) / wall:.2f} = {who} {nsqd / wall:.2f}"
          f" + generator {gen / wall:.2f} + other {other / wall:.2f} (cpus, averaged over {wall:.1f} s)",
          flush=True)
    out["machine"] = {"busy": (busy1 - busy0) / wall, "other": other / wall}
    if syncs0 is not None and syncs1 is not None:
        out["fsyncs"] = (syncs1 - syncs0) / wall
        print(f"{name} disk: {out['fsyncs']:.0f} fsyncs/s ({syncs1 - syncs0} over {wall:.1f} s)", flush=True)
    return out


def fsyncs(opts) -> int | None:
    """The daemon's fsync count (``nsqd_disk_fsyncs_total`` on /metrics), when its HTTP address is known."""
    if not opts.http_address:
        return None
    try:
        with urllib.request.urlopen(f"http://{opts.http_address}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("nsqd_disk_fsyncs_total "):
                    return int(float(line.split()[1]))
    except OSError:
        return None
    return None


def _rate(role_results, size):
    if not role_results:
        return None
    msgs = sum(r["msgs"] for r in role_results)
    secs = max(r["t1"] for r in role_results) - min(r["t0"] for r in role_results)
    return {"msgs": msgs, "secs": secs, "rate": msgs / secs if secs > 0 else 0.0,
            "mbps": msgs * size / secs / 1e6 if secs > 0 else 0.0,
            "gen_cpu": sum(r["cpu"] for r in role_results),
            "io": tuple(sum(c) for c in zip(*(r["io"] for r in role_results)))}


def report(name, opts, results, writers, readers, before, after, rate) -> dict:
    results = list(results)
    out = {"phase": name}
    for role, word, conns in (("pub", "publish", writers), ("sub", "consume", readers)):
        fig = _rate([r for r in results if r["role"] == role], opts.size)
        if fig is None:
            continue
        out[role] = fig
        nprocs = len(split(conns, opts.procs))
        print(f"{name} {word}: {fig['rate']:.0f} msgs/s ({fig['mbps']:.1f} MB/s) over {fig['secs']:.2f} s "
              f"[{fig['msgs']} msgs, {conns} conns, {nprocs} procs, generator cpu {fig['gen_cpu']:.2f} s]",
              flush=True)
    if opts.features_label != "plain":
        parts = []
        for role, who in (("pub", "writers"), ("sub", "readers")):
            if role in out and out[role]["io"]:
                ps, ws, pr, wr = out[role]["io"]
                parts.append(f"{who} sent {ps / 1e6:.1f} MB as {ws / 1e6:.1f} MB, "
                             f"received {pr / 1e6:.1f} MB as {wr / 1e6:.1f} MB")
        print(f"{name} wire: {opts.features_label}; {'; '.join(parts)}", flush=True)
    if rate:
        lat = array("q")
        for r in results:
            if r["role"] == "sub":
                lat.frombytes(r["latency"])
        lat = array("q", sorted(lat))
        if lat:
            ms = {k: percentile(lat, f) / 1e6 for k, f in (("p50", .5), ("p90", .9), ("p99", .99))}
            ms["max"] = lat[-1] / 1e6
            out["latency"] = ms
            print(f"{name} latency: p50 {ms['p50']:.2f} ms, p90 {ms['p90']:.2f} ms, p99 {ms['p99']:.2f} ms, "
                  f"max {ms['max']:.2f} ms [{len(lat)} msgs, target {rate:.0f} msgs/s]", flush=True)
    if before and after:
        msgs = sum(out[r]["msgs"] for r in ("pub", "sub") if r in out)
        cpu, system = after["cpu"] - before["cpu"], after["sys"] - before["sys"]
        out["daemon"] = {"cpu": cpu, "us_per_msg": cpu / msgs * 1e6 if msgs else 0.0,
                         "rss": after["VmRSS"], "hwm": after["VmHWM"]}
        print(f"{name} daemon: cpu {cpu:.2f} s ({system:.2f} s sys), {out['daemon']['us_per_msg']:.2f} us/msg "
              f"(msgs = published + consumed), rss {after['VmRSS']:.1f} MB, "
              f"peak rss {after['VmHWM']:.1f} MB", flush=True)
    return out


def phase_topic(opts, phase: str) -> str:
    return opts.topic if phase in ("pub", "sub") else f"{opts.topic}_{phase}"


def run_backlog(opts, pid, daemon) -> dict:
    """Publish ``--backlog`` messages into a channel nobody reads; report memory."""
    topic = phase_topic(opts, "backlog")
    ensure_channel(opts.address, topic, opts.channel, opts.features)
    out = run_phase(opts, pid, "backlog", topic, writers=opts.writers, limit=opts.backlog,
                    duration=opts.timeout)
    time.sleep(3)  # let the daemon settle (moves to disk, GC)
    stats = proc_stats(pid)
    if stats:
        disk = f", data dir {daemon.data_bytes() / 1e6:.1f} MB" if daemon else ""
        print(f"backlog memory: rss {stats['VmRSS']:.1f} MB, peak rss {stats['VmHWM']:.1f} MB "
              f"with {out['pub']['msgs']} msgs queued{disk}", flush=True)
        out["memory"] = stats
    return out


def run_mode(opts, pid, daemon) -> list[dict]:
    w, r = opts.writers, opts.readers
    if opts.backlog:
        return [run_backlog(opts, pid, daemon)]
    if opts.mode == "pub":
        ensure_channel(opts.address, opts.topic, opts.channel, opts.features)
        return [run_phase(opts, pid, "pub", opts.topic, writers=w)]
    if opts.mode == "sub":
        return [run_phase(opts, pid, "sub", opts.topic, readers=r, target=opts.count)]
    if opts.mode == "both":
        return [run_phase(opts, pid, "both", phase_topic(opts, "both"), writers=w, readers=r)]
    if opts.mode == "latency":
        return [run_phase(opts, pid, "lat", phase_topic(opts, "lat"), writers=w, readers=r,
                          rate=opts.rate, reader_grace=5)]
    # all
    ensure_channel(opts.address, opts.topic, opts.channel, opts.features)
    pub = run_phase(opts, pid, "pub", opts.topic, writers=w)
    sub = run_phase(opts, pid, "sub", opts.topic, readers=r, target=pub["pub"]["msgs"])
    if sub["sub"]["msgs"] < pub["pub"]["msgs"]:
        print(f"sub note: drained {sub['sub']['msgs']} of {pub['pub']['msgs']} msgs within the duration")
    both = run_phase(opts, pid, "both", phase_topic(opts, "both"), writers=w, readers=r)
    half = min(both["pub"]["rate"], both["sub"]["rate"]) / 2
    lat = run_phase(opts, pid, "lat", phase_topic(opts, "lat"), writers=w, readers=r,
                    rate=half, reader_grace=5)
    return [pub, sub, both, lat]


def summary(phases: list[dict]) -> None:
    print("\nsummary")
    print(f"{'phase':<10}{'direction':<10}{'msgs':>10}{'secs':>8}{'msgs/s':>10}{'MB/s':>8}"
          f"{'nsqd us/msg':>13}{'nsqd rss MB':>13}{'fsyncs/s':>10}")
    for ph in phases:
        d = ph.get("daemon", {})
        for role, word in (("pub", "publish"), ("sub", "consume")):
            if role in ph:
                f = ph[role]
                print(f"{ph['phase']:<10}{word:<10}{f['msgs']:>10}{f['secs']:>8.2f}{f['rate']:>10.0f}"
                      f"{f['mbps']:>8.1f}{d.get('us_per_msg', float('nan')):>13.2f}"
                      f"{d.get('rss', float('nan')):>13.1f}{ph.get('fsyncs', float('nan')):>10.0f}")
        if "latency" in ph:
            ms = ph["latency"]
            print(f"{ph['phase']:<10}latency   p50 {ms['p50']:.2f} ms  p90 {ms['p90']:.2f} ms  "
                  f"p99 {ms['p99']:.2f} ms  max {ms['max']:.2f} ms")
    if phases and "daemon" in phases[-1]:
        print(f"nsqd peak rss: {phases[-1]['daemon']['hwm']:.1f} MB (VmHWM)")


def self_test(opts, pid, daemon) -> bool:
    """Every mode for a second or so; published and consumed counts must agree."""
    opts.duration = 1.0
    ok = True

    def check(cond, what):
        nonlocal ok
        print(f"self-test {'ok' if cond else 'FAILED'}: {what}", flush=True)
        ok &= bool(cond)

    f = opts.features
    if f["tls"] or f["snappy"] or f["deflate"]:
        check_upgrades(opts, daemon, check)
    ensure_channel(opts.address, opts.topic, opts.channel, opts.features)
    pub = run_phase(opts, pid, "pub", opts.topic, writers=opts.writers)
    check(pub["pub"]["msgs"] > 0, "pub published messages")
    sub = run_phase(opts, pid, "sub", opts.topic, readers=opts.readers, target=pub["pub"]["msgs"],
                    duration=30)
    check(sub["sub"]["msgs"] == pub["pub"]["msgs"], "sub drained exactly what pub published")
    if f["tls"] or f["snappy"] or f["deflate"]:
        (sent, sent_wire, _, _), (_, _, got, got_wire) = pub["pub"]["io"], sub["sub"]["io"]
        if f["snappy"] or f["deflate"]:
            smaller = opts.body == "x"  # random bodies do not compress
            check((sent_wire < sent / 2 and got_wire < got / 2) if smaller else (sent_wire > 0 and got_wire > 0),
                  f"compressed on the wire: MPUBs {sent} -> {sent_wire} bytes, messages {got} -> {got_wire}")
        else:
            check(sent < sent_wire < sent * 1.01 and got < got_wire < got * 1.01,
                  f"TLS records on the wire: MPUBs {sent} -> {sent_wire} bytes, messages {got} -> {got_wire}")
    both = run_phase(opts, pid, "both", phase_topic(opts, "both"), writers=opts.writers, readers=opts.readers)
    check(both["pub"]["msgs"] > 0 and both["sub"]["msgs"] > 0, "both published and consumed")
    lat = run_phase(opts, pid, "lat", phase_topic(opts, "lat"), writers=opts.writers,
                    readers=opts.readers, rate=20000, reader_grace=10)
    check(lat["sub"]["msgs"] == lat["pub"]["msgs"] and "latency" in lat, "latency read all it published")
    check(abs(lat["pub"]["rate"] - 20000) < 4000, "latency writers held the target rate")
    opts.backlog = 50000
    back = run_backlog(opts, pid, daemon)
    check(back["pub"]["msgs"] >= 50000, "backlog published its count")
    print(f"self-test: {'ok' if ok else 'FAILED'}", flush=True)
    return ok


def check_upgrades(opts, daemon, check) -> None:
    """A connection with the upgrades subscribes; nsqd's /stats must show them on that client."""
    conn = Conn(opts.address, "bench-upgrades", opts.features)
    try:
        conn.subscribe(phase_topic(opts, "upgrades"), opts.channel)
        f = opts.features
        check((conn.tls is not None) == bool(f["tls"])
              and conn.compression.startswith("snappy" if f["snappy"] else "deflate" if f["deflate"] else ""),
              f"negotiated {conn.describe()}")
        if daemon is None:
            print("self-test: /stats check skipped (needs --spawn)", flush=True)
            return
        host, port = daemon.http_address
        with urllib.request.urlopen(f"http://{host}:{port}/stats?format=json", timeout=10) as resp:
            doc = json.load(resp)
        found = [c for c in _walk(doc) if c.get("client_id") == "bench-upgrades"]
        want = {"tls": bool(f["tls"]), "snappy": bool(f["snappy"]), "deflate": bool(f["deflate"])}
        seen = {k: found[0].get(k) for k in want} if found else None
        check(seen == want, f"nsqd /stats shows the client with {seen} (want {want})")
    finally:
        conn.close()


def _walk(node):
    """Every dict in a JSON document."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


# ---------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=("pub", "sub", "both", "latency", "all"), default="all")
    p.add_argument("--spawn", action="store_true", help="start nsqd on free ports with a fresh data dir")
    p.add_argument("--nsqd-args", default="", help="extra flags for the spawned nsqd (one string)")
    p.add_argument("--keep", action="store_true", help="keep the spawned nsqd's data dir and log")
    p.add_argument("--nsqd-tcp-address", default="127.0.0.1:4150", help="nsqd to load when not spawning")
    p.add_argument("--pid", type=int, default=0, help="pid of that nsqd, for CPU and RSS figures")
    p.add_argument("--http-address", default="", help="that nsqd's HTTP address, for fsyncs per second")
    p.add_argument("--topic", default="sub_bench")
    p.add_argument("--channel", default="ch")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per phase")
    p.add_argument("--size", type=int, default=200, help="message body bytes")
    p.add_argument("--batch", type=int, default=200, help="messages per MPUB")
    p.add_argument("--writers", type=int, default=2, help="publishing connections")
    p.add_argument("--readers", type=int, default=2, help="consuming connections")
    p.add_argument("--procs", type=int, default=1, help="worker processes per role (connections are spread)")
    p.add_argument("--rdy", type=int, default=2500, help="RDY count per reader connection")
    p.add_argument("--count", type=int, default=0, help="sub mode: stop after this many messages (0: duration)")
    p.add_argument("--rate", type=float, default=50000, help="latency mode: target msgs/s over all writers")
    p.add_argument("--backlog", type=int, default=0, help="publish N messages with no consumer; report RSS")
    p.add_argument("--timeout", type=float, default=600, help="time limit for --backlog publishing")
    p.add_argument("--body", choices=("x", "random"), default="x",
                   help="message bodies: 'x' repeated (compresses to almost nothing, as Go's zero bodies), "
                        "or random bytes, distinct within each compressor window (incompressible)")
    p.add_argument("--tls", action="store_true",
                   help="negotiate tls_v1 on every connection (with --spawn: nsqd gets a trustme certificate)")
    p.add_argument("--tls-ca-file", default="",
                   help="CA file to verify nsqd's certificate with when not spawning (empty: the system store)")
    p.add_argument("--snappy", action="store_true", help="negotiate snappy compression on every connection")
    p.add_argument("--deflate", action="store_true", help="negotiate deflate compression on every connection")
    p.add_argument("--deflate-level", type=int, default=6,
                   help="deflate level asked for in IDENTIFY and used by the generator's own compressor")
    p.add_argument("--self-test", action="store_true",
                   help="run every mode briefly and check the counts (and the negotiated upgrades)")
    p.add_argument("--py-spy", metavar="FILE", default="",
                   help="profile nsqd with py-spy for the whole run (.svg flame graph, .txt collapsed stacks)")
    opts = p.parse_args(argv)
    if opts.rate and opts.size < 8:
        p.error("--size must be at least 8 (latency mode stamps the body)")
    if opts.snappy and opts.deflate:
        p.error("--snappy and --deflate exclude each other (nsqd allows one compression)")
    if not 1 <= opts.deflate_level <= 9:
        p.error("--deflate-level must be in [1, 9]")
    if opts.snappy and snappy is None:
        p.error("--snappy needs python-snappy (pip install python-snappy)")
    return opts


def start_profiler(path: str, pid: int) -> subprocess.Popen:
    """``py-spy record`` attached to nsqd; stopped with SIGINT, when it writes its output."""
    if not pid:
        raise BenchError("--py-spy needs --spawn or --pid")
    fmt = "raw" if path.endswith(".txt") else "flamegraph"
    cmd = ["py-spy", "record", "--pid", str(pid), "--rate", "100", "--format", fmt, "--output", path]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # let it attach
    return proc


def main(argv=None) -> int:
    opts = parse_args(argv)
    daemon = profiler = None
    try:
        if opts.spawn:
            daemon = Daemon(shlex.split(opts.nsqd_args), opts.keep, tls=opts.tls)
            opts.address, pid = daemon.address, daemon.pid
            opts.http_address = "%s:%d" % daemon.http_address
            if opts.tls:
                opts.tls_ca_file = daemon.ca_file
        else:
            host, _, port = opts.nsqd_tcp_address.rpartition(":")
            opts.address, pid = (host or "127.0.0.1", int(port)), opts.pid
            wait_for_port(opts.address, None, None, timeout=5)
        opts.features = features_of(opts)
        probe = Conn(opts.address, "bench-probe", opts.features)
        opts.features_label = probe.describe()
        probe.close()
        if opts.py_spy:
            profiler = start_profiler(opts.py_spy, pid)
        mode = "self-test" if opts.self_test else f"backlog {opts.backlog}" if opts.backlog else opts.mode
        print(f"nsq_bench: mode {mode}, size {opts.size}, "
              f"batch {opts.batch}, writers {opts.writers}, readers {opts.readers}, procs {opts.procs}, "
              f"rdy {opts.rdy}, duration {opts.duration} s, cpus {os.cpu_count()}, "
              f"wire {opts.features_label}, body {opts.body}", flush=True)
        if opts.self_test:
            return 0 if self_test(opts, pid, daemon) else 1
        phases = run_mode(opts, pid, daemon)
        if len(phases) > 1:
            summary(phases)
        return 0
    except (BenchError, OSError, queue.Empty) as exc:
        print(f"nsq_bench: error: {exc!r}" if isinstance(exc, queue.Empty) else f"nsq_bench: error: {exc}",
              file=sys.stderr)
        if daemon is not None:
            print(f"nsqd log tail:\n{daemon.log_path.read_text(errors='replace')[-2000:]}", file=sys.stderr)
        return 1
    finally:
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(60)
            print(f"py-spy: profile written to {opts.py_spy}", flush=True)
        if daemon is not None:
            daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
