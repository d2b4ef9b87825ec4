#!/usr/bin/env python3
"""HTTP load generator for nsqd's API: ``POST /pub`` and ``GET /stats?format=json`` (and ``/ping``).

Starts ``python -m nsqd`` from ``--repo`` (cwd and PYTHONPATH, so an older
checkout can be measured against this one) on free loopback ports with a
temporary data dir, then, for each phase and each client count, keeps that
many keep-alive connections busy, each with one request outstanding (a closed
loop), for ``--warmup`` + ``--duration`` seconds. Requests are pre-encoded and
driven from plain non-blocking sockets with ``selectors`` in ``--procs``
worker processes, so the generator costs little per request.

Each line gives requests/s and latency percentiles over the measured window
(completions inside it), and the daemon's CPU time per request from
``/proc/<pid>/stat`` (utime + stime over the same window / requests), e.g.::

    pub    16 conns: 5210 req/s, p50 3.02 ms, p99 4.87 ms, daemon 181 us/req [26050 reqs, 0 errors, 0 reconnects] busy: nsqd 0.94 + bench 0.31 + other 0.05 cpus

A connection the server closes (hypercorn ends keep-alive after 1000
requests) is opened again and its request resent; ``reconnects`` counts them.

``busy`` splits the machine's CPUs over the window (``/proc/stat``) into the
daemon, the generator's workers and everything else; when ``other`` is not
near 0 something else competed and the figures are low.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from nsq_bench import free_port

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
TOPIC = "http_bench"
_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *([0-9]+)")


def process_cpu(pid: int) -> float:
    """utime + stime of a process (all threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy() -> float:
    """CPU-seconds all CPUs have been busy since boot (less idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK


def requests_for(phase: str, host: str, size: int) -> bytes:
    if phase == "pub":
        body = b"x" * size
        return (b"POST /pub?topic=%s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n"
                % (TOPIC.encode(), host.encode(), len(body))) + body
    path = {"stats": b"/stats?format=json", "ping": b"/ping"}[phase]
    return b"GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path, host.encode())


def worker(address, request: bytes, conns: int, start: float, end: float, out) -> None:
    """Keep ``conns`` connections busy until ``end``; report latencies completed in [start, end)."""
    sel = selectors.DefaultSelector()

    def connect(state: dict) -> None:
        sock = socket.create_connection(address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        state["sock"] = sock
        state["buf"] = bytearray()
        sel.register(sock, selectors.EVENT_READ, state)

    socks = []
    for _ in range(conns):
        state = {"sent": 0.0}
        connect(state)
        socks.append(state)
    latencies: list[float] = []
    errors = reconnects = 0
    now = time.monotonic()
    for state in socks:
        state["sent"] = now
        state["sock"].sendall(request)
    while now < end:
        for key, _ in sel.select(timeout=0.2):
            state = key.data
            data = state["sock"].recv(1 << 20)
            if not data:  # the server ended keep-alive (hypercorn does after 1000 requests): resend
                sel.unregister(state["sock"])
                state["sock"].close()
                connect(state)
                state["sock"].sendall(request)
                reconnects += 1
                continue
            buf = state["buf"]
            buf += data
            while True:
                head_end = buf.find(b"\r\n\r\n")
                if head_end < 0:
                    break
                match = _CONTENT_LENGTH.search(buf, 0, head_end + 2)
                total = head_end + 4 + (int(match.group(1)) if match else 0)
                if len(buf) < total:
                    break
                now = time.monotonic()
                if not buf.startswith(b"HTTP/1.1 200 "):
                    errors += 1
                if start <= now < end:
                    latencies.append(now - state["sent"])
                del buf[:total]
                state["sent"] = now
                state["sock"].sendall(request)
        now = time.monotonic()
    for state in socks:
        state["sock"].close()
    out.put((latencies, errors, reconnects, process_cpu(os.getpid())))


class Daemon:
    """``python -m nsqd`` from ``repo`` on free loopback ports with a fresh data dir."""

    def __init__(self, repo: Path, extra: list[str]) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="http-bench-"))
        self.http = ("127.0.0.1", free_port())
        cmd = [sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{free_port()}",
               f"--http-address={self.http[0]}:{self.http[1]}", "--amqp-address=",
               f"--data-path={self.tmp / 'data'}", "--log-level=warn", *extra]
        env = {**os.environ, "PYTHONPATH": str(repo)}
        self.log = open(self.tmp / "nsqd.log", "wb")
        self.proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://{self.http[0]}:{self.http[1]}/ping", timeout=1).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((self.tmp / "nsqd.log").read_text()) from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_phase(daemon: Daemon, phase: str, clients: int, args) -> None:
    request = requests_for(phase, daemon.http[0], args.size)
    procs = min(args.procs, clients)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start = time.monotonic() + 0.5 + args.warmup  # time to connect, then the warm-up
    end = start + args.duration
    workers = [ctx.Process(target=worker, args=(daemon.http, request, clients // procs + (i < clients % procs),
                                                start, end, out)) for i in range(procs)]
    for w in workers:
        w.start()
    time.sleep(max(0.0, start - time.monotonic()))
    cpu0, busy0, worker_cpu0 = process_cpu(daemon.pid), machine_busy(), sum(process_cpu(w.pid) for w in workers)
    time.sleep(max(0.0, end - time.monotonic()))
    cpu1, busy1 = process_cpu(daemon.pid), machine_busy()
    results = []
    while len(results) < len(workers):
        try:
            results.append(out.get(timeout=1))
        except queue.Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                raise RuntimeError("a generator process failed") from None
    for w in workers:
        w.join()
    latencies = sorted(lat for result in results for lat in result[0])
    errors = sum(result[1] for result in results)
    reconnects = sum(result[2] for result in results)
    worker_cpu = sum(result[3] for result in results) - worker_cpu0
    count = len(latencies)
    nsqd_cpu = cpu1 - cpu0
    other = (busy1 - busy0) - nsqd_cpu - worker_cpu
    print(f"{phase:<5} {clients:>3} conns: {count / args.duration:.0f} req/s, "
          f"p50 {percentile(latencies, 0.50) * 1e3:.2f} ms, p99 {percentile(latencies, 0.99) * 1e3:.2f} ms, "
          f"daemon {nsqd_cpu / max(count, 1) * 1e6:.0f} us/req [{count} reqs, {errors} errors, {reconnects} reconnects] "
          f"busy: nsqd {nsqd_cpu / args.duration:.2f} + bench {worker_cpu / args.duration:.2f} "
          f"+ other {max(other, 0) / args.duration:.2f} cpus", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose nsqd is started (default: this one)")
    parser.add_argument("--phases", default="pub,stats", help="comma-separated: pub, stats, ping (the server's own cost)")
    parser.add_argument("--clients", default="1,16,64", help="comma-separated connection counts")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    parser.add_argument("--size", type=int, default=200, help="/pub body bytes")
    parser.add_argument("--procs", type=int, default=1, help="generator processes")
    parser.add_argument("--nsqd-args", default="", help="extra daemon flags")
    args = parser.parse_args()
    repo = args.repo.resolve()
    daemon = Daemon(repo, args.nsqd_args.split())
    try:
        print(f"nsqd from {repo} (pid {daemon.pid}, http {daemon.http[0]}:{daemon.http[1]}), "
              f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}", flush=True)
        for phase in args.phases.split(","):
            for clients in (int(c) for c in args.clients.split(",")):
                run_phase(daemon, phase, clients, args)
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
