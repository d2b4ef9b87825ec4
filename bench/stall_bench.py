#!/usr/bin/env python3
"""What one big operation costs everybody else: the other clients' PUB latency meanwhile.

Each scenario spawns a daemon (``nsq_bench.Daemon``), sets it up, then runs
one big operation while a probe client sends a ``PUB`` every 2 ms on its own
connection and times each answer. Printed per scenario: how long the
operation took, its messages a second with the daemon's CPU µs per message
(from /proc), the probe's worst and 99th-percentile answer time, and how far
the daemon's memory peaked above where it stood before (VmHWM - VmRSS).

* ``mpub``: one ``MPUB`` filling ``--max-body-size`` (5 MiB) with one-byte
  messages (1,048,575), to a topic with one channel;
* ``lines``: ``POST /mpub`` of 5 MiB of one-byte lines (2,621,440 messages);
* ``fanout``: one ``MPUB`` of 200,000 one-byte messages to a topic with 100 channels;
* ``redrive``: ``POST /topic/redrive`` of 2,000,000 dead letters (8 bytes);
* ``delete``: ``POST /topic/delete`` of a topic with 1 GiB on disk.
"""

from __future__ import annotations

import argparse
import http.client
import socket
import struct
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nsq_bench  # noqa: E402  (the daemon and /proc helpers)


class Probe:
    """A PUB every 2 ms on its own connection, each answer timed."""

    def __init__(self, address) -> None:
        self.sock = socket.create_connection(address)
        self.sock.sendall(b"  V2")
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            self.sock.sendall(b"PUB probe\n\x00\x00\x00\x01p")
            self.sock.recv(64)
            self.times.append(time.perf_counter() - start)
            time.sleep(0.002)

    def stop(self) -> tuple[float, float]:
        """The worst and the 99th-percentile answer time, in ms."""
        self._stop.set()
        self._thread.join()
        times = sorted(self.times)
        return times[-1] * 1e3, times[int(len(times) * 0.99)] * 1e3


def _connect(daemon) -> socket.socket:
    sock = socket.create_connection(daemon.address)
    sock.sendall(b"  V2")
    return sock


def _mpub(sock, topic: str, body: bytes) -> None:
    sock.sendall(b"MPUB %s\n" % topic.encode() + struct.pack(">i", len(body)) + body)
    answer = sock.recv(64)
    if not answer.endswith(b"OK"):
        raise nsq_bench.BenchError(f"MPUB {topic}: {answer!r}")


def _post(daemon, path: str, body: bytes = b"") -> bytes:
    conn = http.client.HTTPConnection(*daemon.http_address, timeout=600)
    conn.request("POST", path, body)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise nsq_bench.BenchError(f"POST {path}: {response.status} {data!r}")
    return data


def _one_byte_mpub(count: int) -> bytes:
    return struct.pack(">i", count) + b"\x00\x00\x00\x01x" * count


def _topic_with_channels(daemon, topic: str, channels: int) -> None:
    _post(daemon, f"/topic/create?topic={topic}")
    for index in range(channels):
        _post(daemon, f"/channel/create?topic={topic}&channel=c{index}")


def _setup_mpub(daemon):
    _topic_with_channels(daemon, "big", 1)
    return _connect(daemon)


def _run_mpub(daemon, sock) -> int:
    count = (5 * 1024 * 1024 - 4) // 5
    _mpub(sock, "big", _one_byte_mpub(count))
    return count


def _run_lines(daemon, _state) -> int:
    _post(daemon, "/mpub?topic=big", b"x\n" * (5 << 19))
    return 5 << 19


def _setup_fanout(daemon):
    _topic_with_channels(daemon, "big", 100)
    return _connect(daemon)


def _run_fanout(daemon, sock) -> int:
    _mpub(sock, "big", _one_byte_mpub(200_000))
    return 200_000


def _setup_redrive(daemon) -> None:
    sock = _connect(daemon)
    for _ in range(5):
        _mpub(sock, "dead", struct.pack(">i", 400_000) + b"\x00\x00\x00\x08deadbeef" * 400_000)
    _topic_with_channels(daemon, "live", 1)


def _run_redrive(daemon, _state) -> int:
    _post(daemon, "/topic/redrive?topic=dead&to=live")
    return 2_000_000


def _setup_delete(daemon) -> None:
    _topic_with_channels(daemon, "big", 1)
    sock = _connect(daemon)
    body = struct.pack(">i", 4000) + (struct.pack(">i", 1000) + b"m" * 1000) * 4000
    for _ in range(1024 * 1024 * 1024 // (4000 * 1000)):
        _mpub(sock, "big", body)
    time.sleep(3)  # the background syncs settle


def _run_delete(daemon, _state) -> int:
    _post(daemon, "/topic/delete?topic=big")
    return 0


#: name: (daemon flags, set-up, the operation returning its message count)
SCENARIOS = {
    "mpub": ([], _setup_mpub, _run_mpub),
    "lines": ([], lambda daemon: None, _run_lines),
    "fanout": ([], _setup_fanout, _run_fanout),
    "redrive": ([], _setup_redrive, _run_redrive),
    "delete": (["--mem-queue-size=100"], _setup_delete, _run_delete),
}


def measure(name: str, rounds: int) -> None:
    args, setup, run = SCENARIOS[name]
    for _ in range(rounds):
        daemon = nsq_bench.Daemon(args, keep=False)
        try:
            state = setup(daemon)
            time.sleep(0.3)
            before = nsq_bench.proc_stats(daemon.pid)
            probe = Probe(daemon.address)
            time.sleep(0.2)
            start = time.perf_counter()
            count = run(daemon, state)
            elapsed = time.perf_counter() - start
            time.sleep(0.1)
            worst, p99 = probe.stop()
            after = nsq_bench.proc_stats(daemon.pid)
        finally:
            daemon.stop()
        cpu = after["cpu"] - before["cpu"]
        rate = f"{count / elapsed:,.0f} msgs/s at {cpu / count * 1e6:.2f} us/msg" if count else f"cpu {cpu:.2f} s"
        print(f"{name}: {elapsed:.3f} s, {rate}; other clients' PUB: worst {worst:.0f} ms, p99 {p99:.1f} ms; "
              f"memory peak +{after['VmHWM'] - before['VmRSS']:.0f} MB", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenarios", nargs="*", metavar="scenario", help=f"any of {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--rounds", type=int, default=1, help="daemons per scenario")
    args = p.parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    for name in args.scenarios or SCENARIOS:
        measure(name, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
