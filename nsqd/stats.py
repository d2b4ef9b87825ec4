"""A point-in-time stats snapshot of the daemon, and its JSON and text forms.

One snapshot feeds every reader (``GET /stats``, metrics exporters, the AMQP
gateway), so they all agree on what a number means. Each topic's part is
taken in one synchronous step (no awaits), so it is consistent, and the
snapshot is made of frozen dataclasses sorted by name, so it can be handed
around freely. ``GET /stats`` takes and renders it paced (:class:`Pacer`):
with thousands of channels and clients the whole job takes tens of
milliseconds, and publishers and consumers are served in between.

Field names and their order are Go nsqd's JSON keys (``nsqd/stats.go`` and
``ClientV2Stats``), so the JSON renderer needs no mapping table. Consumers are
read with ``getattr`` defaults because a channel's consumer need not be a TCP
client: anything with an ``in_flight`` collection renders.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from dataclasses import dataclass, field, fields, is_dataclass, replace
from datetime import datetime
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import trio

from . import e2e, gc_pauses, steps
from .client_v2 import STATE_INIT
from .options import format_duration
from .version import NSQD_VERSION, version_string

if TYPE_CHECKING:
    from .channel import Channel
    from .broker import Broker
    from .topic import Topic

#: Go's ``omitempty``: the key is left out when the value is false/empty
OMITEMPTY = {"omitempty": True}
#: not part of the JSON document (used by the text form only)
NOT_JSON = {"json": False}


@dataclass(frozen=True)
class E2eLatency:
    """End-to-end processing latency quantiles (empty unless percentiles are configured)."""

    count: int = 0
    percentiles: tuple = ()


@dataclass(frozen=True)
class PubCount:
    topic: str
    count: int


@dataclass(frozen=True)
class ClientStats:
    client_id: str
    hostname: str
    version: str
    remote_address: str
    state: int
    ready_count: int
    in_flight_count: int
    message_count: int
    finish_count: int
    requeue_count: int
    connect_ts: int
    sample_rate: int
    deflate: bool
    snappy: bool
    user_agent: str
    authed: bool = field(metadata=OMITEMPTY)
    auth_identity: str = field(metadata=OMITEMPTY)
    auth_identity_url: str = field(metadata=OMITEMPTY)
    topology_zone: str
    topology_region: str
    pub_counts: tuple[PubCount, ...] = field(metadata=OMITEMPTY)
    tls: bool
    tls_cipher_suite: str
    tls_version: str
    tls_negotiated_protocol: str
    tls_negotiated_protocol_is_mutual: bool


@dataclass(frozen=True)
class ChannelStats:
    channel_name: str
    depth: int
    backend_depth: int
    in_flight_count: int
    deferred_count: int
    message_count: int
    requeue_count: int
    timeout_count: int
    client_count: int
    clients: tuple[ClientStats, ...]
    paused: bool
    e2e_processing_latency: E2eLatency
    # beyond nsqd: present only when non-zero, so the default document is Go's
    rejected_count: int = field(default=0, metadata=OMITEMPTY)
    dropped_count: int = field(default=0, metadata=OMITEMPTY)
    dead_letter_count: int = field(default=0, metadata=OMITEMPTY)
    expired_count: int = field(default=0, metadata=OMITEMPTY)
    max_messages: int = field(default=0, metadata=OMITEMPTY)
    max_bytes: int = field(default=0, metadata=OMITEMPTY)
    max_attempts: int = field(default=0, metadata=OMITEMPTY)
    #: damaged records found in the disk queue (torn tails cut on open, bad checksums skipped)
    disk_damaged_records: int = field(default=0, metadata=OMITEMPTY)
    #: fsync rounds of the disk queue since start
    disk_syncs: int = field(default=0, metadata=OMITEMPTY)


@dataclass(frozen=True)
class TopicStats:
    topic_name: str
    channels: tuple[ChannelStats, ...]
    depth: int
    backend_depth: int
    message_count: int
    message_bytes: int
    paused: bool
    e2e_processing_latency: E2eLatency
    # beyond nsqd: present only when non-zero
    dropped_count: int = field(default=0, metadata=OMITEMPTY)
    max_messages: int = field(default=0, metadata=OMITEMPTY)
    disk_damaged_records: int = field(default=0, metadata=OMITEMPTY)
    disk_syncs: int = field(default=0, metadata=OMITEMPTY)


@dataclass(frozen=True)
class MemoryStats:
    """Go's runtime memory figures, mapped onto what CPython can tell cheaply.

    ``heap_objects`` is the count of allocated blocks, ``heap_in_use_bytes``
    the resident set size, ``gc_pause_usec_*`` percentiles of the last 256
    collections' pauses (``nsqd/gc_pauses.py``), ``gc_total_runs`` the
    collections of all generations; figures CPython has no equivalent for
    are 0.
    """

    heap_objects: int
    heap_idle_bytes: int
    heap_in_use_bytes: int
    heap_released_bytes: int
    gc_pause_usec_100: int
    gc_pause_usec_99: int
    gc_pause_usec_95: int
    next_gc_bytes: int
    gc_total_runs: int


@dataclass(frozen=True)
class NSQDStats:
    version: str
    health: str
    start_time: int
    topics: tuple[TopicStats, ...]
    memory: MemoryStats | None = field(metadata=OMITEMPTY)
    producers: tuple[ClientStats, ...]
    uptime: float = field(metadata=NOT_JSON)


# --------------------------------------------------------------- snapshot


#: longest a paced /stats runs before the event loop serves other work (seconds)
SLICE = 0.002
#: channels a step of a paced /stats takes at most (a topic with 10,000 channels, in one step,
#: held the event loop for 0.3 s)
STEP_CHANNELS = 64


class Pacer:
    """Lets the event loop serve everyone else every :data:`SLICE` of a long job."""

    def __init__(self) -> None:
        self._since = time.perf_counter()

    async def step(self) -> None:
        if time.perf_counter() - self._since >= SLICE:
            await trio.lowlevel.checkpoint()
            self._since = time.perf_counter()


def snapshot(
    nsqd: Broker,
    topic: str | None = None,
    channel: str | None = None,
    include_clients: bool = True,
    include_mem: bool = False,
) -> NSQDStats:
    """The daemon's stats, optionally narrowed to one topic and/or channel name.

    As in nsqd, a topic without the requested channel is left out, and
    producers (clients that published) are listed whatever the channel filter,
    each with its publish counts for the requested topic only; a topic that
    does not exist leaves out the producers as well (nsqd's GetStats returns early).
    """
    return steps.run_whole(_snapshot_steps(nsqd, topic, channel, include_clients, include_mem))


async def snapshot_paced(nsqd: Broker, **filters) -> NSQDStats:
    """:func:`snapshot` (the same filters), letting other work run between topics.

    A topic deleted meanwhile is left out.
    """
    return await steps.run_paced(_snapshot_steps(nsqd, **filters), Pacer().step)


def _snapshot_steps(
    nsqd: Broker, topic: str | None = None, channel: str | None = None, include_clients: bool = True,
    include_mem: bool = False,
) -> Generator[None, None, NSQDStats]:
    """Builds the snapshot one topic a step."""
    topic_missing = False
    if topic:
        found = nsqd.topics.get(topic)
        topics = [found] if found is not None else []
        topic_missing = found is None
    else:
        topics = sorted(nsqd.topics.values(), key=lambda t: t.name)
    topic_stats = []
    for t in topics:
        if nsqd.topics.get(t.name) is not t:
            continue  # deleted since the last step
        if channel:
            found_channel = t.channels.get(channel)
            if found_channel is None:
                continue
            channels = [found_channel]
        else:
            channels = sorted(t.channels.values(), key=lambda c: c.name)
        now_ns = nsqd.now_ns()
        channel_stats: list[ChannelStats] = []
        for start in range(0, len(channels), STEP_CHANNELS):
            if start:
                yield
                if nsqd.topics.get(t.name) is not t:
                    break
                now_ns = nsqd.now_ns()
            channel_stats += [_channel_stats(c, topic, include_clients, now_ns)
                              for c in channels[start:start + STEP_CHANNELS] if t.channels.get(c.name) is c]
        else:
            topic_stats.append(_topic_stats(t, tuple(channel_stats), now_ns))
        yield
    producers: tuple[ClientStats, ...] = ()
    if include_clients and not topic_missing:
        producers = tuple(
            client_stats(c, topic)
            for _, c in sorted(nsqd.clients.items())
            if getattr(c, "pub_counts", None)
        )
    now = time.time()
    return NSQDStats(
        version=NSQD_VERSION,
        health=nsqd.health,
        start_time=int(nsqd.start_time),
        topics=tuple(topic_stats),
        memory=memory_stats() if include_mem else None,
        producers=producers,
        uptime=max(now - nsqd.start_time, 0.0),
    )


def _topic_stats(t: Topic, channels: tuple[ChannelStats, ...], now_ns: int) -> TopicStats:
    return TopicStats(
        topic_name=t.name,
        channels=channels,
        depth=t.depth,
        backend_depth=t.backend_depth,
        message_count=t.message_count,
        message_bytes=t.message_bytes,
        paused=t.paused,
        e2e_processing_latency=_e2e([c.e2e for c in t.channels.values() if c.e2e is not None], now_ns),
        dropped_count=t.dropped_count,
        max_messages=t.policy.max_messages,
        **_disk_stats(t.backend),
    )


def _channel_stats(c: Channel, topic_filter: str | None, include_clients: bool, now_ns: int) -> ChannelStats:
    consumers = sorted(c.subscriptions.items(), key=lambda item: item[0])
    clients = tuple(client_stats(sub.consumer, topic_filter) for _, sub in consumers) if include_clients else ()
    return ChannelStats(
        channel_name=c.name,
        depth=c.depth,
        backend_depth=c.backend_depth,
        in_flight_count=c.in_flight_count,
        deferred_count=c.deferred_count,
        message_count=c.message_count,
        requeue_count=c.requeue_count,
        timeout_count=c.timeout_count,
        client_count=len(consumers),
        clients=clients,
        paused=c.paused,
        e2e_processing_latency=_e2e([c.e2e] if c.e2e is not None else [], now_ns),
        rejected_count=c.rejected_count,
        dropped_count=c.dropped_count,
        dead_letter_count=c.dead_letter_count,
        expired_count=c.expired_count,
        max_messages=c.policy.max_messages,
        max_bytes=c.policy.max_bytes,
        max_attempts=c.policy.max_attempts,
        **_disk_stats(c.backend),
    )


def _disk_stats(backend) -> dict:
    if backend is None or backend.closed:
        return {}
    disk = backend.statistics()
    return {"disk_damaged_records": disk.corrupt_records_skipped, "disk_syncs": disk.syncs}


def _e2e(windows, now_ns: int) -> E2eLatency:
    count, percentiles = e2e.result(windows, now_ns)
    return E2eLatency(count, percentiles)


def client_stats(client: object, topic_filter: str | None = None) -> ClientStats:
    """One connection's stats; attributes a consumer lacks read as zero/empty."""

    def get(name: str, default=""):
        return getattr(client, name, default)

    pub_counts = get("pub_counts", None) or {}
    state = get("state", STATE_INIT)
    return ClientStats(
        client_id=get("client_id"),
        hostname=get("hostname"),
        version=get("version", "V2"),
        remote_address=get("remote_address"),
        state=state,
        ready_count=get("ready_count", 0),
        in_flight_count=get("in_flight_count", 0),
        message_count=get("message_count", 0),
        finish_count=get("finish_count", 0),
        requeue_count=get("requeue_count", 0),
        connect_ts=int(get("connect_ts", 0)),
        sample_rate=get("sample_rate", 0),
        deflate=bool(get("deflate", False)),
        snappy=bool(get("snappy", False)),
        user_agent=get("user_agent"),
        authed=bool(get("authed", False)),
        auth_identity=get("auth_identity"),
        auth_identity_url=get("auth_identity_url"),
        topology_zone=get("topology_zone"),
        topology_region=get("topology_region"),
        pub_counts=tuple(
            PubCount(name, count)
            for name, count in sorted(pub_counts.items())
            if not topic_filter or name == topic_filter
        ),
        tls=bool(get("tls", False)),
        tls_cipher_suite=get("tls_cipher_suite"),
        tls_version=get("tls_version"),
        tls_negotiated_protocol=get("tls_negotiated_protocol"),
        tls_negotiated_protocol_is_mutual=bool(get("tls_negotiated_protocol_is_mutual", False)),
    )


def memory_stats() -> MemoryStats:
    pause_100, pause_99, pause_95 = gc_pauses.PAUSES.percentiles_usec((100.0, 99.0, 95.0))
    return MemoryStats(
        heap_objects=sys.getallocatedblocks(),
        heap_idle_bytes=0,
        heap_in_use_bytes=_rss_bytes(),
        heap_released_bytes=0,
        gc_pause_usec_100=pause_100,
        gc_pause_usec_99=pause_99,
        gc_pause_usec_95=pause_95,
        next_gc_bytes=0,
        gc_total_runs=sum(generation["collections"] for generation in gc.get_stats()),
    )


def _rss_bytes() -> int:
    """Current resident set size (Linux), else the peak the OS reports."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------- JSON


def to_json_value(obj: object) -> object:
    """Plain JSON data for a stats object, keys in Go's order, omitempty applied."""
    kind = type(obj)
    if kind in _JSON_SCALARS:
        return obj
    plan = _JSON_PLANS.get(kind)
    if plan is not None or is_dataclass(obj):
        if plan is None:
            plan = _JSON_PLANS[kind] = _json_plan(kind)
        out = {}
        for name, omitempty in plan:
            value = getattr(obj, name)
            if omitempty and not value:
                continue
            out[name] = value if type(value) in _JSON_SCALARS else to_json_value(value)
        return out
    if isinstance(obj, (tuple, list)):
        return [to_json_value(item) for item in obj]
    if isinstance(obj, dict):
        return {key: to_json_value(value) for key, value in obj.items()}
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)  # Go's encoding/json writes an integral float64 as 1, not 1.0
    return obj


#: values written as they are (a float is not: an integral one is written as an int)
_JSON_SCALARS = frozenset((str, int, bool, type(None)))
#: a stats dataclass's JSON fields in order, each with its omitempty flag; /stats renders
#: thousands of them, and ``dataclasses.fields`` on each would be a third of its time
_JSON_PLANS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _json_plan(kind: type) -> tuple[tuple[str, bool], ...]:
    return tuple((f.name, bool(f.metadata.get("omitempty"))) for f in fields(kind) if f.metadata.get("json") is not False)


_GO_ESCAPED = "<>&\u2028\u2029"
_GO_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def go_json(value: object) -> bytes:
    """Compact JSON escaped as Go's encoding/json writes it."""
    return _go_json_text(value).encode()


def _go_json_text(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if any(char in text for char in _GO_ESCAPED):  # a scan each is cheaper than translating a big document
        text = text.translate(_GO_ESCAPES)
    return text


def render_json(stats: NSQDStats) -> bytes:
    return "".join(_json_pieces(stats)).encode()


async def render_json_paced(stats: NSQDStats) -> bytes:
    """:func:`render_json`, letting other work run between topics."""
    return await paced(_json_pieces(stats))


def _json_pieces(stats: NSQDStats) -> Iterator[str]:
    """The document as its head, one piece a topic, and its tail (each topic encoded on its own)."""
    separator = "{"
    for name, omitempty in _JSON_PLANS.get(NSQDStats) or _json_plan(NSQDStats):
        value = getattr(stats, name)
        if omitempty and not value:
            continue
        if name == "topics":
            yield f'{separator}"topics":['
            for index, topic in enumerate(value):
                comma = "," if index else ""
                if len(topic.channels) <= STEP_CHANNELS:
                    yield comma + _go_json_text(to_json_value(topic))
                    continue
                # its channels a step at a time, in their place among the topic's fields
                head, _, tail = _go_json_text(to_json_value(replace(topic, channels=()))).partition('"channels":[]')
                yield f'{comma}{head}"channels":['
                for start in range(0, len(topic.channels), STEP_CHANNELS):
                    chunk = topic.channels[start:start + STEP_CHANNELS]
                    yield ("," if start else "") + _go_json_text(to_json_value(chunk))[1:-1]
                yield "]" + tail
            yield "]"
        else:
            yield f"{separator}{_go_json_text(name)}:{_go_json_text(to_json_value(value))}"
        separator = ","
    yield "}"


async def paced(pieces: Iterator[str]) -> bytes:
    """The pieces joined and encoded, serving other work between them every :data:`SLICE`."""
    out = []
    pacer = Pacer()
    for piece in pieces:
        out.append(piece)
        await pacer.step()
    return "".join(out).encode()


# ------------------------------------------------------------------- text


def _e2e_text(latency: E2eLatency) -> str:
    return ", ".join(e2e.human(p["value"]) for p in latency.percentiles)


def render_text(stats: NSQDStats) -> bytes:
    """The human-readable form, laid out as Go nsqd's printStats."""
    return "".join(_text_pieces(stats)).encode()


async def render_text_paced(stats: NSQDStats) -> bytes:
    """:func:`render_text`, letting other work run between topics."""
    return await paced(_text_pieces(stats))


def _text_pieces(stats: NSQDStats) -> Iterator[str]:
    """The text as lines before the topics, one piece a topic, and the producers."""
    now = time.time()
    started = datetime.fromtimestamp(stats.start_time).astimezone()
    stamp = started.isoformat(timespec="seconds").replace("+00:00", "Z")
    lines = [
        version_string(),
        f"start_time {stamp}",
        f"uptime {format_duration(stats.uptime)}",
        "",
        f"Health: {stats.health}",
    ]
    if stats.memory is not None:
        lines += ["", "Memory:"]
        lines += [f"   {f.name:<25}\t{getattr(stats.memory, f.name)}" for f in fields(stats.memory)]
    lines += ["", "Topics:" if stats.topics else "Topics: None"]
    yield "\n".join(lines) + "\n"
    for index, t in enumerate(stats.topics):
        mark = "*P " if t.paused else "   "
        # nsqd separates topics by a blank line, but none follows "Topics:"
        lines = [""] if index else []
        lines.append(
            f"{mark}[{t.topic_name:<15}] depth: {t.depth:<5} be-depth: {t.backend_depth:<5} "
            f"msgs: {t.message_count:<8} e2e%: {_e2e_text(t.e2e_processing_latency)}"
        )
        for number, c in enumerate(t.channels, 1):
            if not number % STEP_CHANNELS:
                yield "\n".join(lines) + "\n"
                lines = []
            mark = "   *P " if c.paused else "      "
            lines.append(
                f"{mark}[{c.channel_name:<25}] depth: {c.depth:<5} be-depth: {c.backend_depth:<5} "
                f"inflt: {c.in_flight_count:<4} def: {c.deferred_count:<4} re-q: {c.requeue_count:<5} "
                f"timeout: {c.timeout_count:<5} msgs: {c.message_count:<8} e2e%: "
                f"{_e2e_text(c.e2e_processing_latency)}"
            )
            lines += [f"        {client_text(client, now)}" for client in c.clients]
        yield "\n".join(lines) + "\n"
    if not stats.producers:
        lines = ["", "Producers: None"]
    else:
        lines = ["", "Producers:"]
        lines += [f"   {client_text(client, now)}" for client in stats.producers]
    yield "\n".join(lines) + "\n"


def client_text(c: ClientStats, now: float) -> str:
    """One client line, as Go's ClientV2Stats.String()."""
    port = c.remote_address.rpartition(":")[2]
    ident = f"{c.hostname}:{port} {c.user_agent}"
    connected = format_duration(max(int(now) - c.connect_ts, 0))
    if c.pub_counts:
        total = sum(p.count for p in c.pub_counts)
        topics = ",".join(f"{p.topic}={p.count}" for p in c.pub_counts)
        return f"[{c.version} {ident:<21}] msgs: {total:<8} topics: {topics} connected: {connected}"
    return (
        f"[{c.version} {ident:<21}] state: {c.state} inflt: {c.in_flight_count:<4} "
        f"rdy: {c.ready_count:<4} fin: {c.finish_count:<8} re-q: {c.requeue_count:<8} "
        f"msgs: {c.message_count:<8} connected: {connected}"
    )

