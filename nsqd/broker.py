"""The core: topics and channels, the one publish path, subscriptions, storage and metadata.

TCP, HTTP and AMQP are front ends of one :class:`Broker`: they publish through
:meth:`Broker.publish` (a :class:`Receipt`, or a :class:`PublishError` with
nothing stored), consume through :meth:`Broker.subscribe` (a
:class:`~nsqd.subscription.Subscription` that owns its in-flight messages)
and only encode the answers in their own protocol. Nothing here imports a
front end; the start-up module (``nsqd.nsqd``) builds the broker, opens it
(:meth:`Broker.running`) and starts the services around it.

Lifecycle (one nursery tree, nothing fire-and-forget)::

    running()
      queues nursery ........ disk queue background tasks (outlives the rest)
        load metadata, import a Go nsqd data directory if one is there
        core nursery ........ queue scan, backlog mover, metadata writer
      the caller runs its services, then drain()
      on the way out: every message held in memory is written to disk, the
      disk queues are closed, the metadata saved

Metadata is ``nsqd.dat`` in the data path, the same JSON Go nsqd writes, so
either daemon can read the other's; it is saved atomically (temp file, fsync,
rename) after every change to the set of topics and channels or a pause.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import structlog
import trio

from . import diskq, message, policy, steps, tls
from .body_budget import BodyBudget
from .channel import Channel, ChannelExiting
from .diskq import goimport, naming
from .diskq import lock as diskq_lock
from .diskq.trash import TrashBin
from .guid import ID_LIMIT, GUIDFactory, start_ahead
from .mpub import STEP_MESSAGES
from .names import is_valid_channel_name, is_valid_topic_name
from .options import OVERFLOW_POLICIES, TLS_NOT_REQUIRED, Options, OptionsError
from .slots import ConnectionSlots
from .subscription import Budget, Consumer, Subscription
from .topic import QueueFull, Topic
from .version import NSQD_VERSION

log = structlog.get_logger("nsqd")

METADATA_FILE = "nsqd.dat"
#: seconds between retries of a metadata save (or of a shutdown write) while the disk fails
STORAGE_RETRY = 1.0
#: the longest rest between two saves of nsqd.dat (changes made meanwhile go into the next)
METADATA_REST = 0.05
#: while storage fails, /ping says OK again once this much can be reserved in the data path
PROBE_BYTES = 1 << 20
PROBE_FILE = ".nsqd-storage-probe"
#: tries at writing what memory holds at shutdown before it is logged as lost
SHUTDOWN_RETRIES = 3
#: how long a stop waits for the commit rounds durable publishes wait on, so their answers go out
CONFIRM_AT_STOP = 1.0
#: the drain at a stop ends early once no consumer settled a message for this long (a client that
#: ignores CLOSE_WAIT and holds its messages would otherwise keep the stop for all of --shutdown-grace)
DRAIN_IDLE = 1.0
#: how long the disk queues' run() tasks get to end at shutdown before the queues are closed (those
#: still running are closed one by one in the Trio thread, as close() allows, the rest together)
RUN_END_WAIT = 5.0
#: fewest messages a step of a big batch holds, however many channels share them
MIN_STEP_MESSAGES = 1024
#: most channels a new topic takes from nsqlookupd: 110,000 names (900 KB) made as many disk
#: queues, with the event loop held for 23 minutes
LOOKUPD_CHANNELS = 1024
#: topics and channels nsqd.dat's document takes a step while the daemon runs (10,000 channels in
#: one go held the event loop for tens of milliseconds at every save)
METADATA_STEP = 256


class PublishError(Exception):
    """A publish the daemon did not take (or could not make durable).

    ``reason`` says why in words; ``kind`` is one of ``full`` (a limit or the
    disk budget), ``exiting`` (shutting down) and ``storage`` (the disk
    failed); ``retryable`` tells whether trying again can help.
    """

    def __init__(self, reason: str, *, kind: str, retryable: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        self.retryable = retryable


class SubscribeError(Exception):
    """A subscription the daemon refused (shutting down, a deleted channel, a consumer limit)."""


class Receipt:
    """What a publish was promised: ``count`` messages stored; durable once :meth:`wait` returns.

    Without durability to wait for, ``confirmed`` is already true and the
    front end answers at once; else one fsync per touched queue (group
    commit: one serves every publish waiting on it) confirms it.
    """

    __slots__ = ("count", "queues")

    def __init__(self, count: int, queues: list) -> None:
        self.count = count
        self.queues = queues

    @property
    def confirmed(self) -> bool:
        return not self.queues

    async def wait(self) -> None:
        """Return once the messages are fsynced; raises PublishError if they could not be."""
        for queue in self.queues:
            if queue.closed:  # its channel was deleted meanwhile: nothing to keep there
                continue
            try:
                await queue.wait_durable()
            except diskq.DiskQueueError as exc:
                if queue.closed:
                    continue
                raise PublishError(f"not durable: {exc}", kind="storage") from None
        self.queues = []

    def on_settled(self, callback: Callable[[PublishError | None], None]) -> None:
        """Call ``callback`` once the messages are fsynced (None) or could not be (the error).

        :meth:`wait` for a caller that is not a task: it runs in a disk
        queue's commit task (at once if nothing waits to be synced) and must
        not raise.
        """
        queues, self.queues = [q for q in self.queues if not q.closed], []
        if not queues:
            callback(None)
            return
        if len(queues) == 1:  # the usual case: one topic or channel queue
            settled_one = partial(_settled_one, queues[0], callback)
            try:
                queues[0].on_durable(settled_one)
            except diskq.DiskQueueError as exc:
                settled_one(exc)
            return
        outstanding = [len(queues), None]

        def settled(queue, error: diskq.DiskQueueError | None) -> None:
            if error is not None and not queue.closed and outstanding[1] is None:
                outstanding[1] = PublishError(f"not durable: {error}", kind="storage")
            outstanding[0] -= 1
            if not outstanding[0]:
                callback(outstanding[1])

        for queue in queues:
            try:
                queue.on_durable(partial(settled, queue))
            except diskq.DiskQueueError as exc:
                settled(queue, exc)


def _settled_one(queue, callback: Callable[[PublishError | None], None], error: diskq.DiskQueueError | None) -> None:
    callback(None if error is None or queue.closed else PublishError(f"not durable: {error}", kind="storage"))


class PublishInSteps:
    """A batch too big to store in one go without stalling every other client, stored a step at a time.

    Each :meth:`step` is one :meth:`Broker.publish`, all or nothing; the
    front end lets other clients run between steps, so their messages may
    land between this batch's steps (as they may under Go's topic read
    lock), while this batch's stay in order. A step holds :attr:`per_step`
    messages: ``STEP_MESSAGES`` copies in all, whatever the topic's channel
    count. Before the first step the whole batch (:attr:`total`) is checked
    against a ``reject`` limit. A later step that is refused (a full disk)
    leaves the steps before it stored, as Go's ``PutMessages`` does, and its
    error says how many were; the publisher that tries again gets those
    twice (at least once, never lost). The :meth:`receipt` waits for every
    queue any step wrote to.
    """

    def __init__(self, broker: Broker, topic_name: str) -> None:
        self.broker = broker
        self.topic_name = topic_name
        #: the batch's message count, set by the front end once it knows it (before the first step)
        self.total = 0
        #: messages stored so far
        self.count = 0
        self._queues: dict[int, object] = {}
        self.per_step = broker.messages_per_step(topic_name)

    def step(self, bodies: list) -> None:
        """Store the next step; raises PublishError (the steps before it stay stored)."""
        try:
            if not self.count:
                self._check_room()
            # a batch begun before a drain is stored to its end: cut off, its publisher could not
            # tell what was stored (the front ends shield its steps from the shutdown's cancel)
            receipt = self.broker.publish(self.topic_name, bodies, begun=self.count > 0)
        except PublishError as exc:
            if self.count:
                exc.reason = f"{exc.reason} ({self.count} of its {self.total} messages were stored)"
            raise
        self.count += receipt.count
        for queue in receipt.queues:
            self._queues.setdefault(id(queue), queue)

    def receipt(self) -> Receipt:
        return Receipt(self.count, list(self._queues.values()))

    def _check_room(self) -> None:
        topic = self.broker.topics.get(self.topic_name)
        if topic is not None:
            try:
                topic.check_message_room(self.total)
            except QueueFull as exc:
                raise PublishError(str(exc), kind="full") from None


class _SaveDone:
    """One save of nsqd.dat: its event is set when it ended; ``failed`` if it could not be written."""

    __slots__ = ("event", "failed")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.failed = False


class Broker:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.data_path = Path(options.data_path)
        self.topics: dict[str, Topic] = {}
        #: connections, for /stats producers and client counts
        self.clients: dict[int, object] = {}
        self.guid = GUIDFactory(options.node_id, ahead=start_ahead(options.max_body_size))
        self.tls_context = tls.server_context(options)
        if options.tls_required != TLS_NOT_REQUIRED and self.tls_context is None:
            raise OptionsError("--tls-required needs --tls-cert and --tls-key")
        #: NSQ TCP and AMQP connections share --max-connections
        self.connection_slots = ConnectionSlots(options.max_connections)
        #: memory for big command bodies being received, over every connection (--max-body-memory)
        self.body_budget = BodyBudget(options.max_body_memory)
        self.start_time = time.time()
        #: where the front ends listen, filled in by the start-up module (/info and nsqlookupd report them)
        self.tcp_addresses: list[tuple[str, int]] = []
        self.http_addresses: list[tuple[str, int]] = []
        self.https_addresses: list[tuple[str, int]] = []
        self.amqp_addresses: list[tuple[str, int]] = []
        self.amqps_addresses: list[tuple[str, int]] = []
        #: the ongoing storage failure (a full disk...), None while storage works
        self.storage_error: str | None = None
        self.default_policy = policy.defaults(options)
        #: bumped whenever a topic or channel appears or goes (the scan loop refreshes)
        self.channels_version = 0
        #: called whenever a topic or channel appears or goes (nsqlookupd registrations)
        self.on_topology_change: list[Callable[[], None]] = []
        #: bumped by :meth:`set_option`; waiters are woken (Go's optsNotificationChan)
        self.options_version = 0
        self._options_changed = trio.lowlevel.ParkingLot()
        #: set once shutdown starts: publishes and subscriptions are refused
        self.draining = False
        self._disk_checked = float("-inf")
        self._disk_used = 0
        self._client_seq = 0
        self._wall0 = time.time_ns()
        self._clock0: float | None = None
        #: the run's clock (``trio.current_time`` without its two wrappers: now_ns runs a few times a PUB)
        self._clock: trio.abc.Clock | None = None
        self._queues_nursery: trio.Nursery | None = None
        #: segments of emptied and deleted queues, unlinked in a worker thread (see diskq/trash.py)
        self._trash = TrashBin()
        self._backend_scopes: dict[int, trio.CancelScope] = {}
        #: the queues whose run() task has not ended (cancelled ones included)
        self._backends_running: set[int] = set()
        self._backend_ended = trio.lowlevel.ParkingLot()
        self._backlog: deque[Topic] = deque()
        self._backlog_lot = trio.lowlevel.ParkingLot()
        #: channels whose disk queue could not be read: their consumers are woken again after a pause
        self._unreadable: dict[Channel, None] = {}
        self._unreadable_lot = trio.lowlevel.ParkingLot()
        self._metadata_dirty = trio.Event()
        #: changes asked to be saved so far, and how many of them the last finished save held
        self._metadata_changes = 0
        self._metadata_saved = 0
        self._metadata_save_done = _SaveDone()
        self._loading = False
        #: the data directory as listed at start, less the queues opened since: a queue found
        #: nowhere in it has no files (a queue deleted since took its own), so opening a new
        #: one lists nothing; None where the listing failed (each queue then lists for itself)
        self._listing: naming.DirectoryListing | None = None
        #: nsqlookupd's HTTP addresses, and how to ask them for a topic's channels (set by the lookup
        #: service): a new topic starts with the channels they know, as in nsqd
        self.lookupd_http_addresses: Callable[[], list[str]] = list
        self.topic_channels: Callable[..., Awaitable[list[str]]] | None = None
        self._starting: deque[tuple[Topic, list[str]]] = deque()
        self._starting_lot = trio.lowlevel.ParkingLot()

    @property
    def health(self) -> str:
        """``OK``, or ``NOK - <reason>`` while storage is failing (what /ping answers, as Go)."""
        return "OK" if self.storage_error is None else f"NOK - {self.storage_error}"

    def _storage_failed(self, error: str) -> None:
        if self.storage_error is None:
            log.error("storage failing", error=error)
            self._metadata_dirty.set()  # the metadata writer probes the disk from now on
        self.storage_error = error

    def _storage_recovered(self) -> None:
        """The disk took a write again: /ping says OK, and the queues' last failures are history
        (a queue that still cannot write says so at its next write)."""
        if self.storage_error is not None:
            log.info("storage recovered", after=self.storage_error)
            self.storage_error = None
        for queue in self.backends():
            queue.failing = None

    @property
    def broadcast_tcp_port(self) -> int:
        """The TCP port told to nsqlookupd: ``--broadcast-tcp-port``, else the bound one (as Go's
        New rewrites the option once it listens, which /config then reports)."""
        return self.options.broadcast_tcp_port or (self.tcp_addresses[0][1] if self.tcp_addresses else 0)

    @property
    def broadcast_http_port(self) -> int:
        """``--broadcast-http-port``, else the bound HTTP port (as :attr:`broadcast_tcp_port`)."""
        return self.options.broadcast_http_port or (self.http_addresses[0][1] if self.http_addresses else 0)

    def now_ns(self) -> int:
        """Wall-clock nanoseconds that follow Trio's clock (so tests can jump time)."""
        if self._clock is None:
            return time.time_ns()
        return self._wall0 + int((self._clock.current_time() - self._clock0) * 1e9)

    def new_client_id(self) -> int:
        self._client_seq += 1
        return self._client_seq

    def add_client(self, client) -> None:
        self.clients[client.id] = client

    def remove_client(self, client) -> None:
        self.clients.pop(client.id, None)

    def publish(self, topic_name: str, bodies, *, defer_ns: int = 0, durable: bool = False,
                partial: bool = False, begun: bool = False) -> Receipt:
        """Publish message bodies to a topic: the one publish path of every front end.

        The topic's policy decides durability (``durable`` can only ask for
        more). Returns a :class:`Receipt`; raises PublishError with nothing
        stored. With ``partial``, a batch bigger than the room a ``reject``
        limit leaves is cut: the head is stored (``Receipt.count``). A later
        step of a batch ``begun`` before a drain is still stored.
        """
        if self.draining and not begun:
            raise PublishError("exiting", kind="exiting")
        count = len(bodies)
        try:
            topic = self.get_topic(topic_name)
        except ChannelExiting:
            raise PublishError("exiting", kind="exiting") from None
        except diskq.DiskQueueError as exc:
            self._storage_failed(str(exc))
            raise PublishError(f"cannot open the topic's storage: {exc}", kind="storage") from None
        if partial and topic.policy.overflow == "reject" and topic.bounded:
            room = topic.room()
            if room is not None and room < count:
                if room <= 0:
                    raise PublishError(f"topic {topic_name} is full", kind="full")
                count = room
                bodies = bodies[:count]
        now_ns = self.now_ns()
        ids = self.guid.new_ids(count)
        frames = message.encode_frames(ids, bodies, now_ns)
        try:
            queues = topic.publish(ids, frames, sum(map(len, bodies)), durable=durable or topic.policy.durable,
                                   due_ns=now_ns + defer_ns if defer_ns else 0)
        except QueueFull as exc:
            raise PublishError(str(exc), kind="full") from None
        except diskq.DiskQueueError as exc:
            self._storage_failed(str(exc))
            raise PublishError(f"cannot store: {exc}", kind="storage") from None
        return Receipt(count, queues)

    def messages_per_step(self, topic_name: str) -> int:
        """Messages a step of a big batch to a topic holds: about ``STEP_MESSAGES`` copies in all."""
        topic = self.topics.get(topic_name)
        channels = len(topic.channels) if topic is not None else 0
        return max(STEP_MESSAGES // max(channels, 1), MIN_STEP_MESSAGES)

    def publish_frames(self, topic_name: str, frames: list[bytes]) -> list:
        """Store already-encoded messages (dead letters, redrive): ids and attempts as they are."""
        topic = self.get_topic(topic_name)
        nbytes = sum(map(len, frames)) - message.FRAME_OVERHEAD * len(frames)
        return topic.publish(list(map(message.frame_id_of, frames)), frames, nbytes,
                             durable=topic.policy.durable)

    def subscribe(self, topic_name: str, channel_name: str, consumer: Consumer, *, budget: Budget,
                  msg_timeout_ns: int) -> Subscription:
        """Consume a channel (created if needed); raises SubscribeError."""
        if self.draining:
            raise SubscribeError("exiting")
        try:
            channel = self.get_topic(topic_name).get_channel(channel_name)
            return channel.subscribe(consumer, self.new_client_id(), budget, msg_timeout_ns=msg_timeout_ns,
                                     max_msg_timeout_ns=int(self.options.max_msg_timeout * 1e9),
                                     max_consumers=self.options.max_channel_consumers)
        except ChannelExiting as exc:
            raise SubscribeError(str(exc)) from None
        except diskq.DiskQueueError as exc:
            self._storage_failed(str(exc))
            raise SubscribeError(f"cannot open the channel's storage: {exc}") from None
        except ValueError as exc:
            raise SubscribeError(str(exc)) from None

    def declare(self, topic_name: str, channel_name: str = "") -> None:
        """Create a topic (and a channel of it) now; raises SubscribeError (exiting, storage)."""
        try:
            topic = self.get_topic(topic_name)
            if channel_name:
                topic.get_channel(channel_name)
        except ChannelExiting as exc:
            raise SubscribeError(str(exc)) from None
        except diskq.DiskQueueError as exc:
            self._storage_failed(str(exc))
            raise SubscribeError(f"cannot open storage: {exc}") from None

    def when_room(self, topic_name: str, notify: Callable[[], None]) -> None:
        """Call ``notify`` once, as soon as a topic that refused publishes may take some again."""
        topic = self.topics.get(topic_name)
        if topic is not None:
            topic.when_room(notify)

    def forget_room_waiter(self, topic_name: str, notify: Callable[[], None]) -> None:
        """Take back a :meth:`when_room` (its publisher went; else the topic keeps it until room is made)."""
        topic = self.topics.get(topic_name)
        if topic is not None:
            topic.forget_room_waiter(notify)

    def publish_room(self, topic_name: str) -> tuple[bool, int | None]:
        """Whether a topic takes publishes now, and how many more its limits allow (None: no limit)."""
        if self.draining:
            return False, 0
        topic = self.topics.get(topic_name)
        if topic is None:  # created by the first publish
            return True, None
        if topic.policy.overflow != "reject":
            return topic.accepting, None
        return topic.accepting, topic.room()

    def get_topic(self, name: str) -> Topic:
        topic = self.topics.get(name)
        if topic is None:
            if self.draining:
                raise ChannelExiting("exiting")
            opts = self.options
            e2e = None
            if opts.e2e_processing_latency_percentiles:
                e2e = (int(opts.e2e_processing_latency_window_time * 1e9),
                       list(opts.e2e_processing_latency_percentiles))
            topic = Topic(
                name,
                mem_queue_size=opts.mem_queue_size,
                backend=None if name.endswith("#ephemeral") else self.open_backend(name),
                policy=self.default_policy,
                clock=self.now_ns,
                open_channel_backend=self._open_channel_backend,
                on_channels_changed=self._topic_changed,
                on_backlog=self._schedule_backlog,
                on_last_channel_gone=self._ephemeral_topic_gone,
                dead_letter=partial(self.dead_letter, name),
                lease_timeout_ns=int(opts.msg_timeout * 1e9),
                e2e=e2e,
                disk_full=self._disk_full if opts.max_disk_bytes else (lambda: False),
                storage_failed=self._storage_failed,
                channel_read_failed=self._channel_read_failed,
            )
            self.topics[name] = topic
            log.info("TOPIC created", topic=name)
            self._topic_changed(topic)
            addresses = [] if self._loading else self.lookupd_http_addresses()
            if addresses:  # it keeps what is published until they answered (see _start_topic)
                topic.starting = True
                self._starting.append((topic, addresses))
                self._starting_lot.unpark_all()
        return topic

    async def _topic_starter(self) -> None:
        """Start new topics once nsqlookupd named their channels, each in its own task."""
        async with trio.open_nursery() as starting:
            while True:
                while not self._starting:
                    await self._starting_lot.park()
                starting.start_soon(self._start_topic, *self._starting.popleft())

    async def _start_topic(self, topic: Topic, addresses: list[str]) -> None:
        """Create the channels nsqlookupd knows for a new topic, then hand on what it kept meanwhile."""
        names = await self.topic_channels(addresses, topic.name) if self.topic_channels else []
        if len(names) > LOOKUPD_CHANNELS:
            log.warning("channels from nsqlookupd past the limit ignored", topic=topic.name, named=len(names),
                        limit=LOOKUPD_CHANNELS)
            names = names[:LOOKUPD_CHANNELS]
        try:
            for index, name in enumerate(names):
                if index % 16 == 0:
                    await trio.sleep(0)  # each is a disk queue opened: everybody else is served between
                if self.topics.get(topic.name) is not topic:
                    return  # deleted meanwhile
                topic.get_channel(name)
        except ChannelExiting:
            return
        if self.topics.get(topic.name) is not topic:
            return
        if names:
            log.info("channels from nsqlookupd", topic=topic.name, channels=names)
        topic.start()

    def dead_letter(self, topic_name: str, frames: list[bytes]) -> bool:
        """Publish messages a channel gave up on to ``<topic><suffix>``, ids and attempts kept.

        False when that topic cannot take them now (a full disk, its limit, shutdown): the
        channel keeps them and tries again.
        """
        name = topic_name + self.options.dead_letter_suffix
        if topic_name.endswith("#ephemeral") or not is_valid_topic_name(name):
            log.warning("dead letters dropped", topic=topic_name, count=len(frames))
            return True
        try:
            self.publish_frames(name, frames)
        except (QueueFull, ChannelExiting, diskq.DiskQueueError) as exc:
            if isinstance(exc, diskq.DiskQueueError):
                self._storage_failed(str(exc))
            log.error("dead letters kept in their channel until they can be stored", topic=topic_name,
                      dead_letter_topic=name, count=len(frames), error=str(exc))
            return False
        return True

    def disk_bytes(self) -> int:
        """Bytes of queued (unread) message records on disk, across every queue."""
        return sum(q.depth_bytes for q in self.backends())

    def backends(self) -> list:
        return [q for t in self.topics.values() for q in [t.backend, *(c.backend for c in t.channels.values())]
                if q is not None]

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
            self.delete_channel(topic, channel_name)
        if topic.backend is not None:
            self.close_backend(topic.backend, delete=True)
        log.info("TOPIC deleted", topic=name)
        self._topic_changed(topic)

    def delete_channel(self, topic: Topic, name: str) -> None:
        backend = topic.channels[name].backend
        topic.delete_channel(name)  # deletes the channel's queue
        if backend is not None:
            self._stop_backend(backend)
        log.info("CHANNEL deleted", topic=topic.name, channel=name)

    def set_topic_policy(self, topic: Topic, changes: dict) -> None:
        """Change a topic's policies (and its channels' defaults) in one step; raises PolicyError."""
        topic.set_policy(policy.with_topic_changes(topic.policy, changes))
        self.persist_metadata_soon()

    def set_channel_policy(self, channel: Channel, changes: dict) -> None:
        topic = self.topics[channel.topic_name]
        overrides = {**channel.overrides, **changes}
        channel.set_policy(policy.with_channel_changes(topic.policy.channel, overrides), overrides)
        self.persist_metadata_soon()

    def channels(self) -> list[Channel]:
        return [c for t in self.topics.values() for c in t.channels.values()]

    def _ephemeral_topic_gone(self, topic: Topic) -> None:
        if self.topics.get(topic.name) is topic:
            self.delete_topic(topic.name)

    def _topic_changed(self, topic: Topic) -> None:
        self.channels_version += 1
        self.persist_metadata_soon()
        for notify in self.on_topology_change:
            notify()

    def _schedule_backlog(self, topic: Topic) -> None:
        if topic not in self._backlog:
            self._backlog.append(topic)
            self._backlog_lot.unpark_all()

    def _disk_queue_options(self) -> dict:
        opts = self.options
        return dict(
            max_bytes_per_file=opts.max_bytes_per_file,
            min_msg_size=2 + message.FRAME_OVERHEAD - 8,
            max_msg_size=opts.max_msg_size + message.FRAME_OVERHEAD + 64,
            sync_every=opts.sync_every,
            sync_timeout=opts.sync_timeout,
            lock_file=False,  # the data path is locked as a whole (see running())
        )

    def open_backend(self, queue_name: str) -> diskq.DiskQueue:
        """Open (or create) a queue's files, first taking over what Go nsqd left for it; raises DiskQueueError."""
        listing = self._listing
        stem, go_stem = naming.queue_stem(queue_name), goimport.go_stem(queue_name)
        present = listing.names(stem) if listing is not None else None
        try:
            go_present = listing.names(go_stem) if listing is not None else None
            if goimport.go_queue_exists(queue_name, self.data_path, go_present):
                self._import_go_queue(queue_name)
                present = None  # the import wrote files of ours that the listing does not have
        except OSError as exc:  # the directory cannot be listed or read (out of descriptors, I/O error)
            raise diskq.DiskQueueError(f"disk queue {queue_name!r}: cannot take over Go nsqd's files in "
                                       f"{self.data_path}: {exc}") from exc
        backend = diskq.DiskQueue(queue_name, self.data_path, present_files=present, trash=self._trash,
                                  **self._disk_queue_options())
        if listing is not None:  # opened: from now on its files are its own business
            listing.forget(stem)
            listing.forget(go_stem)
        if self._queues_nursery is not None:
            self._queues_nursery.start_soon(self._run_backend, backend)
            backend.run_scheduled()
        return backend

    def _open_channel_backend(self, topic_name: str, channel_name: str) -> diskq.DiskQueue | None:
        if channel_name.endswith("#ephemeral"):
            return None
        return self.open_backend(f"{topic_name}:{channel_name}")

    async def _run_backend(self, backend: diskq.DiskQueue) -> None:
        if backend.closed:  # deleted or closed before this task began: nothing left to commit
            return
        with trio.CancelScope() as scope:
            self._backend_scopes[id(backend)] = scope
            self._backends_running.add(id(backend))
            try:
                await backend.run()
            finally:
                self._backend_scopes.pop(id(backend), None)
                self._backends_running.discard(id(backend))
                self._backend_ended.unpark_all()

    def close_backend(self, backend: diskq.DiskQueue, delete: bool = False) -> None:
        self._stop_backend(backend)
        if delete:
            backend.delete()
        else:
            backend.close()

    def _stop_backend(self, backend: diskq.DiskQueue) -> None:
        """Cancel the queue's run() task (its commits and checkpoints)."""
        scope = self._backend_scopes.pop(id(backend), None)
        if scope is not None:
            scope.cancel()

    def _import_go_queue(self, queue_name: str) -> None:
        """Take over the backlog a Go nsqd left for this queue, then remove its files.

        The messages are appended to our own queue and fsynced (by closing it)
        before the Go files are deleted, so a crash in between duplicates at
        worst and never loses.
        """
        backend = diskq.DiskQueue(queue_name, self.data_path, **self._disk_queue_options())
        imported = 0
        batch: list[bytes] = []
        try:
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
        except BaseException:  # Go's files stay, to be taken over next time (duplicates at worst)
            try:
                backend.close()
            except diskq.DiskQueueError:
                pass
            raise
        backend.close()
        goimport.remove_go_queue(queue_name, self.data_path)
        log.info("imported Go nsqd queue", queue=queue_name, messages=imported)

    def metadata(self) -> str:
        """nsqd.dat's document, all at once (shutdown)."""
        return steps.run_whole(self._metadata_steps())

    async def metadata_paced(self) -> str:
        """nsqd.dat's document, other work running between steps of METADATA_STEP topics and channels."""
        return await steps.run_paced(self._metadata_steps())

    def _metadata_steps(self) -> Generator[None, None, str]:
        """Builds the document on the event loop, which owns the topics and channels, into data of
        its own (written in a worker thread); one gone between steps is left out.

        Built as JSON text an entry at a time: text is not tracked by the garbage collector. As
        dicts, each save's tens of thousands of objects lived across steps into the old
        generation, and with 10,000 topics the full collections they brought on held the event
        loop for a second each.
        """
        encode = _COMPACT_JSON.encode
        topics: list[str] = []
        default = policy.topic_document(self.default_policy)
        taken = 0
        for topic in sorted(self.topics.values(), key=lambda t: t.name):
            if topic.ephemeral:
                continue
            channels: list[str] = []
            for channel in sorted(topic.channels.values(), key=lambda c: c.name):
                taken += 1
                if not taken % METADATA_STEP:
                    yield
                if channel.ephemeral or topic.channels.get(channel.name) is not channel:
                    continue
                channels.append(encode({"name": channel.name, "paused": channel.paused,
                                        **({"policy": dict(channel.overrides)} if channel.overrides else {})}))
            taken += 1
            if not taken % METADATA_STEP:
                yield
            if self.topics.get(topic.name) is not topic:
                continue
            changed = policy.overrides(policy.topic_document(topic.policy), default)
            rest = encode({"name": topic.name, "paused": topic.paused, **({"policy": changed} if changed else {})})
            topics.append(f'{{"channels":[{",".join(channels)}],{rest[1:]}')
        return (f'{{"topics":[{",".join(topics)}],"version":{encode(NSQD_VERSION)},'
                f'"last_message_id":{self.guid.last}}}')

    def persist_metadata_soon(self) -> None:
        if not self._loading:
            self._metadata_changes += 1
            self._metadata_dirty.set()

    async def metadata_saved(self, timeout: float = 5.0) -> None:
        """Wait until nsqd.dat holds every change made so far (as Go persists a pause before it
        answers), or a save failed (the writer retries, /ping says NOK), or ``timeout`` passed."""
        wanted = self._metadata_changes
        with trio.move_on_after(timeout):
            while self._metadata_saved < wanted:
                done = self._metadata_save_done
                await done.event.wait()
                if done.failed:
                    return

    def save_metadata(self, document: str | None = None) -> None:
        """Write ``document`` (default: the state now) as nsqd.dat, durably; in a worker thread
        only with a document built on the event loop (:meth:`metadata_paced`)."""
        path = self.data_path / METADATA_FILE
        tmp = path.with_name(f"{METADATA_FILE}.{os.getpid()}.tmp")
        data = (self.metadata() if document is None else document).encode()
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        dir_fd = os.open(self.data_path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def load_metadata(self) -> None:
        """Create the topics and channels of ``nsqd.dat``; one that is not what we (or Go nsqd)
        write stops start-up with a :class:`MetadataError` saying what is wrong and what to do."""
        try:
            self._listing = naming.DirectoryListing(self.data_path, (naming.QUEUE_MARKER, goimport.GO_MARKER))
        except OSError:  # each queue lists the directory itself, and says what failed
            self._listing = None
        path = self.data_path / METADATA_FILE
        for stale in self.data_path.glob(f"{METADATA_FILE}.*.tmp"):  # a save a crash cut short
            stale.unlink(missing_ok=True)
        if path.exists():
            self._load_metadata_file(path)
        self._adopt_unlisted_queues()

    def _load_metadata_file(self, path: Path) -> None:
        try:
            data = _checked_metadata(path.read_bytes())
        except ValueError as exc:
            raise MetadataError(
                f"{path} is not valid nsqd metadata ({exc}): move it aside to start without it (topics and "
                f"channels with queues on disk come back at start, with default policies, unpaused) or restore "
                f"it from a backup") from None
        self.guid = GUIDFactory(self.options.node_id, floor=int(data.get("last_message_id", 0)) + 1,
                                ahead=start_ahead(self.options.max_body_size))
        self._loading = True
        try:
            for t in data.get("topics") or []:
                topic = self.get_topic(t["name"])
                topic.set_policy(policy.with_topic_changes(self.default_policy, t.get("policy") or {}))
                for c in t.get("channels") or []:
                    channel = topic.get_channel(c["name"], c.get("policy") or {})
                    if c.get("paused"):
                        channel.pause()
                if t.get("paused"):
                    topic.pause()
        finally:
            self._loading = False
        log.info("metadata loaded", topics=len(self.topics), channels=len(self.channels()))

    def _adopt_unlisted_queues(self) -> None:
        """Open the queues on disk that ``nsqd.dat`` does not list, with their topics and channels.

        A topic or channel is saved in ``nsqd.dat`` a moment after it is
        created (the metadata writer), but its first publish is confirmed as
        soon as its disk queue has the messages: a crash in between leaves
        confirmed messages in a queue that nothing names. Such a queue (a
        segment present: a new queue writes no metadata file before its first
        checkpoint, and a deleted queue loses its segments first) comes back at
        start, with default policies, unpaused.
        """
        listing = self._listing
        if listing is None:
            return
        adopted = []
        self._loading = True
        try:
            for stem in listing.stems(naming.QUEUE_MARKER):
                names = listing.names(stem)
                if not any(n.endswith(".dat") and n[len(stem):-4].isdigit() for n in names):
                    continue
                try:
                    queue_name = naming.unescape_name(stem[:-len(naming.QUEUE_MARKER)])
                except ValueError:
                    continue
                topic_name, _, channel_name = queue_name.partition(":")
                if not is_valid_topic_name(topic_name) or (channel_name and not is_valid_channel_name(channel_name)):
                    continue
                if topic_name.endswith("#ephemeral"):  # never kept across a restart, as in Go nsqd
                    continue
                topic = self.get_topic(topic_name)
                if channel_name:
                    topic.get_channel(channel_name)
                adopted.append(queue_name)
        finally:
            self._loading = False
        if adopted:
            log.warning("queues missing from nsqd.dat adopted (a crash right after they were created)",
                        queues=sorted(adopted))
            self._metadata_dirty.set()

    def _declare(self) -> None:
        """Create the topics and channels the configuration declares (``--declare``)."""
        for value in self.options.declare:
            topic_name, _, channel_name = value.partition(":")
            topic = self.get_topic(topic_name)
            if channel_name:
                topic.get_channel(channel_name)

    async def _metadata_writer(self) -> None:
        """Save nsqd.dat after changes (coalesced); on a disk failure retry, and report NOK meanwhile.

        While storage is failing it saves nsqd.dat every ``STORAGE_RETRY``
        and reserves ``PROBE_BYTES`` as a probe of the disk: once both work,
        /ping says OK again (waiting for each failed queue's next write kept
        it NOK for good when that queue went quiet).
        """
        while True:
            if self.storage_error is None:
                await self._metadata_dirty.wait()
            else:
                with trio.move_on_after(STORAGE_RETRY):
                    await self._metadata_dirty.wait()
            self._metadata_dirty = trio.Event()
            if self.storage_error is not None:
                self._seal_drained_queues()
            changes = self._metadata_changes
            done, self._metadata_save_done = self._metadata_save_done, _SaveDone()
            started = trio.current_time()
            try:
                await trio.to_thread.run_sync(self.save_metadata, await self.metadata_paced())
            except OSError as exc:
                self._storage_failed(f"cannot save {self.data_path / METADATA_FILE}: {exc}")
                done.failed = True
                done.event.set()
                self._metadata_dirty.set()
                await trio.sleep(STORAGE_RETRY)
                continue
            self._metadata_saved = changes
            done.event.set()
            if self.storage_error is not None and await trio.to_thread.run_sync(self._room_to_write):
                self._storage_recovered()
            # coalesce bursts of changes: rest as long as the save took (at most 50 ms), so a
            # pause on a small daemon is answered in a few ms (a fixed 50 ms made a run of
            # them wait 45 ms each) and saving a big document takes at most half the time
            await trio.sleep(min(trio.current_time() - started, METADATA_REST))

    def _seal_drained_queues(self) -> None:
        """While storage fails: every queue read to its end starts a new segment, whatever the
        size of its current one, so that one is deleted once its records are released (the
        space consumers free must come back, or the disk stays full however much they read)."""
        for topic in list(self.topics.values()):
            for queue in (topic.backend, *(channel.backend for channel in topic.channels.values())):
                if queue is not None and not queue.closed:
                    queue.seal_if_drained(0)

    def _room_to_write(self) -> bool:
        """Whether the data path has ``PROBE_BYTES`` free for a write (blocks reserved, then freed)."""
        path = self.data_path / PROBE_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(fd, 0, PROBE_BYTES)
            finally:
                os.close(fd)
                os.unlink(path)
        except OSError:
            return False
        return True

    async def _backlog_mover(self) -> None:
        """Hand topics' disk backlogs to their channels in bounded steps.

        A durable topic's step is released only once the channels' copies are
        fsynced; a step that could not be written (a full disk) is tried again
        after a pause.
        """
        while True:
            while not self._backlog:
                await self._backlog_lot.park()
            topic = self._backlog.popleft()
            if topic.exiting:
                continue
            more, queues = topic.move_backlog()
            if queues:
                try:
                    for queue in queues:
                        if not queue.closed:
                            await queue.wait_durable()
                except diskq.DiskQueueError as exc:
                    log.error("topic backlog step not yet durable", topic=topic.name, error=str(exc))
                else:
                    topic.backlog_moved()
            if topic.stalled:
                await trio.sleep(STORAGE_RETRY)
            if (more or topic.stalled) and topic not in self._backlog:
                self._backlog.append(topic)
            await trio.sleep(0)

    def _channel_read_failed(self, channel: Channel) -> None:
        self._unreadable[channel] = None
        self._unreadable_lot.unpark_all()

    async def _read_retrier(self) -> None:
        """Wake, ``STORAGE_RETRY`` after a read of their disk queue failed, the consumers of those
        channels: they asked for messages that are on disk, and nothing else may wake them."""
        while True:
            while not self._unreadable:
                await self._unreadable_lot.park()
            await trio.sleep(STORAGE_RETRY)
            channels, self._unreadable = self._unreadable, {}
            for channel in channels:
                if not channel.exiting:
                    channel.wake_all()

    async def drain(self) -> None:
        """Graceful drain: no new publishes, subscriptions or deliveries; consumers get
        ``--shutdown-grace`` to finish what they hold, or until none has settled anything for
        :data:`DRAIN_IDLE` (everything else is persisted)."""
        self.draining = True
        settled = trio.lowlevel.ParkingLot()
        for channel in self.channels():
            channel.draining = True
            channel.on_settled = settled.unpark_all
            for sub in list(channel.subscriptions.values()):
                sub.consumer.drain()
        await self._settle_confirmations()
        in_flight = sum(c.in_flight_count for c in self.channels())
        log.info("draining", in_flight=in_flight, grace=self.options.shutdown_grace)
        with trio.move_on_after(self.options.shutdown_grace):
            while sum(c.in_flight_count for c in self.channels()):
                with trio.move_on_after(DRAIN_IDLE) as idle:
                    await settled.park()  # woken whenever a channel's in-flight messages are settled
                if idle.cancelled_caught:  # nobody is finishing what they hold: stop as Go does
                    break
        left = sum(c.in_flight_count for c in self.channels())
        log.info("drained", finished=in_flight - left, still_in_flight=left)

    async def _settle_confirmations(self) -> None:
        """Durable publishes taken before the drain are answered before connections close (no new
        ones come): their commit rounds settle, and the connections woken by them write."""
        with trio.move_on_after(CONFIRM_AT_STOP):
            for topic in list(self.topics.values()):
                for queue in [topic.backend, *(c.backend for c in topic.channels.values())]:
                    if queue is not None and not queue.closed:
                        await queue.settle_confirmations()
            await trio.lowlevel.checkpoint()  # tasks those rounds woke run before we go on

    async def _persist(self) -> None:
        """Write everything held in memory to the disk queues, close them, save metadata.

        Each queue on its own and in steps, so a full disk costs only what
        does not fit: what could not be written is tried again a few times
        (``SHUTDOWN_RETRIES``, ``STORAGE_RETRY`` apart), then logged with how
        many messages it loses; the rest is saved and the daemon exits 0.
        """
        await self._stop_backends()  # first: the writes below would each start a commit round
        pending: list[tuple[diskq.DiskQueue, list[bytes]]] = []
        saved = failures = 0
        for topic in list(self.topics.values()):
            lent = topic.lent_ids()
            for channel in topic.channels.values():
                if channel.backend is not None and not channel.backend.closed:
                    pending.append((channel.backend, channel.shutdown_records(lent)))
            if topic.backend is not None and not topic.backend.closed:
                pending.append((topic.backend, topic.shutdown_records()))
        for attempt in range(SHUTDOWN_RETRIES):
            left = []
            for backend, records in pending:
                written = _write_steps(backend, records)
                saved += written
                if written < len(records):
                    left.append((backend, records[written:]))
            if not left:
                break
            if attempt + 1 < SHUTDOWN_RETRIES:
                await trio.sleep(STORAGE_RETRY)
            pending = left
        else:
            for backend, records in pending:
                failures += 1
                log.error("messages held in memory could not be written at shutdown and are lost",
                          queue=backend.name, lost=len(records), error=backend.failing)
        failures += await self._close_backends()
        if not await self._save_metadata_at_stop():
            failures += 1
        if failures:
            log.error("state persisted with failures", messages=saved, failures=failures)
        else:
            log.info("state persisted", messages=saved)

    async def _save_metadata_at_stop(self) -> bool:
        """Save nsqd.dat, tried again as the messages are; else log which changes a restart will not see.

        Each of those changes was answered (a pause, a delete, a new topic
        made while the disk was full): the line says what comes back as it
        was before them.
        """
        document = self.metadata()
        for attempt in range(SHUTDOWN_RETRIES):
            try:
                self.save_metadata(document)
                return True
            except OSError as exc:
                error = exc
            if attempt + 1 < SHUTDOWN_RETRIES:
                await trio.sleep(STORAGE_RETRY)
        try:
            saved = _checked_metadata((self.data_path / METADATA_FILE).read_bytes())
        except (OSError, ValueError):
            saved = {}
        changes = metadata_changes(saved, json.loads(document))
        if not changes:  # nothing a restart would miss (ids run ahead on start: guid.start_ahead)
            log.warning("metadata could not be saved at shutdown; the saved one already holds every change",
                        error=str(error))
            return True
        log.error("metadata could not be saved at shutdown; a restart will not see these changes",
                  error=str(error), **changes)
        return False

    async def _stop_backends(self) -> None:
        """Cancel every queue's run() task and wait (at most :data:`RUN_END_WAIT`) for them to end:
        a commit under way is finished, none is started, and close() does the last fsyncs."""
        for backend in self.backends():
            self._stop_backend(backend)
        with trio.move_on_after(RUN_END_WAIT):
            while self._backends_running:
                await self._backend_ended.park()

    async def _close_backends(self) -> int:
        """Close every queue; returns how many failed (each logged).

        Those whose run() task ended (see :meth:`_stop_backends`) are closed
        together in a worker thread (``diskq.close_many``: two syncs of the
        file system for all of them, where 5,000 topics closed one by one took
        16.7 s); the others here, one by one.
        """
        backends = [backend for backend in self.backends() if not backend.closed]
        alone = [backend for backend in backends if id(backend) in self._backends_running]
        together = [backend for backend in backends if id(backend) not in self._backends_running]
        errors = await trio.to_thread.run_sync(diskq.close_many, together) if together else []
        failures = 0
        for backend, error in [*zip(together, errors), *((backend, None) for backend in alone)]:
            try:
                if backend in alone:
                    backend.close()
                else:
                    backend.closed_files(error)
            except diskq.DiskQueueError as exc:
                failures += 1
                log.error("queue could not be closed cleanly", queue=backend.name, error=str(exc))
        return failures

    # ------------------------------------------------------------ options
    def set_option(self, name: str, value) -> None:
        """Change an option at run time; the parts that use it are woken to apply it."""
        setattr(self.options, name, value)
        self.options_version += 1
        self._options_changed.unpark_all()

    async def wait_options_changed(self, seen: int) -> int:
        """Return the options version once it differs from ``seen``."""
        while self.options_version == seen:
            await self._options_changed.park()
        return self.options_version

    # ------------------------------------------------------------ lifecycle
    @asynccontextmanager
    async def running(self):
        """Open the storage and run the core loops for the block; everything is written to disk after it.

        The queue scan, the backlog mover and the metadata writer run in a
        nursery that ends with the block; the disk queues' tasks in one that
        outlives it, so the final writes and the last fsyncs happen after
        every front end is gone.
        """
        from .queue_scan import queue_scan_loop

        self._clock = trio.lowlevel.current_clock()
        self._clock0 = self._clock.current_time()
        self._wall0 = time.time_ns()
        self.data_path.mkdir(parents=True, exist_ok=True)
        data_lock = self._lock_data_path()
        try:
            async with trio.open_nursery() as queues:
                self._queues_nursery = queues
                self._trash.sweep(self.data_path)
                queues.start_soon(self._trash.run)
                self.load_metadata()  # outside the try: a file we cannot read must not be overwritten on the way out
                try:
                    self._declare()
                    async with trio.open_nursery() as core:
                        core.start_soon(queue_scan_loop, self)
                        core.start_soon(self._backlog_mover)
                        core.start_soon(self._read_retrier)
                        core.start_soon(self._metadata_writer)
                        core.start_soon(self._topic_starter)
                        for topic in self.topics.values():
                            if topic.channels and topic.backend_depth:
                                self._schedule_backlog(topic)
                        yield self
                        core.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True):
                        await self._persist()
                    queues.cancel_scope.cancel()
        finally:
            os.close(data_lock)

    def _lock_data_path(self) -> int:
        """One daemon per data path, as Go nsqd: its queues then need no lock files of their own."""
        try:
            return diskq_lock.acquire_directory_lock(self.data_path)
        except BlockingIOError:
            raise MetadataError(f"--data-path={self.data_path} in use (possibly by another instance of nsqd)") from None


def _write_steps(backend: diskq.DiskQueue, records: list[bytes], step: int = 256) -> int:
    """Write records in steps; returns how many were written before the disk refused.

    A step the disk refuses is tried again record by record, to keep what
    still fits; so is one that ran out of memory (the daemon may be stopping
    because it is near its limit), rather than giving up every queue.
    """
    written = 0
    while written < len(records):
        try:
            backend.put_many(records[written:written + step])
        except (diskq.DiskQueueError, MemoryError):
            if step > 1:
                step = 1  # squeeze in what still fits, one by one
                continue
            break
        written += min(step, len(records) - written)
    return written


#: nsqd.dat's encoder: compact, as Go writes it
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


def metadata_changes(saved: dict, now: dict, most: int = 20) -> dict[str, str]:
    """What differs between two nsqd.dat documents, for a log line: per kind of change, up to ``most``
    names (``topic`` or ``topic/channel``), comma-separated; kinds without a change are left out."""
    def entries(document: dict) -> dict[str, dict]:
        found = {}
        for topic in document.get("topics") or []:
            found[topic["name"]] = topic
            for channel in topic.get("channels") or []:
                found[f"{topic['name']}/{channel['name']}"] = channel
        return found

    before, after = entries(saved), entries(now)
    changes = {
        "created": [name for name in after if name not in before],
        "deleted": [name for name in before if name not in after],
        "paused": [name for name in after if name in before and after[name].get("paused")
                   and not before[name].get("paused")],
        "unpaused": [name for name in after if name in before and before[name].get("paused")
                     and not after[name].get("paused")],
        "policy_changed": [name for name in after if name in before
                           and after[name].get("policy") != before[name].get("policy")],
    }
    return {kind: ",".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
            for kind, names in changes.items() if names}


class MetadataError(Exception):
    """The data path or ``nsqd.dat`` cannot be used; the message is the whole story, for one log line."""


def _checked_metadata(raw: bytes) -> dict:
    """``nsqd.dat`` decoded, its shape checked; ValueError says what is wrong, briefly."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    last_id = data.get("last_message_id", 0)
    if type(last_id) is not int or not 0 <= last_id < ID_LIMIT:
        raise ValueError("last_message_id is not a 64-bit message id")
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


def _check_policy(document, owner: str) -> None:
    if document is None:
        return
    if not isinstance(document, dict):
        raise ValueError(f"policy of {owner} is not an object")
    fields = policy.CHANNEL_FIELDS if owner.startswith("channel") else policy.TOPIC_FIELDS
    for key, value in document.items():
        if key not in fields or type(value) is not fields[key] or (type(value) is int and not 0 <= value < 1 << 63):
            raise ValueError(f"policy of {owner} has a bad {key}")
        if key == "overflow" and value not in OVERFLOW_POLICIES:
            raise ValueError(f"policy of {owner} has a bad overflow")
