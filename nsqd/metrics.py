"""Prometheus text exposition of the daemon's stats, from one snapshot.

Names follow Prometheus conventions (``nsqd_`` prefix, ``_total`` counters,
base units); every per-topic and per-channel figure that ``/stats`` has is
here with ``topic`` / ``channel`` labels. Rendering is one pass over the
snapshot with string formatting only, so 10k channels stay cheap
(``bench/metrics_bench.py`` measures it), and ``/metrics`` renders it
paced, a metric family at a time. Topic and channel names are limited
to ``[.a-zA-Z0-9_#-]``, so label values never need escaping.
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Iterator

from . import gc_pauses, stats

#: lines a piece of a paced exposition holds at most (a family of 10,000 channels is 10,000)
STEP_LINES = 1024
_TOPIC = (
    ("depth", "gauge", "Messages queued in the topic itself (no channel yet, or paused).", "depth"),
    ("backend_depth", "gauge", "Messages of the topic queue that are on disk.", "backend_depth"),
    ("messages_total", "counter", "Messages published to the topic.", "message_count"),
    ("message_bytes_total", "counter", "Body bytes published to the topic.", "message_bytes"),
    ("paused", "gauge", "1 when the topic is paused.", "paused"),
    ("dropped_total", "counter", "Messages the topic dropped (overflow).", "dropped_count"),
    ("disk_damaged_records_total", "counter", "Damaged disk records found (torn tails, bad checksums).",
     "disk_damaged_records"),
    ("disk_fsyncs_total", "counter", "Fsync rounds of the topic's disk queue.", "disk_syncs"),
)
_CHANNEL = (
    ("depth", "gauge", "Messages queued in the channel (memory and disk).", "depth"),
    ("backend_depth", "gauge", "Queued messages of the channel that are on disk.", "backend_depth"),
    ("in_flight", "gauge", "Messages delivered and not yet finished.", "in_flight_count"),
    ("deferred", "gauge", "Messages waiting for their due time.", "deferred_count"),
    ("messages_total", "counter", "Messages the channel received.", "message_count"),
    ("requeued_total", "counter", "Messages given back by consumers.", "requeue_count"),
    ("timed_out_total", "counter", "Deliveries that timed out.", "timeout_count"),
    ("clients", "gauge", "Consumers subscribed to the channel.", "client_count"),
    ("paused", "gauge", "1 when the channel is paused.", "paused"),
    ("dropped_total", "counter", "Messages dropped (overflow, ephemeral overflow).", "dropped_count"),
    ("rejected_total", "counter", "Messages consumers rejected for good.", "rejected_count"),
    ("dead_lettered_total", "counter", "Messages moved to the dead-letter topic.", "dead_letter_count"),
    ("expired_total", "counter", "Messages dropped for being older than the TTL.", "expired_count"),
    ("disk_damaged_records_total", "counter", "Damaged disk records found (torn tails, bad checksums).",
     "disk_damaged_records"),
    ("disk_fsyncs_total", "counter", "Fsync rounds of the channel's disk queue.", "disk_syncs"),
)


def snapshot_fsyncs(snapshot: stats.NSQDStats) -> int:
    return sum(t.disk_syncs + sum(c.disk_syncs for c in t.channels) for t in snapshot.topics)


def render(snapshot: stats.NSQDStats, clients: int, body_memory: tuple[int, int, int, int] = (0, 0, 0, 0)) -> bytes:
    """``body_memory``: the shared budget of big bodies being received: (bytes held, capacity, waits,
    refusals)."""
    return "".join(_pieces(snapshot, clients, body_memory)).encode()


async def render_paced(snapshot: stats.NSQDStats, clients: int,
                       body_memory: tuple[int, int, int, int] = (0, 0, 0, 0)) -> bytes:
    """:func:`render`, letting other work run between metric families (see ``stats.Pacer``)."""
    return await stats.paced(_pieces(snapshot, clients, body_memory))


def _pieces(snapshot: stats.NSQDStats, clients: int, body_memory: tuple[int, int, int, int]) -> Iterator[str]:
    """The exposition, one piece a metric family of topics or channels (or STEP_LINES of its lines)."""
    out: list[str] = []
    add = out.append
    add("# HELP nsqd_info Version of the NSQ protocol and API the daemon implements.")
    add("# TYPE nsqd_info gauge")
    add(f'nsqd_info{{version="{snapshot.version}"}} 1')
    add("# HELP nsqd_start_time_seconds Unix time the daemon started.")
    add("# TYPE nsqd_start_time_seconds gauge")
    add(f"nsqd_start_time_seconds {snapshot.start_time}")
    add("# HELP nsqd_uptime_seconds Seconds since the daemon started.")
    add("# TYPE nsqd_uptime_seconds gauge")
    add(f"nsqd_uptime_seconds {snapshot.uptime:.3f}")
    add("# HELP nsqd_healthy 1 when the daemon reports itself healthy.")
    add("# TYPE nsqd_healthy gauge")
    add(f"nsqd_healthy {int(snapshot.health == 'OK')}")
    add("# HELP nsqd_disk_fsyncs_total Fsync rounds of every disk queue of the daemon.")
    add("# TYPE nsqd_disk_fsyncs_total counter")
    add(f"nsqd_disk_fsyncs_total {snapshot_fsyncs(snapshot)}")
    add("# HELP nsqd_clients Connected TCP clients.")
    add("# TYPE nsqd_clients gauge")
    add(f"nsqd_clients {clients}")
    held, capacity, waits, refusals = body_memory
    add("# HELP nsqd_body_memory_bytes Bytes of --max-body-memory held by big bodies being received.")
    add("# TYPE nsqd_body_memory_bytes gauge")
    add(f"nsqd_body_memory_bytes {held}")
    add("# HELP nsqd_body_memory_limit_bytes --max-body-memory (0: no limit).")
    add("# TYPE nsqd_body_memory_limit_bytes gauge")
    add(f"nsqd_body_memory_limit_bytes {capacity}")
    add("# HELP nsqd_body_memory_waits_total Big bodies that waited for room in --max-body-memory.")
    add("# TYPE nsqd_body_memory_waits_total counter")
    add(f"nsqd_body_memory_waits_total {waits}")
    add("# HELP nsqd_body_memory_refusals_total Big bodies refused for want of room in --max-body-memory "
        "(dropped as they arrived; the client was told to try again).")
    add("# TYPE nsqd_body_memory_refusals_total counter")
    add(f"nsqd_body_memory_refusals_total {refusals}")
    for name, kind, help_text, attr in _TOPIC:
        add(f"# HELP nsqd_topic_{name} {help_text}")
        add(f"# TYPE nsqd_topic_{name} {kind}")
        for t in snapshot.topics:
            add(f'nsqd_topic_{name}{{topic="{t.topic_name}"}} {int(getattr(t, attr))}')
            if len(out) >= STEP_LINES:
                yield _lines(out)
        if out:
            yield _lines(out)
    for name, kind, help_text, attr in _CHANNEL:
        add(f"# HELP nsqd_channel_{name} {help_text}")
        add(f"# TYPE nsqd_channel_{name} {kind}")
        for t in snapshot.topics:
            topic = t.topic_name
            for c in t.channels:
                add(f'nsqd_channel_{name}{{topic="{topic}",channel="{c.channel_name}"}} '
                    f"{int(getattr(c, attr))}")
                if len(out) >= STEP_LINES:
                    yield _lines(out)
        if out:
            yield _lines(out)
    add("# HELP nsqd_channel_e2e_processing_latency_seconds Publish-to-FIN latency quantiles.")
    add("# TYPE nsqd_channel_e2e_processing_latency_seconds gauge")
    for t in snapshot.topics:
        for c in t.channels:
            for p in c.e2e_processing_latency.percentiles:
                add(f'nsqd_channel_e2e_processing_latency_seconds{{topic="{t.topic_name}",'
                    f'channel="{c.channel_name}",quantile="{p["quantile"]}"}} {p["value"] / 1e9:.6f}')
            if len(out) >= STEP_LINES:
                yield _lines(out)
    add("# HELP process_resident_memory_max_bytes Peak resident memory of the daemon.")
    add("# TYPE process_resident_memory_max_bytes gauge")
    add(f"process_resident_memory_max_bytes {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}")
    add("# HELP process_cpu_seconds_total CPU time the daemon used.")
    add("# TYPE process_cpu_seconds_total counter")
    add(f"process_cpu_seconds_total {time.process_time():.3f}")
    add("# HELP python_gc_collections_total Garbage collections by generation.")
    add("# TYPE python_gc_collections_total counter")
    for generation, gen_stats in enumerate(gc.get_stats()):
        add(f'python_gc_collections_total{{generation="{generation}"}} {gen_stats["collections"]}')
    pauses = gc_pauses.PAUSES
    add("# HELP python_gc_pause_seconds How long collections held the daemon: quantiles of the last "
        f"{gc_pauses.KEEP}, count and sum since start.")
    add("# TYPE python_gc_pause_seconds summary")
    for quantile, usec in zip(("0.95", "0.99", "1"), pauses.percentiles_usec((95.0, 99.0, 100.0))):
        add(f'python_gc_pause_seconds{{quantile="{quantile}"}} {usec / 1e6:.6f}')
    add(f"python_gc_pause_seconds_sum {pauses.total:.6f}")
    add(f"python_gc_pause_seconds_count {pauses.count}")
    yield _lines(out)


def _lines(out: list[str]) -> str:
    """The lines gathered so far, each ending with a newline; ``out`` is emptied."""
    text = "\n".join(out) + "\n"
    out.clear()
    return text
