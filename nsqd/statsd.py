"""Push nsqd's metrics to statsd over UDP, with nsqd's metric names.

Every ``--statsd-interval`` the daemon takes one stats snapshot and sends
counters (``|c``, the change since the last push) and gauges (``|g``) under
``--statsd-prefix`` (``%s`` becomes the broadcast ``host_port``), packed
into UDP datagrams of at most ``--statsd-udp-packet-size`` bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import structlog
import trio

from . import stats
from .options import split_host_port

if TYPE_CHECKING:
    from .broker import Broker

log = structlog.get_logger("nsqd.statsd")

#: topics turned into lines between two yields of the sender
TOPICS_PER_STEP = 64


def host_key(host_port: str) -> str:
    return host_port.replace(".", "_").replace(":", "_")


def metric_prefix(prefix: str, broadcast_address: str, http_port: int) -> str:
    if not prefix:
        return ""
    prefix = prefix.replace("%s", host_key(f"{broadcast_address}:{http_port}"))
    return prefix if prefix.endswith(".") else prefix + "."


#: the memory figures sent as gauges with --statsd-mem-stats, as Go's statsdLoop sends them
_MEM_GAUGES = ("heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes",
               "gc_pause_usec_100", "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes")


class StatsdReporter:
    """Turns successive snapshots into statsd lines (pure; no I/O).

    Counters are sent as the change since the previous snapshot, as Go's
    statsdLoop diffs against its last one: only the previous snapshot's
    totals are kept, so the counters of topics and channels that went (an
    ``#ephemeral`` channel per nsq_tail session) are not kept for good.
    """

    def __init__(self, prefix: str, exclude_ephemeral: bool, mem_stats: bool) -> None:
        self.prefix = prefix
        self.exclude_ephemeral = exclude_ephemeral
        self.mem_stats = mem_stats
        #: the counters' totals in the previous snapshot, and in the one being turned into lines
        self._last: dict[str, int] = {}
        self._totals: dict[str, int] = {}

    def _counter(self, out: list[str], name: str, total: int) -> None:
        diff = total - self._last.get(name, 0)
        self._totals[name] = total
        out.append(f"{self.prefix}{name}:{diff}|c")

    def _gauge(self, out: list[str], name: str, value: int) -> None:
        out.append(f"{self.prefix}{name}:{int(value)}|g")

    def lines(self, snapshot: stats.NSQDStats) -> list[str]:
        return [line for step in self.lines_in_steps(snapshot) for line in step]

    def lines_in_steps(self, snapshot: stats.NSQDStats, topics_per_step: int = TOPICS_PER_STEP) -> Iterator[list[str]]:
        """The snapshot's lines, a few topics' worth at a time (the sender yields between steps:
        with 3,000 topics one go held the event loop for over 100 ms)."""
        out: list[str] = []
        for index, t in enumerate(snapshot.topics):
            if index and index % topics_per_step == 0:
                yield out
                out = []
            if self.exclude_ephemeral and t.topic_name.endswith("#ephemeral"):
                continue
            base = f"topic.{t.topic_name}"
            self._counter(out, f"{base}.message_count", t.message_count)
            self._counter(out, f"{base}.message_bytes", t.message_bytes)
            self._gauge(out, f"{base}.depth", t.depth)
            self._gauge(out, f"{base}.backend_depth", t.backend_depth)
            for p in t.e2e_processing_latency.percentiles:
                self._gauge(out, f"{base}.e2e_processing_latency_{p['quantile'] * 100:.0f}", p["value"])
            for c in t.channels:
                if self.exclude_ephemeral and c.channel_name.endswith("#ephemeral"):
                    continue
                cbase = f"{base}.channel.{c.channel_name}"
                self._counter(out, f"{cbase}.message_count", c.message_count)
                self._gauge(out, f"{cbase}.depth", c.depth)
                self._gauge(out, f"{cbase}.backend_depth", c.backend_depth)
                self._gauge(out, f"{cbase}.in_flight_count", c.in_flight_count)
                self._gauge(out, f"{cbase}.deferred_count", c.deferred_count)
                self._counter(out, f"{cbase}.requeue_count", c.requeue_count)
                self._counter(out, f"{cbase}.timeout_count", c.timeout_count)
                self._gauge(out, f"{cbase}.clients", c.client_count)
                for p in c.e2e_processing_latency.percentiles:
                    self._gauge(out, f"{cbase}.e2e_processing_latency_{p['quantile'] * 100:.0f}", p["value"])
        mem = snapshot.memory
        if self.mem_stats and mem is not None:
            for name in _MEM_GAUGES:
                self._gauge(out, f"mem.{name}", getattr(mem, name))
            self._counter(out, "mem.gc_runs", mem.gc_total_runs)
        self._last, self._totals = self._totals, {}
        yield out


def packets(lines: list[str], size: int) -> list[bytes]:
    """Pack newline-terminated lines into datagrams of at most ``size`` bytes."""
    out, current = [], b""
    for line in lines:
        data = line.encode() + b"\n"
        if current and len(current) + len(data) > size:
            out.append(current)
            current = b""
        current += data
    if current:
        out.append(current)
    return out


async def statsd_loop(nsqd: Broker) -> None:
    """Every ``--statsd-interval``: a snapshot, sent over a socket opened for it (as Go dials for
    each push): a statsd that cannot be resolved or reached is logged and tried again next time."""
    opts = nsqd.options
    if not opts.statsd_address:
        return
    host, port = split_host_port(opts.statsd_address)
    reporter = StatsdReporter(metric_prefix(opts.statsd_prefix, opts.broadcast_address, nsqd.broadcast_http_port),
                              opts.statsd_exclude_ephemeral, opts.statsd_mem_stats)
    while True:
        await trio.sleep(opts.statsd_interval)
        snapshot = await stats.snapshot_paced(nsqd, include_clients=False, include_mem=opts.statsd_mem_stats)
        try:
            sock = await _dial(host or "127.0.0.1", port)
        except OSError as exc:
            log.warning("statsd unreachable", address=opts.statsd_address, error=str(exc))
            for _ in reporter.lines_in_steps(snapshot):  # the counters' changes start from here
                pass
            continue
        with sock:
            for step in reporter.lines_in_steps(snapshot):
                for packet in packets(step, opts.statsd_udp_packet_size):
                    try:
                        await sock.send(packet)
                    except OSError as exc:  # nobody listening: statsd is best effort
                        log.debug("statsd send failed", error=str(exc))
                await trio.lowlevel.checkpoint()


async def _dial(host: str, port: int) -> trio.socket.SocketType:
    """A UDP socket connected to statsd, of the family its address resolves to."""
    family, kind, proto, _, address = (await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_DGRAM))[0]
    sock = trio.socket.socket(family, kind, proto)
    try:
        await sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock
