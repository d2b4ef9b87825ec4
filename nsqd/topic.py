"""A topic: copies every published message into each of its channels.

Fan-out is synchronous and copies nothing: every channel receives a reference
to the same chunk of frames. While a topic has no channel, or is paused, it
keeps what is published itself (memory up to ``mem_queue_size``, then its own
disk queue), as nsqd does, and hands that backlog on once it can: the memory
part at once, the disk part in bounded steps driven by the daemon
(:meth:`move_backlog`), so a deep backlog never stalls the event loop.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

import structlog

from . import message
from .channel import Channel, ChannelExiting
from .e2e import LatencyWindow

if TYPE_CHECKING:
    from .diskq import DiskQueue

log = structlog.get_logger("nsqd.topic")

#: messages moved from a topic's disk backlog to its channels per step
BACKLOG_STEP = 2000


class QueueFull(Exception):
    """A publish would take a topic or one of its channels past its message limit."""


class Topic:
    def __init__(
        self,
        name: str,
        *,
        mem_queue_size: int,
        backend: DiskQueue | None,
        max_messages: int = 0,
        channel_max_messages: int = 0,
        open_channel_backend: Callable[[str, str], DiskQueue | None],
        on_channels_changed: Callable[[Topic], None],
        on_backlog: Callable[[Topic], None],
        on_last_channel_gone: Callable[[Topic], None],
    ) -> None:
        self.name = name
        self.ephemeral = name.endswith("#ephemeral")
        self.mem_queue_size = mem_queue_size
        self.backend = backend
        self.max_messages = max_messages
        self.channel_max_bytes = 0
        #: the daemon's global disk budget: True while it is used up
        self.disk_full: Callable[[], bool] = lambda: False
        # policies beyond nsqd, applied to channels as they are created
        self.overflow = "reject"
        self.max_attempts = 0
        self.ttl_ns = 0
        self.dead_letter: Callable[[list[bytes]], None] | None = None
        #: set by the daemon when e2e latency percentiles are configured
        self.e2e_percentiles: list[float] = []
        self.e2e_window_ns = 0
        self.e2e_now: Callable[[], int] = lambda: 0
        self.channel_max_messages = channel_max_messages
        self.channels: dict[str, Channel] = {}
        self.paused = False
        self.exiting = False
        self._open_channel_backend = open_channel_backend
        self._on_channels_changed = on_channels_changed
        self._on_backlog = on_backlog
        self._on_last_channel_gone = on_last_channel_gone
        # backlog kept while there is no channel or the topic is paused
        self._chunks: deque[tuple[list[bytes], list[bytes], int]] = deque()
        self._mem_count = 0
        self.message_count = 0
        self.message_bytes = 0
        self.dropped_count = 0

    # ------------------------------------------------------------- stats
    @property
    def backend_depth(self) -> int:
        return self.backend.depth if self.backend is not None else 0

    @property
    def depth(self) -> int:
        return self._mem_count + self.backend_depth

    # ---------------------------------------------------------- channels
    def get_channel(self, name: str) -> Channel:
        channel = self.channels.get(name)
        if channel is None:
            if self.exiting:
                raise ChannelExiting("exiting")
            channel = Channel(
                self.name,
                name,
                mem_queue_size=self.mem_queue_size,
                backend=self._open_channel_backend(self.name, name),
                on_last_consumer_gone=self._ephemeral_channel_gone,
            )
            if self.e2e_percentiles:
                channel.e2e = LatencyWindow(self.e2e_window_ns, self.e2e_percentiles, self.e2e_now())
            channel.max_messages = self.channel_max_messages
            channel.max_bytes = self.channel_max_bytes
            channel.max_attempts = self.max_attempts
            channel.ttl_ns = self.ttl_ns
            channel.dead_letter = self.dead_letter
            self.channels[name] = channel
            self._on_channels_changed(self)
            self._release_backlog()
        return channel

    def delete_channel(self, name: str) -> None:
        channel = self.channels.pop(name)
        channel.exiting = True
        for consumer_id in list(channel.consumers):
            channel.remove_consumer(consumer_id)
        if channel.backend is not None:
            channel.backend.delete()
        self._on_channels_changed(self)
        if not self.channels and self.ephemeral:
            self._on_last_channel_gone(self)

    def _ephemeral_channel_gone(self, channel: Channel) -> None:
        if self.channels.get(channel.name) is channel:
            self.delete_channel(channel.name)

    # ------------------------------------------------------------ publish
    def room(self) -> int | None:
        """How many more messages the limits allow; None when unbounded."""
        room = None
        if self.max_messages:
            room = self.max_messages - self.depth
        for channel in self.channels.values():
            if channel.max_messages:
                channel_room = channel.max_messages - channel.depth
                room = channel_room if room is None else min(room, channel_room)
        return room

    def byte_room(self) -> int | None:
        """How many more bytes the channels' byte limits allow; None when unbounded."""
        rooms = [c.max_bytes - c.depth_bytes for c in self.channels.values() if c.max_bytes]
        return min(rooms) if rooms else None

    @property
    def bounded(self) -> bool:
        return bool(self.max_messages) or any(c.max_messages or c.max_bytes for c in self.channels.values())

    @property
    def accepting(self) -> bool:
        if self.disk_full():
            return False
        if self.overflow != "reject" or not self.bounded:
            return True
        room, byte_room = self.room(), self.byte_room()
        return (room is None or room > 0) and (byte_room is None or byte_room > 0)

    def _check_room(self, frames: list[bytes]) -> None:
        if self.disk_full():
            raise QueueFull(f"topic {self.name}: the daemon's disk budget (--max-disk-bytes) is used up")
        if self.overflow == "reject" and self.bounded:
            count = len(frames)
            room = self.room()
            if room is not None and count > room:
                raise QueueFull(
                    f"topic {self.name} is full: {count} more message(s) would pass its limit "
                    f"(room for {max(room, 0)})")
            byte_room = self.byte_room()
            if byte_room is not None and sum(map(len, frames)) > byte_room:
                raise QueueFull(
                    f"topic {self.name} is full: {sum(map(len, frames))} more bytes would pass a channel's "
                    f"byte limit (room for {max(byte_room, 0)})")

    def _trim(self, now_ns: int) -> None:
        """drop-oldest: every queue past its limit loses its oldest messages."""
        for channel in self.channels.values():
            if channel.max_messages and channel.depth > channel.max_messages:
                channel.drop_oldest(channel.depth - channel.max_messages, now_ns)
            if channel.max_bytes:
                for _ in range(8):  # each step drops about the excess, by the average size
                    excess = channel.depth_bytes - channel.max_bytes
                    if excess <= 0 or not channel.depth:
                        break
                    average = max(channel.depth_bytes // channel.depth, 1)
                    channel.drop_oldest(-(-excess // average), now_ns)
        if self.max_messages and self.depth > self.max_messages:
            self._drop_oldest(self.depth - self.max_messages)

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

    def put_chunk(self, ids: list[bytes], frames: list[bytes], nbytes: int) -> None:
        self._check_room(frames)
        self.message_count += len(frames)
        self.message_bytes += nbytes
        if self.channels and not self.paused:
            for channel in self.channels.values():
                channel.put_chunk(ids, frames)
        else:
            self._keep(ids, frames, 0)
        if self.overflow != "reject" and self.bounded:
            self._trim(0)

    def put_deferred(self, frame: bytes, due_ns: int) -> None:
        self._check_room([frame])
        self.message_count += 1
        self.message_bytes += len(frame) - message.FRAME_OVERHEAD
        if self.channels and not self.paused:
            for channel in self.channels.values():
                channel.put_deferred(frame, due_ns)
        else:
            self._keep([message.frame_id(frame)], [frame], due_ns)

    def _keep(self, ids: list[bytes], frames: list[bytes], due_ns: int) -> None:
        room = self.mem_queue_size - self._mem_count
        if len(frames) <= room:
            self._chunks.append((ids, frames, due_ns))
            self._mem_count += len(frames)
            return
        if room > 0:
            self._chunks.append((ids[:room], frames[:room], due_ns))
            self._mem_count += room
            frames = frames[room:]
        if self.backend is None:
            self.dropped_count += len(frames)
            log.warning("ephemeral topic full, dropping", topic=self.name, dropped=len(frames))
        elif due_ns:
            self.backend.put_many([message.to_disk(f, due_ns=due_ns) for f in frames])
        else:
            self.backend.put_many(frames)  # a plain frame is its own disk payload

    # ------------------------------------------------------------ backlog
    def _release_backlog(self) -> None:
        if not self.channels or self.paused:
            return
        while self._chunks:
            ids, frames, due_ns = self._chunks.popleft()
            self._mem_count -= len(frames)
            self._deliver(ids, frames, due_ns)
        if self.backend_depth:
            self._on_backlog(self)

    def _deliver(self, ids: list[bytes], frames: list[bytes], due_ns: int) -> None:
        for channel in self.channels.values():
            if due_ns:
                for frame in frames:
                    channel.put_deferred(frame, due_ns)
            else:
                channel.put_chunk(ids, frames)

    def move_backlog(self) -> bool:
        """Move one step of the disk backlog to the channels; True if more remains."""
        if not self.channels or self.paused or self.backend is None:
            return False
        frames: list[bytes] = []
        for payload in self.backend.read_many(BACKLOG_STEP):
            try:
                frame, due_ns, _failed = message.from_disk(payload)
            except message.BadRecord as exc:
                self.dropped_count += 1
                log.error("undecodable message on disk", topic=self.name, error=str(exc))
                continue
            if due_ns:
                self._deliver([message.frame_id(frame)], [frame], due_ns)
            else:
                frames.append(frame)
        if frames:
            self._deliver(list(map(message.frame_id_of, frames)), frames, 0)
        return self.backend.depth > 0

    # -------------------------------------------------------------- admin
    def take_backlog(self, count: int) -> list[bytes]:
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

    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self._release_backlog()

    def empty(self) -> None:
        self._chunks.clear()
        self._mem_count = 0
        if self.backend is not None:
            self.backend.empty()

    def persistable(self):
        """Disk payloads for the memory backlog, for an orderly shutdown."""
        for _ids, frames, due_ns in self._chunks:
            for frame in frames:
                yield message.to_disk(frame, due_ns=due_ns)
        self._chunks.clear()
        self._mem_count = 0
