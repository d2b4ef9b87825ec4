"""A topic: copies every published message into each of its channels.

Fan-out is synchronous and copies nothing: every channel receives a reference
to the same chunk of frames. A publish is all or nothing across channels:
each channel first writes what must be on disk (:meth:`Channel.prepare_put`),
and only when every write succeeded do they queue it, so a full disk refuses
the publish and leaves no partial copy behind.

While a topic has no channel, is paused, or is still starting (a new topic
waits for nsqlookupd to name its channels), it keeps what is published itself
(memory up to ``mem_queue_size``, then its own disk queue; a durable publish
goes to disk at once), as nsqd does, and hands that backlog on once it can:
the memory part at once, the disk part in bounded steps driven by the daemon
(:meth:`move_backlog`), so a deep backlog never stalls the event loop. A disk
record is released only once every channel has its copy (durably, for a
durable topic).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable

import structlog

from . import message
from .channel import Channel, ChannelExiting, PendingPut
from .diskq import DiskQueueError
from .diskq.records import RECORD_HEADER_SIZE
from .e2e import LatencyWindow
from .logs import LogThrottle
from .policy import TopicPolicy, with_channel_changes

if TYPE_CHECKING:
    from .diskq import DiskQueue

log = structlog.get_logger("nsqd.topic")

#: messages moved from a topic's disk backlog to its channels per step, and the bytes at which a
#: step stops early (within one disk scan window), so a backlog of large messages is moved a few
#: megabytes at a time, not 2,000 of them in one go
BACKLOG_STEP = 2000
BACKLOG_STEP_BYTES = 4 * 1024 * 1024
#: messages of the disk backlog lent to the channels' memory at most while the disk cannot take copies
LENT_LIMIT = 4 * BACKLOG_STEP
#: nanoseconds between tries at writing the channels' copies again while lending
LEND_RETRY_NS = 1_000_000_000


class _Lent:
    """A step of the topic's disk backlog handed to the channels in memory: each record stays
    in the topic's queue until no channel that got its message still holds it."""

    __slots__ = ("records", "ids", "kept", "channels")

    def __init__(self, records: list[tuple[bytes, int, int]], channels: list[Channel]) -> None:
        self.channels = channels
        self.keep(records)

    def keep(self, records: list[tuple[bytes, int, int]]) -> None:
        """Hold these (id, position, length) records, in position order; neighbours share an interval."""
        self.records = records
        self.ids = {msg_id for msg_id, _, _ in records}
        self.kept = _intervals((pos, length) for _, pos, length in records)


def _intervals(records: Iterable[tuple[int, int]]) -> list[tuple[int, int, None]]:
    """Kept intervals of (position, length) records in position order: only neighbours share one
    (an interval also holds every record between its ends)."""
    kept: list[tuple[int, int, None]] = []
    end = -1  # where the last kept record ends: a record starting there extends its interval
    for pos, length in records:
        if pos == end:
            kept[-1] = (kept[-1][0], pos, None)
        else:
            kept.append((pos, pos, None))
        end = pos + RECORD_HEADER_SIZE + length
    return kept


class QueueFull(Exception):
    """A publish would take a topic or one of its channels past its message limit."""


class Topic:
    def __init__(
        self,
        name: str,
        *,
        mem_queue_size: int,
        backend: DiskQueue | None,
        policy: TopicPolicy = TopicPolicy(),
        clock: Callable[[], int] = lambda: 0,
        open_channel_backend: Callable[[str, str], DiskQueue | None],
        on_channels_changed: Callable[[Topic], None],
        on_backlog: Callable[[Topic], None],
        on_last_channel_gone: Callable[[Topic], None],
        dead_letter: Callable[[list[bytes]], bool] | None = None,
        lease_timeout_ns: int = 60_000_000_000,
        e2e: tuple[int, list[float]] | None = None,
        disk_full: Callable[[], bool] = lambda: False,
        storage_failed: Callable[[str], None] = lambda error: None,
        channel_read_failed: Callable[[Channel], None] = lambda channel: None,
    ) -> None:
        self.name = name
        self.ephemeral = name.endswith("#ephemeral")
        self.mem_queue_size = mem_queue_size
        self.backend = backend
        self.policy = policy
        self.clock = clock
        self.channels: dict[str, Channel] = {}
        self.paused = False
        #: new, and waiting for nsqlookupd to name its channels: keeps what is published (see :meth:`start`)
        self.starting = False
        self.exiting = False
        self._open_channel_backend = open_channel_backend
        self._on_channels_changed = on_channels_changed
        self._on_backlog = on_backlog
        self._on_last_channel_gone = on_last_channel_gone
        self._dead_letter = dead_letter
        self._lease_timeout_ns = lease_timeout_ns
        #: (window ns, percentiles) when e2e latency is tracked
        self._e2e = e2e
        #: the daemon's global disk budget: True while it is used up
        self._disk_full = disk_full
        #: a write of the channels' copies failed (the daemon's health: /ping says NOK)
        self._storage_failed = storage_failed
        self._channel_read_failed = channel_read_failed
        # backlog kept while there is no channel or the topic is paused
        self._chunks: deque[tuple[list[bytes], list[bytes], int]] = deque()
        self._mem_count = 0
        #: records read from the backend whose channel copies are not durable yet (kept meanwhile)
        self._moving: list[tuple[int, int, None]] = []
        #: the records those intervals hold
        self._moving_count = 0
        #: steps of the disk backlog the channels hold in memory because their disks could not
        #: take copies (a full disk); see :meth:`_lend`
        self._lent: list[_Lent] = []
        #: while lending: when the channels' disks are tried again (daemon clock, ns)
        self._write_retry_ns = 0
        #: the mover waits before this topic's next step (lent steps are not finished yet)
        self.stalled = False
        #: called once when room may have been made (publishers starved by a limit wait on it); a
        #: dict, so a publisher that asks again while the topic stays full is in it once
        self._room_waiters: dict[Callable[[], None], None] = {}
        self.message_count = 0
        self.message_bytes = 0
        self.dropped_count = 0
        self._drop_log = LogThrottle()  # an ephemeral topic's drops: once a second at most
        if backend is not None:
            backend.keeper = self._kept

    # ------------------------------------------------------------- stats
    @property
    def backend_depth(self) -> int:
        return self.backend.depth if self.backend is not None else 0

    @property
    def depth(self) -> int:
        return self._mem_count + self.backend_depth

    # ---------------------------------------------------------- channels
    def get_channel(self, name: str, overrides: dict | None = None) -> Channel:
        channel = self.channels.get(name)
        if channel is None:
            if self.exiting:
                raise ChannelExiting("exiting")
            overrides = overrides or {}
            e2e = None
            if self._e2e is not None:
                e2e = LatencyWindow(self._e2e[0], self._e2e[1], self.clock())
            channel = Channel(
                self.name,
                name,
                mem_queue_size=self.mem_queue_size,
                backend=self._open_channel_backend(self.name, name),
                policy=with_channel_changes(self.policy.channel, overrides),
                overrides=overrides,
                clock=self.clock,
                lease_timeout_ns=self._lease_timeout_ns,
                dead_letter=self._dead_letter,
                e2e=e2e,
                on_last_consumer_gone=self._ephemeral_channel_gone,
                on_read_failed=self._channel_read_failed,
            )
            channel.write_through = self.policy.durable
            self.channels[name] = channel
            self._on_channels_changed(self)
            self.readers_changed()
            self._release_backlog()
            self._room_made()
        return channel

    def readers_changed(self) -> None:
        """A channel was added, emptied or deleted: what the topic's disk queue handed on is let go now.

        Its records read and handed to the channels are let go at the
        queue's next checkpoint, up to ``--sync-timeout`` later; a crash
        before it handed them again to the channels there were then: to a
        new one (messages published before it existed) and to an emptied or
        deleted one (messages it no longer had).
        """
        if self.backend is not None:
            self.backend.checkpoint_if_read()

    def delete_channel(self, name: str) -> None:
        channel = self.channels.pop(name)
        channel.exiting = True
        for sub in list(channel.subscriptions.values()):
            sub.consumer.close()
            sub.close()
        if channel.backend is not None:
            channel.backend.delete()
        self._on_channels_changed(self)
        self.readers_changed()
        self._room_made()
        if not self.channels and self.ephemeral:
            self._on_last_channel_gone(self)

    def _ephemeral_channel_gone(self, channel: Channel) -> None:
        if self.channels.get(channel.name) is channel:
            self.delete_channel(channel.name)

    def set_policy(self, policy: TopicPolicy) -> None:
        """A new policy in one step; channels follow its channel defaults where they have no override."""
        self.policy = policy
        for channel in self.channels.values():
            channel.set_policy(with_channel_changes(policy.channel, channel.overrides))
            channel.write_through = policy.durable
        self._room_made()

    def when_room(self, notify: Callable[[], None]) -> None:
        """Call ``notify`` once, as soon as room may have been made (messages left a queue, a limit changed)."""
        self._room_waiters[notify] = None
        for channel in self.channels.values():
            channel.on_room = self._room_made

    def forget_room_waiter(self, notify: Callable[[], None]) -> None:
        """Take back a :meth:`when_room` whose publisher went: the topic may stay full for long."""
        self._room_waiters.pop(notify, None)

    def _room_made(self) -> None:
        waiters, self._room_waiters = self._room_waiters, {}
        for channel in self.channels.values():
            channel.on_room = None
        for notify in waiters:
            notify()

    # ------------------------------------------------------------ limits
    def room(self) -> int | None:
        """How many more messages the limits allow; None when unbounded."""
        room = None
        if self.policy.max_messages:
            room = self.policy.max_messages - self.depth
        for channel in self.channels.values():
            if channel.policy.max_messages:
                channel_room = channel.policy.max_messages - channel.depth
                room = channel_room if room is None else min(room, channel_room)
        return room

    def byte_room(self) -> int | None:
        """How many more bytes the channels' byte limits allow; None when unbounded."""
        rooms = [c.policy.max_bytes - c.depth_bytes for c in self.channels.values() if c.policy.max_bytes]
        return min(rooms) if rooms else None

    @property
    def bounded(self) -> bool:
        return bool(self.policy.max_messages) or any(
            c.policy.max_messages or c.policy.max_bytes for c in self.channels.values())

    def check_message_room(self, count: int) -> None:
        """Raise QueueFull if ``count`` more messages would pass a ``reject`` message limit."""
        if self.policy.overflow == "reject" and self.bounded:
            room = self.room()
            if room is not None and count > room:
                raise QueueFull(
                    f"topic {self.name} is full: {count} more message(s) would pass its limit "
                    f"(room for {max(room, 0)})")

    @property
    def accepting(self) -> bool:
        if self._disk_full():
            return False
        if self.policy.overflow != "reject" or not self.bounded:
            return True
        room, byte_room = self.room(), self.byte_room()
        return (room is None or room > 0) and (byte_room is None or byte_room > 0)

    def _check_room(self, frames: list[bytes]) -> None:
        if self._disk_full():
            raise QueueFull(f"topic {self.name}: the daemon's disk budget (--max-disk-bytes) is used up")
        if self.policy.overflow == "reject" and self.bounded:
            self.check_message_room(len(frames))
            byte_room = self.byte_room()
            if byte_room is not None and sum(map(len, frames)) > byte_room:
                raise QueueFull(
                    f"topic {self.name} is full: {sum(map(len, frames))} more bytes would pass a channel's "
                    f"byte limit (room for {max(byte_room, 0)})")

    def _trim(self) -> None:
        """drop-oldest: every queue past its limit loses its oldest messages."""
        for channel in self.channels.values():
            limit = channel.policy.max_messages
            if limit and channel.depth > limit:
                channel.drop_oldest(channel.depth - limit)
            max_bytes = channel.policy.max_bytes
            if max_bytes:
                for _ in range(8):  # each step drops about the excess, by the average size
                    excess = channel.depth_bytes - max_bytes
                    if excess <= 0 or not channel.depth:
                        break
                    average = max(channel.depth_bytes // channel.depth, 1)
                    channel.drop_oldest(-(-excess // average))
        if self.policy.max_messages and self.depth > self.policy.max_messages:
            self._drop_oldest(self.depth - self.policy.max_messages)

    def _drop_oldest(self, count: int) -> None:
        dropped = 0
        while dropped < count and self._chunks:
            ids, frames, due_ns = self._chunks[0]
            cut = min(count - dropped, len(frames))
            if cut == len(frames):
                self._chunks.popleft()
            else:
                self._chunks[0] = (ids[cut:], frames[cut:], due_ns)
            self._mem_count -= cut
            dropped += cut
        if dropped < count and self.backend is not None:
            dropped += len(self.backend.read_many(count - dropped))
        self.dropped_count += dropped

    # ------------------------------------------------------------ publish
    def publish(self, ids: list[bytes], frames: list[bytes], nbytes: int, *, durable: bool = False,
                due_ns: int = 0) -> list[DiskQueue]:
        """Store a batch in every channel (or the topic's backlog); all or nothing.

        Returns the disk queues whose next fsync makes it durable (empty
        unless ``durable``). Raises QueueFull at a limit and DiskQueueError
        when it cannot be written; nothing of the batch is stored then.
        """
        if not frames:
            return []
        self._check_room(frames)
        channels = self.channels
        if channels and not self.paused and not self.starting:
            self._fan_out(ids, frames, durable, due_ns)
            queues = [c.backend for c in channels.values() if durable and c.backend is not None]
        else:
            queues = self._keep(ids, frames, due_ns, durable)
        self.message_count += len(frames)
        self.message_bytes += nbytes
        if self.policy.overflow != "reject" and self.bounded:
            self._trim()
        return queues

    def _fan_out(self, ids: list[bytes], frames: list[bytes], durable: bool, due_ns: int) -> None:
        prepared: list[PendingPut] = []
        try:
            for channel in self.channels.values():
                prepared.append(channel.prepare_put(ids, frames, durable, due_ns))
        except DiskQueueError:
            for put in prepared:
                put.channel.abort_put(put)
            raise
        for put in prepared:
            put.channel.commit_put(put)

    def _keep(self, ids: list[bytes], frames: list[bytes], due_ns: int, durable: bool) -> list[DiskQueue]:
        backend = self.backend
        if durable and backend is not None:
            backend.put_many(frames if not due_ns else [message.to_disk(f, due_ns=due_ns) for f in frames])
            return [backend]
        room = self.mem_queue_size - self._mem_count
        keep = min(len(frames), max(room, 0))
        rest = frames[keep:]
        if rest and backend is not None:
            backend.put_many(rest if not due_ns else [message.to_disk(f, due_ns=due_ns) for f in rest])
        if keep:
            self._chunks.append((ids[:keep], frames[:keep], due_ns) if keep < len(frames) else (ids, frames, due_ns))
            self._mem_count += keep
        if rest and backend is None:
            self.dropped_count += len(rest)
            if dropped := self._drop_log.due(len(rest)):
                log.warning("ephemeral topic full, dropping", topic=self.name, dropped=dropped)
        return []

    # ------------------------------------------------------------ backlog
    def _release_backlog(self) -> None:
        if not self.channels or self.paused or self.starting:
            return
        while self._chunks:
            ids, frames, due_ns = self._chunks[0]
            try:
                self._fan_out(ids, frames, False, due_ns)
            except DiskQueueError as exc:  # a full disk: memory-only messages stay in memory
                self._storage_failed(str(exc))
                log.error("topic backlog handed on in memory: the disk is full", topic=self.name, error=str(exc))
                self._fan_out_to_memory(ids, frames, due_ns)
            self._chunks.popleft()
            self._mem_count -= len(frames)
        if self.backend_depth or self._lent:
            self._on_backlog(self)

    def move_backlog(self) -> tuple[bool, list[DiskQueue]]:
        """Move one step of the backlog to the channels.

        Returns whether more remains and, for a durable topic, the channel
        queues to fsync before :meth:`backlog_moved` may release the step.
        """
        if not self.channels or self.paused or self.starting:
            return False, []
        if self._chunks:
            self._release_backlog()
        self.stalled = False
        if self._lent:
            self._finish_lent()
            if sum(len(lent.ids) for lent in self._lent) >= LENT_LIMIT:  # not finished yet
                self.stalled = True
                return True, []
        durable = self.policy.durable
        items: list[tuple[bytes, int, int, int]] = []  # (frame, due_ns, position, record length)
        if self.backend is not None:
            try:
                payloads, positions = self.backend.read_positioned(BACKLOG_STEP, BACKLOG_STEP_BYTES)
            except DiskQueueError as exc:  # out of descriptors, say: tried again after a pause
                log.error("cannot read the topic's disk queue", topic=self.name, error=str(exc))
                self.stalled = True
                return False, []
            for payload, pos in zip(payloads, positions):
                try:
                    frame, due_ns, _failed = message.from_disk(payload)
                except message.BadRecord as exc:
                    self.dropped_count += 1
                    log.error("undecodable message on disk", topic=self.name, error=str(exc))
                    continue
                items.append((frame, due_ns, pos, len(payload)))
        if not items:
            self.stalled = bool(self._lent)
            return bool(self._lent), []
        done: list[int] = []
        if self._lent and self.clock() < self._write_retry_ns:  # the disks failed moments ago
            self._lend(items, None)
        else:
            try:
                for frame, due_ns, pos, _ in items:
                    if due_ns:
                        self._fan_out([message.frame_id(frame)], [frame], durable, due_ns)
                        done.append(pos)
                plain = [item for item in items if not item[1]]
                if plain:
                    frames = [item[0] for item in plain]
                    self._fan_out(list(map(message.frame_id_of, frames)), frames, durable, 0)
                    done += [item[2] for item in plain]
            except DiskQueueError as exc:
                finished = set(done)
                self._lend([item for item in items if item[2] not in finished], str(exc))
        queues: list[DiskQueue] = []
        if durable and done:
            moved = set(done)  # (records read back after a restart need not be neighbours)
            self._moving += _intervals(sorted((pos, length) for _, _, pos, length in items if pos in moved))
            self._moving_count += len(done)
            queues = [c.backend for c in self.channels.values() if c.backend is not None]
        more = bool(self.backend is not None and self.backend.depth) or bool(self._lent)
        return more, queues

    def _lend(self, items: list[tuple[bytes, int, int, int]], error: str | None) -> None:
        """Hand a step to the channels in memory, past their bound: their disks cannot take copies.

        Without this a backlog the topic kept on a full disk could never
        reach a consumer (its copy needs room the disk lacks, and only the
        consumers reading it would make room). Each record stays in the
        topic's queue, kept, until no channel holds its message
        (:meth:`_finish_lent`), so a crash delivers them again and loses
        none; at most ``LENT_LIMIT`` messages are lent at a time.
        """
        if error is not None:
            self._storage_failed(error)
            if not self._lent:
                log.error("topic backlog lent to its channels in memory until the disk has room",
                          topic=self.name, error=error)
            self._write_retry_ns = self.clock() + LEND_RETRY_NS
        items = sorted(items, key=lambda item: item[2])
        for frame, due_ns, _, _ in items:
            if due_ns:
                self._fan_out_to_memory([message.frame_id(frame)], [frame], due_ns)
        frames = [item[0] for item in items if not item[1]]
        if frames:
            self._fan_out_to_memory(list(map(message.frame_id_of, frames)), frames, 0)
        self._lent.append(_Lent([(message.frame_id(frame), pos, length) for frame, _, pos, length in items],
                                list(self.channels.values())))
        self.stalled = sum(len(lent.ids) for lent in self._lent) >= LENT_LIMIT

    def _fan_out_to_memory(self, ids: list[bytes], frames: list[bytes], due_ns: int) -> None:
        for channel in self.channels.values():
            channel.commit_put(channel.prepare_in_memory(ids, frames, due_ns))

    def _finish_lent(self) -> None:
        """Let go of the lent records whose messages no channel holds any more (they may go)."""
        channels = self.channels
        changed = False
        for lent in self._lent:
            held: set[bytes] = set()
            for channel in lent.channels:
                if channels.get(channel.name) is channel:
                    held |= channel.held_of(lent.ids)
            if len(held) < len(lent.ids):
                lent.keep([record for record in lent.records if record[0] in held])
                changed = True
        if changed:
            self._lent = [lent for lent in self._lent if lent.records]
            if self.backend is not None:
                self.backend.kept_changed()

    def lent_ids(self) -> set[bytes]:
        """The messages lent to the channels whose records this topic keeps (none written again at shutdown)."""
        return set().union(*(lent.ids for lent in self._lent))

    def backlog_moved(self) -> None:
        """The channel copies of the moved steps are durable: their topic records may go."""
        self._moving.clear()
        self._moving_count = 0
        if self.backend is not None:  # else the checkpoint saved while they moved could stay the last:
            self.backend.request_checkpoint()  # every crash moved the whole backlog to the channels again

    def _kept(self) -> tuple[list, int]:
        kept = list(self._moving)
        count = self._moving_count  # they count: a restart delivers them again (else its depth fell short)
        for lent in self._lent:
            kept += lent.kept
            count += len(lent.records)
        return kept, count

    # -------------------------------------------------------------- admin
    def take_backlog(self, count: int) -> list[bytes]:
        frames = self._take_backlog(count)
        self._room_made()
        return frames

    def _take_backlog(self, count: int) -> list[bytes]:
        """Remove up to ``count`` of the topic's own backlog (oldest first), as frames."""
        frames: list[bytes] = []
        while len(frames) < count and self._chunks:
            ids, chunk_frames, due_ns = self._chunks[0]
            cut = min(count - len(frames), len(chunk_frames))
            frames += chunk_frames[:cut]
            if cut == len(chunk_frames):
                self._chunks.popleft()
            else:
                self._chunks[0] = (ids[cut:], chunk_frames[cut:], due_ns)
            self._mem_count -= cut
        if len(frames) < count and self.backend is not None:
            for payload in self.backend.read_many(count - len(frames)):
                try:
                    frames.append(message.from_disk(payload)[0])
                except message.BadRecord:
                    self.dropped_count += 1
        return frames

    def start(self) -> None:
        """Its channels are known: hand on what was kept meanwhile, as nsqd starts a topic's pump."""
        self.starting = False
        self._release_backlog()

    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self._release_backlog()

    def empty(self) -> None:
        """Drop the topic's own backlog. Records its channels still depend on stay: lent ones,
        and moved ones not durable in the channels yet (their only disk copy is here)."""
        self._chunks.clear()
        self._mem_count = 0
        if self.backend is not None:
            if self._lent or self._moving:
                self.backend.skip_unread()
            else:
                self.backend.empty()
        self._room_made()

    def shutdown_records(self) -> list[bytes]:
        """Shutdown: the disk records of the memory backlog."""
        return [message.to_disk(f, due_ns=due_ns) for _, frames, due_ns in self._chunks for f in frames]
