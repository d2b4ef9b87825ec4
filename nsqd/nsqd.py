"""The daemon: owns the topics, runs the listeners and loops, persists state.

Lifecycle (one nursery tree, nothing fire-and-forget)::

    serve()
      queues nursery ........ disk queue background tasks (outlives the rest)
        load metadata, import a Go nsqd data directory if one is there
        services nursery .... TCP accept, HTTP, queue scan, backlog mover,
                               metadata writer, connections
      shutdown: cancel services (stop accepting, connections end and requeue
      their in-flight messages), then write every queued, in-flight and
      deferred message to disk, close the disk queues, save metadata.

Metadata is ``nsqd.dat`` in the data path, the same JSON Go nsqd writes, so
either daemon can read the other's; it is saved atomically (temp file, fsync,
rename) after every change to the set of topics and channels or a pause.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import deque
from functools import partial
from pathlib import Path

import structlog
import trio

from . import diskq, message, tls
from .diskq import goimport
from .channel import Channel, ChannelExiting
from .client_v2 import ClientV2
from .guid import GUIDFactory
from .options import OVERFLOW_POLICIES, TLS_NOT_REQUIRED, Options, OptionsError, split_host_port
from .names import is_valid_channel_name, is_valid_topic_name
from .tcp import ConnectionSlots
from .topic import QueueFull, Topic
from .version import NSQD_VERSION

log = structlog.get_logger("nsqd")

METADATA_FILE = "nsqd.dat"


class NSQD:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.data_path = Path(options.data_path)
        self.topics: dict[str, Topic] = {}
        self.clients: dict[int, ClientV2] = {}
        self.guid = GUIDFactory(options.node_id)
        self.tls_context = tls.server_context(options)
        if options.tls_required != TLS_NOT_REQUIRED and self.tls_context is None:
            raise OptionsError("--tls-required needs --tls-cert and --tls-key")
        self.start_time = time.time()
        self.tcp_addresses: list[tuple[str, int]] = []
        self.http_addresses: list[tuple[str, int]] = []
        self.amqp_addresses: list[tuple[str, int]] = []
        self.https_addresses: list[tuple[str, int]] = []
        self.connections_nursery: trio.Nursery | None = None
        self.connection_slots = ConnectionSlots(options.max_connections)
        self.health = "OK"
        #: bumped whenever a topic or channel appears or goes (the scan loop refreshes)
        self.channels_version = 0
        #: set once shutdown starts: publishes and subscriptions are refused
        self.draining = False
        self.lookup_peers: list = []
        self._disk_checked = float("-inf")
        self._disk_used = 0
        self._client_seq = 0
        self._wall0 = time.time_ns()
        self._clock0: float | None = None
        self._queues_nursery: trio.Nursery | None = None
        self._backend_scopes: dict[int, trio.CancelScope] = {}
        self._backlog: deque[Topic] = deque()
        self._backlog_lot = trio.lowlevel.ParkingLot()
        self._metadata_dirty = trio.Event()
        self._loading = False
        self._shutdown = trio.Event()
        self.ready = trio.Event()

    # --------------------------------------------------------------- time
    def now_ns(self) -> int:
        """Wall-clock nanoseconds that follow Trio's clock (so tests can jump time)."""
        if self._clock0 is None:
            return time.time_ns()
        return self._wall0 + int((trio.current_time() - self._clock0) * 1e9)

    # ------------------------------------------------------------ clients
    def new_client_id(self) -> int:
        self._client_seq += 1
        return self._client_seq

    def add_client(self, client: ClientV2) -> None:
        self.clients[client.id] = client

    def remove_client(self, client: ClientV2) -> None:
        self.clients.pop(client.id, None)
        if client.channel is not None:
            client.channel.remove_consumer(client.id)

    # ------------------------------------------------------------- topics
    def get_topic(self, name: str) -> Topic:
        topic = self.topics.get(name)
        if topic is None:
            if self.draining:
                raise ChannelExiting("exiting")
            topic = Topic(
                name,
                mem_queue_size=self.options.mem_queue_size,
                backend=None if name.endswith("#ephemeral") else self.open_backend(name),
                max_messages=self.options.topic_max_messages,
                channel_max_messages=self.options.channel_max_messages,
                open_channel_backend=self._open_channel_backend,
                on_channels_changed=self._topic_changed,
                on_backlog=self._schedule_backlog,
                on_last_channel_gone=self._ephemeral_topic_gone,
            )
            opts = self.options
            topic.overflow = opts.overflow_policy
            topic.channel_max_bytes = opts.channel_max_bytes
            if opts.max_disk_bytes:
                topic.disk_full = self._disk_full
            topic.max_attempts = opts.max_attempts
            topic.ttl_ns = int(opts.message_ttl * 1e9)
            topic.dead_letter = partial(self.dead_letter, name)
            if opts.e2e_processing_latency_percentiles:
                topic.e2e_percentiles = list(opts.e2e_processing_latency_percentiles)
                topic.e2e_window_ns = int(opts.e2e_processing_latency_window_time * 1e9)
                topic.e2e_now = self.now_ns
            self.topics[name] = topic
            log.info("TOPIC created", topic=name)
            self._topic_changed(topic)
        return topic

    def dead_letter(self, topic_name: str, frames: list[bytes]) -> None:
        """Publish messages a channel gave up on to ``<topic><suffix>``, ids and attempts kept."""
        name = topic_name + self.options.dead_letter_suffix
        if topic_name.endswith("#ephemeral") or not is_valid_topic_name(name):
            log.warning("dead letters dropped", topic=topic_name, count=len(frames))
            return
        try:
            self.get_topic(name).put_chunk([message.frame_id(f) for f in frames], frames,
                                           sum(len(f) for f in frames) - message.FRAME_OVERHEAD * len(frames))
        except (QueueFull, ChannelExiting, diskq.DiskQueueError) as exc:
            log.error("dead letters dropped", topic=topic_name, dead_letter_topic=name, count=len(frames),
                      error=str(exc))

    def disk_bytes(self) -> int:
        """Bytes of queued messages on disk (and in write buffers), across every queue."""
        return sum(q.depth_bytes for t in self.topics.values()
                   for q in [t.backend, *(c.backend for c in t.channels.values())] if q is not None)

    def _disk_full(self) -> bool:
        now = time.monotonic()
        if now - self._disk_checked >= 0.1:  # sampled: summing every queue per publish would cost too much
            self._disk_checked = now
            self._disk_used = self.disk_bytes()
        return self._disk_used >= self.options.max_disk_bytes

    def get_existing_topic(self, name: str) -> Topic | None:
        return self.topics.get(name)

    def delete_topic(self, name: str) -> None:
        topic = self.topics.pop(name)
        topic.exiting = True
        for channel_name in list(topic.channels):
            self._close_consumers(topic.channels[channel_name])
            topic.delete_channel(channel_name)
        if topic.backend is not None:
            self.close_backend(topic.backend, delete=True)
        log.info("TOPIC deleted", topic=name)
        self._topic_changed(topic)

    def delete_channel(self, topic: Topic, name: str) -> None:
        channel = topic.channels[name]
        self._close_consumers(channel)
        topic.delete_channel(name)
        log.info("CHANNEL deleted", topic=topic.name, channel=name)

    @staticmethod
    def _close_consumers(channel: Channel) -> None:
        for consumer in list(channel.consumers.values()):
            consumer.close()

    def channels(self) -> list[Channel]:
        return [c for t in self.topics.values() for c in t.channels.values()]

    def _ephemeral_topic_gone(self, topic: Topic) -> None:
        if self.topics.get(topic.name) is topic:
            self.delete_topic(topic.name)

    def _topic_changed(self, topic: Topic) -> None:
        self.channels_version += 1
        self.persist_metadata_soon()
        for peer in self.lookup_peers:
            peer.notify()

    def _schedule_backlog(self, topic: Topic) -> None:
        if topic not in self._backlog:
            self._backlog.append(topic)
            self._backlog_lot.unpark_all()

    # ------------------------------------------------------- disk queues
    def _disk_queue_options(self) -> dict:
        opts = self.options
        return dict(
            max_bytes_per_file=opts.max_bytes_per_file,
            min_msg_size=2 + message.FRAME_OVERHEAD - 8,
            max_msg_size=opts.max_msg_size + message.FRAME_OVERHEAD + 64,
            sync_every=opts.sync_every,
            sync_timeout=opts.sync_timeout,
        )

    def open_backend(self, queue_name: str) -> diskq.DiskQueue:
        if goimport.go_queue_exists(queue_name, self.data_path):
            self._import_go_queue(queue_name)
        backend = diskq.DiskQueue(queue_name, self.data_path, **self._disk_queue_options())
        if self._queues_nursery is not None:
            self._queues_nursery.start_soon(self._run_backend, backend)
        return backend

    def _open_channel_backend(self, topic_name: str, channel_name: str) -> diskq.DiskQueue | None:
        if channel_name.endswith("#ephemeral"):
            return None
        return self.open_backend(f"{topic_name}:{channel_name}")

    async def _run_backend(self, backend: diskq.DiskQueue) -> None:
        with trio.CancelScope() as scope:
            self._backend_scopes[id(backend)] = scope
            try:
                await backend.run()
            finally:
                self._backend_scopes.pop(id(backend), None)

    def close_backend(self, backend: diskq.DiskQueue, delete: bool = False) -> None:
        scope = self._backend_scopes.pop(id(backend), None)
        if scope is not None:
            scope.cancel()
        if delete:
            backend.delete()
        else:
            backend.close()

    def _import_go_queue(self, queue_name: str) -> None:
        """Take over the backlog a Go nsqd left for this queue, then remove its files.

        The messages are appended to our own queue and fsynced (by closing it)
        before the Go files are deleted, so a crash in between duplicates at
        worst and never loses.
        """
        backend = diskq.DiskQueue(queue_name, self.data_path, **self._disk_queue_options())
        imported = 0
        batch: list[bytes] = []
        for data in goimport.iter_go_queue(queue_name, self.data_path,
                                                 max_msg_size=self.options.max_msg_size + 64):
            batch.append(message.from_go_message(data))
            if len(batch) >= 1000:
                backend.put_many(batch)
                imported += len(batch)
                batch = []
        if batch:
            backend.put_many(batch)
            imported += len(batch)
        backend.close()
        goimport.remove_go_queue(queue_name, self.data_path)
        log.info("imported Go nsqd queue", queue=queue_name, messages=imported)

    # ------------------------------------------------------------ metadata
    def metadata(self) -> dict:
        topics = []
        for topic in sorted(self.topics.values(), key=lambda t: t.name):
            if topic.ephemeral:
                continue
            channels = [
                {"name": c.name, "paused": c.paused, **_channel_policy(c, topic)}
                for c in sorted(topic.channels.values(), key=lambda c: c.name)
                if not c.ephemeral
            ]
            topics.append({"channels": channels, "name": topic.name, "paused": topic.paused,
                           **_topic_policy(topic, self.options)})
        return {"topics": topics, "version": NSQD_VERSION, "last_message_id": self.guid.last}

    def persist_metadata_soon(self) -> None:
        if not self._loading:
            self._metadata_dirty.set()

    def save_metadata(self) -> None:
        self.data_path.mkdir(parents=True, exist_ok=True)
        path = self.data_path / METADATA_FILE
        tmp = path.with_name(f"{METADATA_FILE}.{os.getpid()}.tmp")
        data = json.dumps(self.metadata(), separators=(",", ":")).encode()
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(self.data_path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def load_metadata(self) -> None:
        """Create the topics and channels of ``nsqd.dat``; one that is not what we (or Go nsqd)
        write stops start-up with a :class:`MetadataError` saying what is wrong and what to do."""
        path = self.data_path / METADATA_FILE
        if not path.exists():
            return
        try:
            data = _checked_metadata(path.read_bytes())
        except ValueError as exc:
            raise MetadataError(
                f"{path} is not valid nsqd metadata ({exc}): move it aside to start without it (topics and "
                f"channels come back on first use, their queued messages stay on disk) or restore it from a "
                f"backup") from None
        self.guid = GUIDFactory(self.options.node_id, floor=int(data.get("last_message_id", 0)) + 1)
        self._loading = True
        try:
            for t in data.get("topics") or []:
                topic = self.get_topic(t["name"])
                set_topic_policy(topic, t.get("policy") or {})
                for c in t.get("channels") or []:
                    channel = topic.get_channel(c["name"])
                    set_channel_policy(channel, c.get("policy") or {})
                    if c.get("paused"):
                        channel.pause()
                if t.get("paused"):
                    topic.pause()
        finally:
            self._loading = False
        log.info("metadata loaded", topics=len(self.topics), channels=len(self.channels()))

    def _declare(self) -> None:
        """Create the topics and channels the configuration declares (``--declare``)."""
        for value in self.options.declare:
            topic_name, _, channel_name = value.partition(":")
            topic = self.get_topic(topic_name)
            if channel_name:
                topic.get_channel(channel_name)

    async def _metadata_writer(self) -> None:
        while True:
            await self._metadata_dirty.wait()
            self._metadata_dirty = trio.Event()
            await trio.to_thread.run_sync(self.save_metadata)
            await trio.sleep(0.05)  # coalesce bursts of changes

    # ------------------------------------------------------------- loops
    async def _backlog_mover(self) -> None:
        """Hand topics' disk backlogs to their channels in bounded steps."""
        while True:
            while not self._backlog:
                await self._backlog_lot.park()
            topic = self._backlog.popleft()
            if topic.exiting:
                continue
            if topic.move_backlog():
                self._backlog.append(topic)
            await trio.sleep(0)

    async def _run_connections(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.connections_nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # ------------------------------------------------------------ lifecycle
    def request_shutdown(self) -> None:
        self._shutdown.set()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from .lookup import lookup_loop
        from .queue_scan import queue_scan_loop
        from .statsd import statsd_loop
        from .tcp import serve_tcp

        self._clock0 = trio.current_time()
        self._wall0 = time.time_ns()
        self.data_path.mkdir(parents=True, exist_ok=True)
        async with trio.open_nursery() as queues:
            self._queues_nursery = queues
            self.load_metadata()  # outside the try: a file we cannot read must not be overwritten on the way out
            try:
                self._declare()
                async with trio.open_nursery() as services:
                    await services.start(self._run_connections)
                    host, port = split_host_port(self.options.tcp_address)
                    tcp_listeners = await trio.open_tcp_listeners(port, host=host or None)
                    self.tcp_addresses = [l.socket.getsockname()[:2] for l in tcp_listeners]
                    await services.start(serve_tcp, self, tcp_listeners)
                    if self.options.http_address:
                        from .http_api import serve_http

                        self.http_addresses = await services.start(serve_http, self, self.options.http_address)
                    if self.options.amqp_address:
                        from amqp_gateway import serve_amqp

                        self.amqp_addresses = await services.start(serve_amqp, self, self.options.amqp_address)
                    if self.options.https_address:
                        from .http_api import serve_http

                        self.https_addresses = await services.start(
                            partial(serve_http, https=True), self, self.options.https_address)
                    services.start_soon(queue_scan_loop, self)
                    services.start_soon(self._backlog_mover)
                    services.start_soon(self._metadata_writer)
                    services.start_soon(lookup_loop, self)
                    services.start_soon(statsd_loop, self)
                    for topic in self.topics.values():
                        if topic.channels and topic.backend_depth:
                            self._schedule_backlog(topic)
                    log.info("nsqd listening", tcp=self.tcp_addresses, http=self.http_addresses,
                             data_path=str(self.data_path))
                    self.ready.set()
                    task_status.started(self)
                    await self._shutdown.wait()
                    await self._drain()
                    log.info("shutting down")
                    services.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    self._persist()
                queues.cancel_scope.cancel()

    async def _drain(self) -> None:
        """Graceful drain: no new publishes, subscriptions or deliveries; consumers get
        ``--shutdown-grace`` to finish what they hold (everything else is persisted)."""
        self.draining = True
        for channel in self.channels():
            channel.draining = True
            for consumer in list(channel.consumers.values()):
                consumer.drain()
        in_flight = sum(c.in_flight_count for c in self.channels())
        log.info("draining", in_flight=in_flight, grace=self.options.shutdown_grace)
        with trio.move_on_after(self.options.shutdown_grace):
            while sum(c.in_flight_count for c in self.channels()):
                await trio.sleep(0.05)
        left = sum(c.in_flight_count for c in self.channels())
        log.info("drained", finished=in_flight - left, still_in_flight=left)

    def _persist(self) -> None:
        """Write everything held in memory to the disk queues, close them, save metadata."""
        saved = 0
        for topic in list(self.topics.values()):
            for channel in list(topic.channels.values()):
                if channel.backend is None:
                    continue
                payloads = list(channel.persistable())
                if payloads:
                    channel.backend.put_many(payloads)
                    saved += len(payloads)
                self.close_backend(channel.backend)
            if topic.backend is not None:
                payloads = list(topic.persistable())
                if payloads:
                    topic.backend.put_many(payloads)
                    saved += len(payloads)
                self.close_backend(topic.backend)
        self.save_metadata()
        log.info("state persisted", messages=saved)


class MetadataError(Exception):
    """``nsqd.dat`` cannot be used; the message is the whole story, for one log line."""


_POLICY_KEYS = {"max_messages", "channel_max_messages", "channel_max_bytes", "max_bytes", "max_attempts",
                "message_ttl_ms"}


def _checked_metadata(raw: bytes) -> dict:
    """``nsqd.dat`` decoded, its shape checked; ValueError says what is wrong, briefly."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    last_id = data.get("last_message_id", 0)
    if type(last_id) is not int or last_id < 0:
        raise ValueError("last_message_id is not a number")
    topics = data.get("topics") or []
    if not isinstance(topics, list):
        raise ValueError("topics is not a list")
    for t in topics:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not is_valid_topic_name(t["name"]):
            raise ValueError(f"bad topic entry {json.dumps(t)[:60]}")
        channels = t.get("channels") or []
        if not isinstance(channels, list):
            raise ValueError(f"channels of topic {t['name']} is not a list")
        for c in channels:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not is_valid_channel_name(c["name"]):
                raise ValueError(f"bad channel entry {json.dumps(c)[:60]} in topic {t['name']}")
            _check_policy(c.get("policy"), f"channel {t['name']}:{c['name']}")
        _check_policy(t.get("policy"), f"topic {t['name']}")
    return data


def _check_policy(policy, owner: str) -> None:
    if policy is None:
        return
    if not isinstance(policy, dict):
        raise ValueError(f"policy of {owner} is not an object")
    for key, value in policy.items():
        if key == "overflow" and value in OVERFLOW_POLICIES:
            continue
        if key not in _POLICY_KEYS or type(value) is not int or value < 0:
            raise ValueError(f"policy of {owner} has a bad {key}")


def _overrides(values: dict, defaults: dict) -> dict:
    """Policies that differ from the daemon's flags, for nsqd.dat; none means Go's exact format."""
    changed = {k: v for k, v in values.items() if v != defaults[k]}
    return {"policy": changed} if changed else {}


def _default_policy(opts: Options) -> dict:
    return {"max_messages": opts.topic_max_messages, "channel_max_messages": opts.channel_max_messages,
            "channel_max_bytes": opts.channel_max_bytes, "overflow": opts.overflow_policy, "max_attempts": opts.max_attempts,
            "message_ttl_ms": int(opts.message_ttl * 1000)}


def _topic_policy(topic: Topic, opts: Options) -> dict:
    return _overrides({"max_messages": topic.max_messages, "channel_max_messages": topic.channel_max_messages,
                       "channel_max_bytes": topic.channel_max_bytes, "overflow": topic.overflow, "max_attempts": topic.max_attempts,
                       "message_ttl_ms": topic.ttl_ns // 1_000_000}, _default_policy(opts))


def _channel_policy(channel: Channel, topic: Topic) -> dict:
    return _overrides({"max_messages": channel.max_messages, "max_bytes": channel.max_bytes,
                       "max_attempts": channel.max_attempts, "message_ttl_ms": channel.ttl_ns // 1_000_000},
                      {"max_messages": topic.channel_max_messages, "max_bytes": topic.channel_max_bytes,
                       "max_attempts": topic.max_attempts,
                       "message_ttl_ms": topic.ttl_ns // 1_000_000})


def set_topic_policy(topic: Topic, policy: dict) -> None:
    """Apply saved or requested topic policies; the channel defaults reach its channels."""
    if "max_messages" in policy:
        topic.max_messages = int(policy["max_messages"])
    if "overflow" in policy:
        topic.overflow = str(policy["overflow"])
    channel_defaults = {}
    if "channel_max_messages" in policy:
        topic.channel_max_messages = channel_defaults["max_messages"] = int(policy["channel_max_messages"])
    if "channel_max_bytes" in policy:
        topic.channel_max_bytes = channel_defaults["max_bytes"] = int(policy["channel_max_bytes"])
    if "max_attempts" in policy:
        topic.max_attempts = channel_defaults["max_attempts"] = int(policy["max_attempts"])
    if "message_ttl_ms" in policy:
        topic.ttl_ns = int(policy["message_ttl_ms"]) * 1_000_000
        channel_defaults["message_ttl_ms"] = int(policy["message_ttl_ms"])
    for channel in topic.channels.values():
        set_channel_policy(channel, channel_defaults)


def set_channel_policy(channel: Channel, policy: dict) -> None:
    if "max_messages" in policy:
        channel.max_messages = int(policy["max_messages"])
    if "max_bytes" in policy:
        channel.max_bytes = int(policy["max_bytes"])
    if "max_attempts" in policy:
        channel.max_attempts = int(policy["max_attempts"])
    if "message_ttl_ms" in policy:
        channel.ttl_ns = int(policy["message_ttl_ms"]) * 1_000_000


def run(options: Options) -> int:
    """Run the daemon until SIGINT or SIGTERM; returns the exit status."""

    async def main() -> None:
        nsqd = NSQD(options)
        async with trio.open_nursery() as nursery:
            async def on_signals() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        log.info("signal received", signal=signal.Signals(signum).name)
                        nsqd.request_shutdown()
                        return

            nursery.start_soon(on_signals)
            await nsqd.serve()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except OSError as exc:
        log.error("failed to start", error=str(exc))
        return 1
    except BaseExceptionGroup as group:
        bad_metadata = group.subgroup(MetadataError)
        if bad_metadata is None:
            raise
        while isinstance(bad_metadata, BaseExceptionGroup):
            bad_metadata = bad_metadata.exceptions[0]
        log.error("failed to start", error=str(bad_metadata))
        return 1
    return 0
