"""A channel: one consumer group's copy of a topic's message stream.

Where each message of the channel is, exactly one of:
- memory: a deque of chunks ``(ids, frames)``. A chunk is usually one whole
  publish (an MPUB) and is shared, never mutated, by every channel of the
  topic; ``_head`` counts what the channel has already taken of the first one.
  Bounded by ``mem_queue_size`` messages; what does not fit spills to disk.
- disk: the channel's :class:`~nsqd.diskq.DiskQueue` (none for ephemeral
  channels, whose overflow is dropped and counted, as in nsqd).
- in flight: in the :class:`~nsqd.in_flight.InFlight` map of the consumer it
  was sent to, until FIN, REQ, timeout or the consumer leaves (then it goes back
  to the head of the queue at once, in its original order).
- deferred: a heap ordered by due time (DPUB, REQ with a delay). Past
  ``mem_queue_size`` entries deferred messages spill to disk with their due
  time and are looked at again when read back.

All counters that describe those places (depth, in-flight, deferred) are
derived from them. The channel wakes consumers that asked for messages and
got too few ("hungry") whenever messages arrive, one consumer per batch of
free capacity, so consumers share the channel's messages.

Times are integer nanoseconds from the daemon clock; nothing here does I/O
beyond the disk queue's buffered calls.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import count
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

import structlog

from . import message
from .in_flight import InFlight

if TYPE_CHECKING:
    from .diskq import DiskQueue

log = structlog.get_logger("nsqd.channel")

Chunk = tuple[list[bytes], list[bytes]]


class Consumer(Protocol):
    """What a channel needs of a subscriber (an NSQ client or an AMQP link)."""

    in_flight: InFlight

    def wake(self) -> int:
        """Ask the consumer to fill; returns how many messages it could take."""

    def messages_timed_out(self, count: int) -> None: ...

    def close(self) -> None:
        """The channel is being deleted: the consumer must go."""


class ChannelExiting(Exception):
    """The channel is being deleted or the daemon is shutting down."""


class Channel:
    def __init__(
        self,
        topic_name: str,
        name: str,
        *,
        mem_queue_size: int,
        backend: DiskQueue | None,
        on_last_consumer_gone: Callable[[Channel], None] | None = None,
    ) -> None:
        self.topic_name = topic_name
        self.name = name
        self.ephemeral = name.endswith("#ephemeral")
        self.mem_queue_size = mem_queue_size
        self.backend = backend
        self.paused = False
        self.exiting = False
        self.consumers: dict[int, Consumer] = {}
        self._on_last_consumer_gone = on_last_consumer_gone
        self._chunks: deque[Chunk] = deque()
        self._head = 0
        self._mem_count = 0
        self._deferred: list[tuple[int, int, bytes]] = []
        self._seq = count()
        self._hungry: dict[Consumer, None] = {}
        self._disk_turn = False
        # counters, as in nsqd's channel stats
        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.dropped_count = 0

    # ----------------------------------------------------------- derived stats
    @property
    def memory_depth(self) -> int:
        return self._mem_count

    @property
    def backend_depth(self) -> int:
        return self.backend.depth if self.backend is not None else 0

    @property
    def depth(self) -> int:
        return self._mem_count + self.backend_depth

    @property
    def in_flight_count(self) -> int:
        return sum(len(c.in_flight) for c in self.consumers.values())

    @property
    def deferred_count(self) -> int:
        return len(self._deferred)

    # ------------------------------------------------------------- consumers
    def add_consumer(self, consumer_id: int, consumer: Consumer, max_consumers: int = 0) -> None:
        if self.exiting:
            raise ChannelExiting("exiting")
        if consumer_id in self.consumers:
            return
        if max_consumers and len(self.consumers) >= max_consumers:
            raise ValueError(
                f"consumers for {self.topic_name}:{self.name} exceeds limit of {max_consumers}"
            )
        self.consumers[consumer_id] = consumer

    def remove_consumer(self, consumer_id: int) -> None:
        """Forget a consumer; its unfinished messages go back to the head of the queue."""
        consumer = self.consumers.pop(consumer_id, None)
        if consumer is None:
            return
        self._hungry.pop(consumer, None)
        frames = consumer.in_flight.drain()
        if frames and not self.exiting:
            self.requeue_count += len(frames)
            self._push_front([message.next_attempt(f) for f in frames])
            self._wake(len(frames))
        if not self.consumers and self.ephemeral and self._on_last_consumer_gone is not None:
            self._on_last_consumer_gone(self)

    # --------------------------------------------------------------- putting
    def put_chunk(self, ids: list[bytes], frames: list[bytes]) -> None:
        """Queue a published batch; it is shared with other channels, never mutated."""
        n = len(frames)
        self.message_count += n
        room = self.mem_queue_size - self._mem_count
        if n <= room:
            self._chunks.append((ids, frames))
            self._mem_count += n
        else:
            if room > 0:
                self._chunks.append((ids[:room], frames[:room]))
                self._mem_count += room
                frames = frames[room:]
            self._spill(frames)
        self._wake(n)

    def put_deferred(self, frame: bytes, due_ns: int) -> None:
        self.message_count += 1
        self._defer(frame, due_ns)

    def _defer(self, frame: bytes, due_ns: int) -> None:
        if len(self._deferred) >= max(self.mem_queue_size, 1) and self.backend is not None:
            self.backend.put(message.to_disk(frame, due_ns=due_ns))
            return
        heapq.heappush(self._deferred, (due_ns, next(self._seq), frame))

    def _spill(self, frames: list[bytes]) -> None:
        if self.backend is None:
            self.dropped_count += len(frames)
            log.warning("ephemeral channel full, dropping", channel=self.name, topic=self.topic_name,
                        dropped=len(frames))
            return
        self.backend.put_many(message.frames_to_disk(frames))

    def _push_front(self, frames: list[bytes]) -> None:
        """Requeued messages go to the head of the queue so they are retried first."""
        if self._head:
            ids0, frames0 = self._chunks[0]
            self._chunks[0] = (ids0[self._head:], frames0[self._head:])
            self._head = 0
        self._chunks.appendleft(([message.frame_id(f) for f in frames], frames))
        self._mem_count += len(frames)

    def _wake(self, n: int) -> None:
        hungry = self._hungry
        while hungry and n > 0:
            consumer = next(iter(hungry))
            del hungry[consumer]
            n -= max(consumer.wake(), 1)

    def wake_all(self) -> None:
        for consumer in list(self.consumers.values()):
            consumer.wake()

    # --------------------------------------------------------------- taking
    def take(self, n: int, consumer: Consumer, now_ns: int) -> list[Chunk]:
        """Up to ``n`` messages for ``consumer`` as chunk slices.

        A consumer that gets fewer than it asked for is remembered as hungry and
        woken when messages arrive. Memory and disk take turns when both hold
        messages, so neither starves (nsqd gives no ordering guarantee either).
        """
        pieces: list[Chunk] = []
        if self.paused or self.exiting:
            return pieces
        want = n
        disk_first = self._disk_turn = not self._disk_turn
        if disk_first and self.backend is not None and self.backend.depth:
            want -= self._take_disk(want, pieces, now_ns)
        if want > 0 and self._mem_count:
            want -= self._take_memory(want, pieces)
        if want > 0 and self.backend is not None and self.backend.depth:
            want -= self._take_disk(want, pieces, now_ns)
        if want > 0:
            self._hungry[consumer] = None
        return pieces

    def _take_memory(self, n: int, pieces: list[Chunk]) -> int:
        taken = 0
        chunks = self._chunks
        while taken < n and chunks:
            ids, frames = chunks[0]
            start = self._head
            end = start + n - taken
            if end >= len(ids):
                if start:
                    ids, frames = ids[start:], frames[start:]
                chunks.popleft()
                self._head = 0
            else:
                ids, frames = ids[start:end], frames[start:end]
                self._head = end
            pieces.append((ids, frames))
            taken += len(ids)
        self._mem_count -= taken
        return taken

    def _take_disk(self, n: int, pieces: list[Chunk], now_ns: int) -> int:
        frames: list[bytes] = []
        backend = self.backend
        for payload in backend.read_many(n):
            if payload[:2] == b"\x00\x00":
                frames.append(message.from_disk_plain(payload))
                continue
            try:
                frame, due_ns, _failed = message.from_disk(payload)
            except message.BadRecord as exc:
                self.dropped_count += 1
                log.error("undecodable message on disk", channel=self.name, topic=self.topic_name,
                          error=str(exc))
                continue
            if due_ns > now_ns:
                self._defer(frame, due_ns)
            else:
                frames.append(frame)
        if frames:
            pieces.append(([message.frame_id(f) for f in frames], frames))
        return len(frames)

    # ------------------------------------------------------- consumer verbs
    def requeue(self, frame: bytes, delay_ns: int, now_ns: int) -> None:
        """A consumer gave a message back (REQ); it was already removed from in-flight."""
        self.requeue_count += 1
        frame = message.next_attempt(frame)
        if delay_ns > 0:
            self._defer(frame, now_ns + delay_ns)
        else:
            self._push_front([frame])
            self._wake(1)

    # ------------------------------------------------------------ queue scan
    def process_in_flight(self, now_ns: int) -> bool:
        """Requeue every timed-out message; True if there was any."""
        dirty = False
        for consumer in list(self.consumers.values()):
            frames = consumer.in_flight.expire(now_ns)
            if frames:
                dirty = True
                self.timeout_count += len(frames)
                consumer.messages_timed_out(len(frames))
                self._push_front([message.next_attempt(f) for f in frames])
                consumer.wake()
        if dirty:
            self._wake(self._mem_count)
        return dirty

    def process_deferred(self, now_ns: int) -> bool:
        """Move deferred messages that are due to the queue; True if there was any."""
        deferred = self._deferred
        if not deferred or deferred[0][0] > now_ns:
            return False
        due = []
        while deferred and deferred[0][0] <= now_ns:
            due.append(heapq.heappop(deferred)[2])
        room = self.mem_queue_size - self._mem_count
        if len(due) > room and self.backend is not None:
            self._spill(due[max(room, 0):])
            due = due[:max(room, 0)]
        if due:
            self._chunks.append(([message.frame_id(f) for f in due], due))
            self._mem_count += len(due)
        self._wake(self._mem_count)
        return True

    # ------------------------------------------------------------- admin
    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self.wake_all()

    def empty(self) -> None:
        """Drop every queued, deferred and in-flight message (as nsqd's Empty)."""
        self._chunks.clear()
        self._head = 0
        self._mem_count = 0
        self._deferred.clear()
        for consumer in self.consumers.values():
            consumer.in_flight.map.clear()
        if self.backend is not None:
            self.backend.empty()

    def persistable(self) -> Iterable[bytes]:
        """Disk payloads for everything held in memory, for an orderly shutdown.

        In-flight messages come first (they were delivered before anything still
        queued), then the memory queue, then deferred messages with due times.
        """
        for consumer in self.consumers.values():
            for frame in consumer.in_flight.drain():
                yield message.to_disk(message.next_attempt(frame))
        first = True
        for ids, frames in self._chunks:
            start = self._head if first else 0
            first = False
            yield from message.frames_to_disk(frames[start:])
        for due_ns, _, frame in sorted(self._deferred):
            yield message.to_disk(frame, due_ns=due_ns)
        self._chunks.clear()
        self._head = self._mem_count = 0
        self._deferred.clear()
