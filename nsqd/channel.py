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
  to the head of the queue at once, in its original order); or, when it was
  delivered under a lease, in that :class:`Lease`'s map, which outlives the
  connection.
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
import operator
from collections import deque
from itertools import count
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

import structlog

from . import message
from .e2e import LatencyWindow
from .in_flight import InFlight

if TYPE_CHECKING:
    from .diskq import DiskQueue

log = structlog.get_logger("nsqd.channel")

Chunk = tuple[list[bytes], list[bytes]]
_KIND = operator.itemgetter(slice(4, 8))
_PLAIN = {message.PLAIN_KIND}


class Consumer(Protocol):
    """What a channel needs of a subscriber (an NSQ client or an AMQP link)."""

    in_flight: InFlight

    def wake(self) -> int:
        """Ask the consumer to fill; returns how many messages it could take."""

    def messages_timed_out(self, count: int) -> None: ...

    def close(self) -> None:
        """The channel is being deleted: the consumer must go."""

    def drain(self) -> None:
        """The daemon is shutting down: finish what you hold, then leave."""


class Lease:
    """Deliveries tagged with one name, settled together from any connection.

    The lease owns its in-flight messages, so they outlive the connection that
    received them: a stream processor acknowledges a batch after its sink
    commits, from another process. A sealed lease takes no new messages.
    """

    __slots__ = ("name", "in_flight", "owner", "sealed", "timeout_ns")

    def __init__(self, name: str, timeout_ns: int) -> None:
        self.name = name
        self.in_flight = InFlight()
        self.owner: Consumer | None = None
        self.sealed = False
        self.timeout_ns = timeout_ns

    def renew(self, now_ns: int) -> list[bytes]:
        """Give every message a fresh deadline; returns their frames in delivery order."""
        frames = self.in_flight.drain()
        if frames:
            self.in_flight.add([message.frame_id(f) for f in frames], frames,
                               now_ns + self.timeout_ns, now_ns)
        return frames


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
        #: shutdown in progress: nothing more is delivered
        self.draining = False
        self.consumers: dict[int, Consumer] = {}
        self._on_last_consumer_gone = on_last_consumer_gone
        self._chunks: deque[Chunk] = deque()
        self._head = 0
        self._mem_count = 0
        #: bytes of the frames in memory, kept with ``_mem_count`` by the same code
        self._mem_bytes = 0
        self._deferred: list[tuple[int, int, bytes]] = []
        self._seq = count()
        self._hungry: dict[Consumer, None] = {}
        self._disk_turn = False
        #: failed deliveries (REQ, timeouts, AMQP delivery-failed) by message id, only
        #: for messages that have any; carried to disk in the record's extension
        self.failed: dict[bytes, int] = {}
        self.leases: dict[str, Lease] = {}
        #: publish-to-FIN latency, when --e2e-processing-latency-percentile is set
        self.e2e: LatencyWindow | None = None
        # policies beyond nsqd (0 = off): set by the topic, changed over HTTP
        self.max_messages = 0
        self.max_bytes = 0
        self.max_attempts = 0
        self.ttl_ns = 0
        #: where messages that must not be delivered again go (None: dropped)
        self.dead_letter: Callable[[list[bytes]], None] | None = None
        # counters, as in nsqd's channel stats
        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.dropped_count = 0
        self.rejected_count = 0
        self.dead_letter_count = 0
        self.expired_count = 0

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
    def depth_bytes(self) -> int:
        """Bytes queued in memory (frames) and on disk (records), for byte limits."""
        return self._mem_bytes + (self.backend.depth_bytes if self.backend is not None else 0)

    @property
    def in_flight_count(self) -> int:
        return sum(len(c.in_flight) for c in self.consumers.values()) + sum(
            len(lease.in_flight) for lease in self.leases.values())

    @property
    def deferred_count(self) -> int:
        return len(self._deferred)

    # ------------------------------------------------------------- consumers
    def add_consumer(self, consumer_id: int, consumer: Consumer, max_consumers: int = 0) -> None:
        if self.exiting or self.draining:
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
        lease = getattr(consumer, "lease", None)
        if lease is not None:
            self.seal_lease(lease)
        frames = consumer.in_flight.drain()
        if frames and not self.exiting:
            self.requeue_count += len(frames)
            self._give_back(frames)
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
            self._mem_bytes += sum(map(len, frames))
        else:
            if room > 0:
                self._chunks.append((ids[:room], frames[:room]))
                self._mem_count += room
                self._mem_bytes += sum(map(len, frames[:room]))
                frames = frames[room:]
            self._spill(frames)
        self._wake(n)

    def put_deferred(self, frame: bytes, due_ns: int) -> None:
        self.message_count += 1
        self._defer(frame, due_ns)

    def _defer(self, frame: bytes, due_ns: int) -> None:
        if len(self._deferred) >= max(self.mem_queue_size, 1) and self.backend is not None:
            failed = self.failed.pop(message.frame_id(frame), 0) if self.failed else 0
            self.backend.put(message.to_disk(frame, due_ns=due_ns, failed=failed))
            return
        heapq.heappush(self._deferred, (due_ns, next(self._seq), frame))

    def _spill(self, frames: list[bytes]) -> None:
        if self.backend is None:
            self.dropped_count += len(frames)
            log.warning("ephemeral channel full, dropping", channel=self.name, topic=self.topic_name,
                        dropped=len(frames))
            return
        self.backend.put_many(frames)  # a plain frame is its own disk payload

    def _push_front(self, frames: list[bytes]) -> None:
        """Requeued messages go to the head of the queue so they are retried first."""
        if self._head:
            ids0, frames0 = self._chunks[0]
            self._chunks[0] = (ids0[self._head:], frames0[self._head:])
            self._head = 0
        self._chunks.appendleft((list(map(message.frame_id_of, frames)), frames))
        self._mem_count += len(frames)
        self._mem_bytes += sum(map(len, frames))

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
        Messages past the channel's TTL are dropped here, never delivered.
        """
        pieces: list[Chunk] = []
        if self.paused or self.exiting or self.draining:
            return pieces
        want = n
        while True:
            batch: list[Chunk] = []
            taken = self._take_some(want, batch, now_ns)
            got = taken
            if self.ttl_ns and taken:
                batch = self._unexpired(batch, now_ns - self.ttl_ns)
                got = sum(len(ids) for ids, _ in batch)
            pieces += batch
            want -= got
            if got == taken or want <= 0:  # nothing expired, or enough
                break
        if want > 0:
            self._hungry[consumer] = None
        return pieces

    def _take_some(self, want: int, pieces: list[Chunk], now_ns: int) -> int:
        taken = 0
        disk_first = self._disk_turn = not self._disk_turn
        if disk_first and self.backend is not None and self.backend.depth:
            taken += self._take_disk(want, pieces, now_ns)
        if want > taken and self._mem_count:
            taken += self._take_memory(want - taken, pieces)
        if want > taken and self.backend is not None and self.backend.depth:
            taken += self._take_disk(want - taken, pieces, now_ns)
        return taken

    def _unexpired(self, pieces: list[Chunk], cutoff_ns: int) -> list[Chunk]:
        """Drop (and count) messages published before ``cutoff_ns``: never delivered."""
        kept: list[Chunk] = []
        for ids, frames in pieces:
            fresh = [i for i, f in enumerate(frames) if message.frame_timestamp(f) >= cutoff_ns]
            if len(fresh) == len(frames):
                kept.append((ids, frames))
                continue
            self.expired_count += len(frames) - len(fresh)
            if self.failed:
                kept_ids = {ids[i] for i in fresh}
                self.forget([i for i in ids if i not in kept_ids])
            if fresh:
                kept.append(([ids[i] for i in fresh], [frames[i] for i in fresh]))
        return kept

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
            self._mem_bytes -= sum(map(len, frames))
        self._mem_count -= taken
        return taken

    def _take_disk(self, n: int, pieces: list[Chunk], now_ns: int) -> int:
        payloads = self.backend.read_many(n)
        if set(map(_KIND, payloads)) <= _PLAIN:  # all frames as stored: used as they are
            if payloads:
                pieces.append((list(map(message.frame_id_of, payloads)), payloads))
            return len(payloads)
        frames: list[bytes] = []
        plain = message.PLAIN_KIND
        for payload in payloads:
            if payload[4:8] == plain:
                frames.append(payload)
                continue
            try:
                frame, due_ns, failed = message.from_disk(payload)
            except message.BadRecord as exc:
                self.dropped_count += 1
                log.error("undecodable message on disk", channel=self.name, topic=self.topic_name,
                          error=str(exc))
                continue
            if failed:
                self.failed[message.frame_id(frame)] = failed
            if due_ns > now_ns:
                self._defer(frame, due_ns)
            else:
                frames.append(frame)
        if frames:
            pieces.append((list(map(message.frame_id_of, frames)), frames))
        return len(frames)

    # ------------------------------------------------------- consumer verbs
    def requeue(self, frame: bytes, delay_ns: int, now_ns: int, *, failed: bool = True,
                count_attempt: bool = True) -> None:
        """A consumer gave a message back; it was already removed from in-flight.

        NSQ's REQ counts the delivery (attempts) and a failed delivery; an AMQP
        ``released`` counts neither.
        """
        self.requeue_count += 1
        if count_attempt:
            if self._exhausted(frame):
                self._dead_letter([frame])
                return
            frame = message.next_attempt(frame)
        if failed:
            self.count_failure(message.frame_id(frame))
        if delay_ns > 0:
            self._defer(frame, now_ns + delay_ns)
        else:
            self._push_front([frame])
            self._wake(1)

    def count_failure(self, msg_id: bytes) -> None:
        self.failed[msg_id] = self.failed.get(msg_id, 0) + 1

    def forget(self, ids) -> None:
        """Finished messages leave the failed-count table (only called when it is not empty)."""
        pop = self.failed.pop
        for msg_id in ids:
            pop(msg_id, None)

    def reject(self, frame: bytes) -> None:
        """A consumer refused a message for good: it goes to the dead-letter topic."""
        self.rejected_count += 1
        self._dead_letter([frame])

    def _exhausted(self, frame: bytes) -> bool:
        """The message has had all the deliveries ``max_attempts`` allows."""
        return bool(self.max_attempts) and message.frame_attempts(frame) >= self.max_attempts

    def _give_back(self, frames: list[bytes]) -> None:
        """Delivered messages back to the head of the queue, or to the dead letters."""
        if self.max_attempts:
            dead = [f for f in frames if self._exhausted(f)]
            if dead:
                self._dead_letter(dead)
                frames = [f for f in frames if not self._exhausted(f)]
        if frames:
            self._push_front([message.next_attempt(f) for f in frames])
            self._wake(len(frames))

    def _dead_letter(self, frames: list[bytes]) -> None:
        self.dead_letter_count += len(frames)
        if self.failed:
            self.forget([message.frame_id(f) for f in frames])
        if self.dead_letter is None:
            self.dropped_count += len(frames)
            return
        self.dead_letter(frames)

    def drop_oldest(self, count: int, now_ns: int) -> None:
        """Make room under the drop-oldest policy: the head of the queue goes first."""
        pieces: list[Chunk] = []
        dropped = self._take_memory(min(count, self._mem_count), pieces)
        if dropped < count and self.backend is not None:
            dropped += len(self.backend.read_many(count - dropped))
        self.dropped_count += dropped
        if self.failed:
            self.forget([i for ids, _ in pieces for i in ids])

    # ---------------------------------------------------------------- leases
    def open_lease(self, name: str, consumer: Consumer, now_ns: int, timeout_ns: int) -> tuple[Lease, list[bytes]]:
        """Tag the consumer's next deliveries with lease ``name``.

        Reopening a live lease hands over exactly its messages again (returned,
        to be resent) and takes no new ones: the lease is sealed.
        """
        lease = self.leases.get(name)
        if lease is None:
            lease = self.leases[name] = Lease(name, timeout_ns)
            resend: list[bytes] = []
        else:
            lease.sealed = True
            resend = lease.renew(now_ns)
        lease.owner = consumer
        return lease, resend

    def seal_lease(self, lease: Lease) -> None:
        """The lease's owner moved on: the lease keeps its messages and takes no more."""
        lease.owner = None
        lease.sealed = True
        if not lease.in_flight and self.leases.get(lease.name) is lease:
            del self.leases[lease.name]

    def finish_lease(self, name: str) -> int:
        lease = self.leases.pop(name, None)
        if lease is None:
            return 0
        ids = list(lease.in_flight.map)
        lease.in_flight.map.clear()
        if self.failed:
            self.forget(ids)
        self._release_owner(lease)
        return len(ids)

    def touch_lease(self, name: str, now_ns: int) -> int:
        lease = self.leases.get(name)
        if lease is None:
            return 0
        lease.renew(now_ns)
        return len(lease.in_flight)

    def requeue_lease(self, name: str, delay_ns: int, now_ns: int) -> int:
        lease = self.leases.pop(name, None)
        if lease is None:
            return 0
        frames = lease.in_flight.drain()
        self._release_owner(lease)
        for frame in frames:
            self.requeue(frame, delay_ns, now_ns)
        return len(frames)

    def _release_owner(self, lease: Lease) -> None:
        owner = lease.owner
        lease.owner = None
        lease.sealed = True
        if owner is not None:
            owner.wake()

    # ------------------------------------------------------------ queue scan
    def process_in_flight(self, now_ns: int) -> bool:
        """Requeue every timed-out message; True if there was any."""
        dirty = False
        for consumer in list(self.consumers.values()):
            frames = consumer.in_flight.expire(now_ns)
            if frames:
                dirty = True
                consumer.messages_timed_out(len(frames))
                self._timed_out(frames)
                consumer.wake()
        for lease in list(self.leases.values()):
            frames = lease.in_flight.expire(now_ns)
            if frames:
                dirty = True
                self._timed_out(frames)
            if not lease.in_flight and (lease.sealed or frames):
                self.leases.pop(lease.name, None)
                self._release_owner(lease)
        if dirty:
            self._wake(self._mem_count)
        return dirty

    def _timed_out(self, frames: list[bytes]) -> None:
        self.timeout_count += len(frames)
        for frame in frames:
            self.count_failure(message.frame_id(frame))
        self._give_back(frames)

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
            self._chunks.append((list(map(message.frame_id_of, due)), due))
            self._mem_count += len(due)
            self._mem_bytes += sum(map(len, due))
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
        self._mem_count = self._mem_bytes = 0
        self._deferred.clear()
        for consumer in self.consumers.values():
            consumer.in_flight.map.clear()
        for lease in list(self.leases.values()):
            lease.in_flight.map.clear()
            self._release_owner(lease)
        self.leases.clear()
        self.failed.clear()
        if self.backend is not None:
            self.backend.empty()

    def persistable(self) -> Iterable[bytes]:
        """Disk payloads for everything held in memory, for an orderly shutdown.

        In-flight messages come first (they were delivered before anything still
        queued), then the memory queue, then deferred messages with due times.
        """
        failed = self.failed
        in_flight = [f for c in self.consumers.values() for f in c.in_flight.drain()]
        in_flight += [f for lease in self.leases.values() for f in lease.in_flight.drain()]
        for frame in in_flight:
            yield message.to_disk(message.next_attempt(frame), failed=failed.get(message.frame_id(frame), 0))
        first = True
        for ids, frames in self._chunks:
            start = self._head if first else 0
            first = False
            if failed:
                for frame in frames[start:]:
                    yield message.to_disk(frame, failed=failed.get(message.frame_id(frame), 0))
            else:
                yield from frames[start:]
        for due_ns, _, frame in sorted(self._deferred):
            yield message.to_disk(frame, due_ns=due_ns, failed=failed.get(message.frame_id(frame), 0))
        self._chunks.clear()
        self._head = self._mem_count = self._mem_bytes = 0
        self._deferred.clear()
        self.leases.clear()
        self.failed.clear()
