"""A channel: one consumer group's copy of a topic's message stream.

Where each message of the channel is, exactly one of:
- memory: a deque of pieces ``(ids, frames, positions)``. A piece is usually
  one whole publish (an MPUB) and is shared, never mutated, by every channel
  of the topic; ``_head`` counts what the channel has already taken of the
  first one. Bounded by ``mem_queue_size`` messages; what does not fit goes
  to disk.
- disk, unread: the channel's :class:`~nsqd.diskq.DiskQueue` (none for
  ephemeral channels, whose overflow is dropped and counted, as in nsqd).
- in flight: in the :class:`~nsqd.in_flight.InFlight` map of the
  :class:`~nsqd.subscription.Subscription` it was sent to, or of a lease
  (:mod:`nsqd.leases`), until FIN, REQ, timeout or the subscription leaves.
  REQ and a timeout put it at the back of the queue, as nsqd does, so the
  messages waiting are delivered before the retry; a subscription that
  leaves gives its messages back to the head of the queue at once, in their
  original order.
- deferred: a heap ordered by due time (DPUB, REQ with a delay). Past
  ``mem_queue_size`` entries deferred messages go to disk with their due time
  and are looked at again when read back.

A message that has a record on disk carries its position (``positions``:
a list when the messages of a piece are neighbours on disk, a tuple when
they are not, None for memory-only messages). Reading a record does not
release it: at every checkpoint the disk queue asks the channel which of its
records are still unfinished (:meth:`Channel._kept`), so a crash delivers
them again, with their attempts, due times and leases, instead of losing
them. Records are written before a publish is confirmed: past the memory
bound (nsqd's spill, so ``--mem-queue-size=0`` loses nothing on a crash),
and for durable publishes always (write-through: the message is delivered
from memory and its record released once finished, never read back).

All counters that describe those places (depth, in-flight, deferred) are
derived from them. The channel wakes consumers that asked for messages and
got too few ("hungry") whenever messages arrive, one per batch of free
capacity, so consumers share the channel's messages.

Times are integer nanoseconds from the daemon clock.
"""

from __future__ import annotations

import bisect
import heapq
import math
import operator
from collections import deque
from itertools import accumulate, count
from typing import TYPE_CHECKING, Callable

import structlog

from . import message
from .diskq import DiskQueueError
from .diskq.records import RECORD_HEADER_SIZE
from .e2e import LatencyWindow
from .in_flight import Item, pieces
from .leases import Leases
from .logs import LogThrottle
from .policy import ChannelPolicy
from .subscription import Budget, Consumer, Subscription, keep_sample

if TYPE_CHECKING:
    from .diskq import DiskQueue

log = structlog.get_logger("nsqd.channel")

Piece = tuple[list[bytes], list[bytes], "list[int] | tuple[int, ...] | None"]
_KIND = operator.itemgetter(slice(4, 8))
_PLAIN = {message.PLAIN_KIND}
#: the note on the disk records of messages in flight when the channel stopped
IN_FLIGHT_NOTE = {"i": 1}
#: records read per step when a recovered channel takes its leases back
_RESTORE_STEP = 512
#: deferred records read back before they are due are remembered by position and left where they
#: are, up to this many per channel (about 80 bytes each); past it they are written again behind,
#: with their due time. Rewriting each one a take read cost writes, and a crash before the next
#: checkpoint brought back both copies
DEFERRED_INDEX = 100_000
#: messages one take goes through at most when it drops some (expired, not sampled): a low
#: sample_rate or a TTL over a big backlog dropped it all in one step, while other clients waited
EXAMINE_STEP = 4096
#: small publishes (single PUBs) are appended to the last chunk up to this size, so a queue of
#: single messages is a few hundred chunks, not thousands (cheaper takes and checkpoints)
COALESCE = 64


def _fitting(frames: list[bytes], start: int, end: int, max_bytes: float) -> int:
    """How many of ``frames[start:end]`` to take to reach ``max_bytes`` (all if they stay under it)."""
    sizes = list(accumulate(map(len, frames[start:end])))
    if not sizes or sizes[-1] <= max_bytes:
        return end - start
    return bisect.bisect_left(sizes, max_bytes) + 1


class ChannelExiting(Exception):
    """The channel is being deleted or the daemon is shutting down."""


class PendingPut:
    """A publish a channel has written to disk (if it needed to) but not yet queued."""

    __slots__ = ("channel", "ids", "frames", "keep", "positions", "mark", "due_ns")

    def __init__(self, channel, ids, frames, keep, positions, mark, due_ns) -> None:
        self.channel = channel
        self.ids = ids
        self.frames = frames
        self.keep = keep
        self.positions = positions
        self.mark = mark
        self.due_ns = due_ns


class Channel:
    def __init__(
        self,
        topic_name: str,
        name: str,
        *,
        mem_queue_size: int,
        backend: DiskQueue | None,
        policy: ChannelPolicy = ChannelPolicy(),
        overrides: dict | None = None,
        clock: Callable[[], int] = lambda: 0,
        lease_timeout_ns: int = 60_000_000_000,
        dead_letter: Callable[[list[bytes]], bool] | None = None,
        e2e: LatencyWindow | None = None,
        on_last_consumer_gone: Callable[[Channel], None] | None = None,
        on_read_failed: Callable[[Channel], None] = lambda channel: None,
    ) -> None:
        self.topic_name = topic_name
        self.name = name
        self.ephemeral = name.endswith("#ephemeral")
        self.mem_queue_size = mem_queue_size
        self.backend = backend
        self.policy = policy
        #: the policy fields set for this channel alone (the rest follow the topic's channel defaults)
        self.overrides: dict = dict(overrides or {})
        self.clock = clock
        self.paused = False
        self.exiting = False
        #: shutdown in progress: nothing more is delivered
        self.draining = False
        #: the last process_in_flight stopped at its step with more maybe timed out (see there)
        self.timeouts_left = False
        #: called whenever in-flight messages are settled (the shutdown drain waits on it)
        self.on_settled: Callable[[], None] | None = None
        #: the topic is durable: messages are delivered from memory, their disk records never read
        #: back, so finishing them counts towards the disk queue's checkpoints as reading them would
        self.write_through = False
        #: called once, the next time messages leave the queue (publishers wait for room on it)
        self.on_room: Callable[[], None] | None = None
        self.subscriptions: dict[int, Subscription] = {}
        self._on_last_consumer_gone = on_last_consumer_gone
        #: a read of the disk queue failed (out of descriptors, say): its hungry consumers must be
        #: woken to try again later, since no publish may come to wake them
        self._on_read_failed = on_read_failed
        self._chunks: deque[Piece] = deque()
        self._head = 0
        self._mem_count = 0
        #: bytes of the frames in memory, kept with ``_mem_count`` by the same code
        self._mem_bytes = 0
        self._deferred: list[tuple[int, int, bytes, int | None]] = []
        #: deferred records on disk the queue scan has not found due yet: they count as deferred, not
        #: as depth, until it does (as nsqd moves a due message to the queue), when hungry consumers
        #: are woken to read them. Their due times as a count per time and a heap of those times
        self._deferred_on_disk = 0
        #: deferred records read back before they were due, left on disk: (due, seq, position)
        self._deferred_index: list[tuple[int, int, int]] = []
        self._disk_due: dict[int, int] = {}
        self._disk_due_times: list[int] = []
        self._seq = count()
        self._hungry: dict[Subscription, None] = {}
        self._disk_turn = False
        #: failed deliveries (REQ, timeouts, AMQP delivery-failed) by message id, only
        #: for messages that have any; carried to disk in the record's extension
        self.failed: dict[bytes, int] = {}
        #: messages given back without counting a delivery (AMQP ``released``): acquired before all the same
        self.released: set[bytes] = set()
        #: disk-backed messages whose attempts or failures changed since their record was written
        self._revised: dict[int, tuple[int, int]] = {}
        self.leases = Leases()
        #: dead letters the dead-letter topic refused (a full disk): kept, retried by the queue scan
        self._dead_pending: list[Item] = []
        self.lease_timeout_ns = lease_timeout_ns
        self._notes = _Notes(())
        #: publish-to-FIN latency, when --e2e-processing-latency-percentile is set
        self.e2e = e2e
        #: where messages that must not be delivered again go (None: dropped)
        self.dead_letter = dead_letter
        # counters, as in nsqd's channel stats
        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.dropped_count = 0
        #: drops and full-disk fallbacks, which publishes can repeat, logged once a second at most
        self._log_throttle = LogThrottle()
        self.rejected_count = 0
        self.dead_letter_count = 0
        self.expired_count = 0
        if backend is not None:
            backend.keeper = self._kept
            self._recover()

    # ----------------------------------------------------------- derived stats
    @property
    def memory_depth(self) -> int:
        return self._mem_count

    @property
    def backend_depth(self) -> int:
        if self.backend is None:
            return 0
        return max(self.backend.depth - self._deferred_on_disk, 0)

    @property
    def depth(self) -> int:
        return self._mem_count + self.backend_depth

    @property
    def depth_bytes(self) -> int:
        """Bytes queued in memory (frames) and on disk (records), for byte limits."""
        return self._mem_bytes + (self.backend.depth_bytes if self.backend is not None else 0)

    @property
    def in_flight_count(self) -> int:
        return sum(len(s.in_flight) for s in self.subscriptions.values()) + self.leases.in_flight_count

    @property
    def deferred_count(self) -> int:
        return len(self._deferred) + len(self._deferred_index) + self._deferred_on_disk

    # -------------------------------------------------------- subscriptions
    def subscribe(self, consumer: Consumer, sub_id: int, budget: Budget, *, msg_timeout_ns: int,
                  max_msg_timeout_ns: int, max_consumers: int = 0) -> Subscription:
        """A new subscription; raises ChannelExiting, or ValueError past ``max_consumers``."""
        if self.exiting or self.draining:
            raise ChannelExiting("exiting")
        if max_consumers and len(self.subscriptions) >= max_consumers:
            raise ValueError(f"consumers for {self.topic_name}:{self.name} exceeds limit of {max_consumers}")
        sub = Subscription(self, consumer, sub_id, budget, msg_timeout_ns, max_msg_timeout_ns)
        self.subscriptions[sub_id] = sub
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Forget a subscription; its unfinished messages go back to the head of the queue.

        They count in ``timeout_count``, and each as a failed delivery: nsqd leaves them in flight
        until they time out.
        """
        if self.subscriptions.pop(sub.id, None) is None:
            return
        self._hungry.pop(sub, None)
        for lease in list(sub.leases):
            self.leases.release_holder(lease)
        sub.lease = None
        items = sub.in_flight.drain()
        if items and not self.exiting:
            self.timeout_count += len(items)
            for frame, _ in items:  # a failed delivery, as a timeout is (AMQP's delivery-count)
                self.count_failure(message.frame_id(frame))
            self._give_back(items)
        self.settled()
        if not self.subscriptions and self.ephemeral and self._on_last_consumer_gone is not None:
            self._on_last_consumer_gone(self)

    def settled(self, finished: int = 0) -> None:
        """In-flight messages were finished, given back or timed out: the disk queue checkpoints that."""
        if self.backend is not None:
            self.backend.kept_changed(finished if self.write_through else 0)
        if self.on_settled is not None:
            self.on_settled()

    def holds_elsewhere(self, msg_id: bytes, sub: Subscription) -> bool:
        """Whether another subscription or a lease holds ``msg_id`` (FIN's "does not own")."""
        for other in self.subscriptions.values():
            if other is not sub and msg_id in other.in_flight:
                return True
        return any(msg_id in lease.in_flight for lease in self.leases)

    # --------------------------------------------------------------- putting
    def prepare_put(self, ids: list[bytes], frames: list[bytes], durable: bool, due_ns: int = 0) -> PendingPut:
        """Write what must be on disk before the publish is confirmed; nothing is queued yet.

        Raises DiskQueueError (nothing of this publish stays) if it cannot be
        written. A durable publish is written whole; the part that fits in
        memory is kept there too when the disk holds nothing unread, so it is
        delivered from memory and never read back. Otherwise what does not fit
        in memory goes to disk (nsqd's spill).
        """
        backend = self.backend
        n = len(frames)
        if due_ns:
            return self._prepare_deferred(ids, frames, durable, due_ns)
        room = max(self.mem_queue_size - self._mem_count, 0)
        if backend is None:
            if room < n:  # what ready consumers take at once is never dropped (Go's pumps wait on
                # an ephemeral channel's queue, even one of --mem-queue-size=0, and take from it)
                room = max(room, self._ready_room() - self._mem_count)
            return PendingPut(self, ids, frames, min(n, room), None, None, 0)
        mark = backend.mark()
        if durable:
            if backend.depth == 0:
                keep = min(n, room)
                positions = backend.put_held(frames, hold=keep)
                return PendingPut(self, ids, frames, keep, positions, mark, 0)
            backend.put_many(frames)
            return PendingPut(self, ids, frames, 0, None, mark, 0)
        keep = min(n, room)
        if keep < n:
            backend.put_many(frames[keep:] if keep else frames)
        return PendingPut(self, ids, frames, keep, None, mark if keep < n else None, 0)

    def _ready_room(self) -> int:
        """Messages this channel's consumers would take the moment they are queued."""
        if self.paused or self.exiting or self.draining:
            return 0
        return sum(sub.wake_room(1 << 30) for sub in self.subscriptions.values())

    def _prepare_deferred(self, ids, frames, durable, due_ns) -> PendingPut:
        backend = self.backend
        # with a disk queue, --mem-queue-size=0 writes deferred messages to disk too (its promise);
        # without one the heap keeps at least one
        bound = self.mem_queue_size if backend is not None else max(self.mem_queue_size, 1)
        keep = min(len(frames), max(bound - len(self._deferred), 0))
        if backend is None:
            return PendingPut(self, ids, frames, keep, None, None, due_ns)
        mark = backend.mark()
        records = [message.to_disk(f, due_ns=due_ns) for f in frames]
        if durable and backend.depth == 0:
            positions = backend.put_held(records, hold=keep)
            return PendingPut(self, ids, frames, keep, positions, mark, due_ns)
        if durable:
            keep = 0
        if keep < len(frames):
            backend.put_many(records[keep:])
            return PendingPut(self, ids, frames, keep, None, mark, due_ns)
        return PendingPut(self, ids, frames, keep, None, None, due_ns)

    def prepare_in_memory(self, ids: list[bytes], frames: list[bytes], due_ns: int = 0) -> PendingPut:
        """A publish kept in memory whatever the bound: copies of a topic's backlog that the
        disk could not take, whose records the topic keeps until this channel lets go of them
        (:meth:`held_of`)."""
        return PendingPut(self, ids, frames, len(frames), None, None, due_ns)

    def held_of(self, ids: set[bytes]) -> set[bytes]:
        """Which of these messages are still here unfinished: queued, in flight, leased, deferred
        or waiting to be dead-lettered."""
        held: set[bytes] = set()
        head = self._head
        for index, (chunk_ids, _, _) in enumerate(self._chunks):
            held |= ids.intersection(chunk_ids[head:] if index == 0 and head else chunk_ids)
        for holder in [*self.subscriptions.values(), *self.leases]:
            held |= ids.intersection(holder.in_flight.map)
        held.update(msg_id for msg_id in map(message.frame_id, (frame for _, _, frame, _ in self._deferred))
                    if msg_id in ids)
        held.update(msg_id for msg_id in map(message.frame_id, (frame for frame, _ in self._dead_pending))
                    if msg_id in ids)
        return held

    def abort_put(self, put: PendingPut) -> None:
        """Take back what :meth:`prepare_put` wrote (another channel could not take the publish)."""
        if put.mark is not None:
            self.backend.undo(put.mark)

    def commit_put(self, put: PendingPut) -> None:
        """Queue a prepared publish; it is shared with other channels, never mutated."""
        n = len(put.frames)
        self.message_count += n
        keep = put.keep
        if put.due_ns:
            if self.backend is not None:
                if keep < n:
                    self._deferred_to_disk(put.due_ns, n - keep)
            elif keep < n:
                self._drop_deferred(n - keep)
            positions = put.positions
            for i in range(keep):
                heapq.heappush(self._deferred, (put.due_ns, next(self._seq), put.frames[i],
                                                None if positions is None else positions[i]))
            return
        if keep:
            ids, frames = put.ids, put.frames
            positions = put.positions
            if keep < n:
                ids, frames = ids[:keep], frames[:keep]
                positions = None if positions is None else positions[:keep]
            if keep >= COALESCE or not self._coalesce(ids, frames, positions):
                self._chunks.append((ids, frames, positions))
            self._mem_count += keep
            self._mem_bytes += sum(map(len, frames))
        if self.backend is None and keep < n:
            self.dropped_count += n - keep
            if dropped := self._log_throttle.due(n - keep):
                log.warning("ephemeral channel full, dropping", channel=self.name, topic=self.topic_name,
                            dropped=dropped)
        self._wake(n)

    def _coalesce(self, ids: list[bytes], frames: list[bytes], positions) -> bool:
        """Append a small publish to the last chunk when it is small too (and, on disk, right before it)."""
        chunks = self._chunks
        if not chunks or (len(chunks) == 1 and self._head):
            return False
        last_ids, last_frames, last_positions = chunks[-1]
        if len(last_ids) + len(ids) > COALESCE or (last_positions is None) != (positions is None):
            return False
        if positions is not None:
            if type(last_positions) is not list or type(positions) is not list:
                return False
            if last_positions[-1] + RECORD_HEADER_SIZE + len(last_frames[-1]) != positions[0]:
                return False  # not neighbours on disk: one interval could not describe both
            positions = last_positions + positions
        chunks[-1] = (last_ids + ids, last_frames + frames, positions)
        return True

    def put_chunk(self, ids: list[bytes], frames: list[bytes], durable: bool = False) -> None:
        """Prepare and commit in one step (one channel, or a caller with no other channel to roll back)."""
        self.commit_put(self.prepare_put(ids, frames, durable))

    def _push_back(self, items: list[Item]) -> None:
        """REQ'd and timed-out messages join the back of the queue, as nsqd's ``put`` does.

        They stay in memory past ``mem_queue_size`` (they were in memory while
        in flight, so this holds no more than before); those read from disk
        keep their records.
        """
        for piece in pieces(items):
            self._chunks.append(piece)
            self._mem_count += len(piece[0])
            self._mem_bytes += sum(map(len, piece[1]))

    def _push_front(self, items: list[Item]) -> None:
        """Messages given back by a subscription that left go to the head of the queue, in order."""
        if self._head:
            ids0, frames0, positions0 = self._chunks[0]
            self._chunks[0] = (ids0[self._head:], frames0[self._head:],
                               None if positions0 is None else positions0[self._head:])
            self._head = 0
        for piece in reversed(pieces(items)):
            self._chunks.appendleft(piece)
            self._mem_count += len(piece[0])
            self._mem_bytes += sum(map(len, piece[1]))

    def _wake(self, n: int) -> None:
        """Wake hungry subscriptions with room for ``n`` new messages, first come first.

        One whose room is gone since it went hungry (RDY 0, CLS, a lower RDY,
        an AMQP link whose credit went to 0) is dropped without counting: its
        next fill, when it has room again, asks anew; counted, it would keep
        the messages from the others.
        """
        hungry = self._hungry
        while hungry and n > 0:
            sub = next(iter(hungry))
            del hungry[sub]
            room = sub.wake_room(n)
            if room > 0:
                sub.consumer.wake()
                n -= room

    def wake_all(self) -> None:
        for sub in list(self.subscriptions.values()):
            sub.consumer.wake()

    # --------------------------------------------------------------- taking
    def take(self, n: int, sub: Subscription, now_ns: int, max_bytes: float = math.inf) -> list[Piece]:
        """Up to ``n`` messages for ``sub`` as chunk slices (the subscription records them).

        A subscription that gets fewer than it asked for is remembered as
        hungry and woken when messages arrive, unless a budget stopped the
        take short (``sub.stopped_short``): it stops at the message that
        reaches ``max_bytes`` (from disk, within one scan window of it;
        dropped messages count), or once it went through ``EXAMINE_STEP``
        messages dropping some, and the caller comes back for more. Memory
        and disk take turns when both hold messages, so neither starves
        (nsqd gives no ordering guarantee either). Messages past the
        channel's TTL are dropped here, never delivered, and so are those the
        subscription's ``sample_rate`` does not keep; the take reads on for
        what it dropped, as nsqd's pump reads on after a skipped message.
        """
        pieces: list[Piece] = []
        sub.taken_bytes = 0
        sub.stopped_short = False
        if self.paused or self.exiting or self.draining:
            return pieces
        want = n
        ttl_ns = self.policy.ttl_ns
        rate = sub.sample_rate
        left = max_bytes
        examined = 0
        while True:
            batch: list[Piece] = []
            taken, nbytes = self._take_some(want, batch, now_ns, left)
            got = taken
            if taken and (ttl_ns or rate):
                if ttl_ns:
                    batch = self._unexpired(batch, now_ns - ttl_ns)
                if rate:
                    batch = self._sampled(batch, rate)
                got = sum(len(ids) for ids, _, _ in batch)
            pieces += batch
            want -= got
            left -= nbytes  # dropped messages' bytes too: a take's work is bounded, not only what it gives
            examined += taken
            sub.taken_bytes += nbytes
            if got == taken or want <= 0 or left <= 0 or examined >= EXAMINE_STEP:  # none dropped, or enough
                break
        if want > 0:
            if left <= 0 or got < taken:  # a budget ran out: the taker comes back
                sub.stopped_short = True
            else:
                self._hungry[sub] = None
        if pieces and self.on_room is not None:
            self._room_made()
        return pieces

    def _room_made(self) -> None:
        notify, self.on_room = self.on_room, None
        if notify is not None:
            notify()

    def _take_some(self, want: int, pieces: list[Piece], now_ns: int, max_bytes: float) -> tuple[int, int]:
        """Up to ``want`` messages and ``max_bytes``: (messages, their bytes)."""
        taken = nbytes = 0
        backend = self.backend
        disk_first = self._disk_turn = not self._disk_turn
        # only when the disk holds more than deferred records not yet due: reading those rewrites
        # them behind (with a full deferred heap), and a hungry consumer's every take did so for all
        # of them (49 REQs with --mem-queue-size=0 wrote 1,883 records)
        if disk_first and backend is not None and self.backend_depth:
            taken, nbytes = self._take_disk(want, pieces, now_ns, max_bytes)
        if want > taken and self._mem_count and nbytes < max_bytes:
            got, size = self._take_memory(want - taken, pieces, max_bytes - nbytes)
            taken += got
            nbytes += size
        if want > taken and backend is not None and self.backend_depth and nbytes < max_bytes:
            got, size = self._take_disk(want - taken, pieces, now_ns, max_bytes - nbytes)
            taken += got
            nbytes += size
        return taken, nbytes

    def _unexpired(self, pieces: list[Piece], cutoff_ns: int) -> list[Piece]:
        """Drop (and count) messages published before ``cutoff_ns``: never delivered."""
        kept: list[Piece] = []
        for ids, frames, positions in pieces:
            fresh = [i for i, f in enumerate(frames) if message.frame_timestamp(f) >= cutoff_ns]
            if len(fresh) == len(frames):
                kept.append((ids, frames, positions))
                continue
            self.expired_count += len(frames) - len(fresh)
            if self.failed or self.released:
                kept_ids = {ids[i] for i in fresh}
                self.forget([i for i in ids if i not in kept_ids])
            if fresh:
                kept.append(([ids[i] for i in fresh], [frames[i] for i in fresh],
                             None if positions is None else tuple(positions[i] for i in fresh)))
        return kept

    def _take_memory(self, n: int, pieces: list[Piece], max_bytes: float = math.inf) -> tuple[int, int]:
        """Up to ``n`` messages from memory, stopping at the one that reaches ``max_bytes``: (messages, bytes)."""
        taken = 0
        nbytes = 0
        chunks = self._chunks
        while taken < n and chunks and nbytes < max_bytes:
            ids, frames, positions = chunks[0]
            start = self._head
            end = min(start + n - taken, len(ids))
            part = frames[start:end] if start or end < len(ids) else frames
            size = sum(map(len, part))
            if nbytes + size > max_bytes:  # the rare cut: sized message by message
                end = start + _fitting(frames, start, end, max_bytes - nbytes)
                part = frames[start:end]
                size = sum(map(len, part))
            if end >= len(ids):
                if start:
                    ids = ids[start:]
                    positions = None if positions is None else positions[start:]
                chunks.popleft()
                self._head = 0
            else:
                ids = ids[start:end]
                positions = None if positions is None else positions[start:end]
                self._head = end
            pieces.append((ids, part, positions))
            taken += len(ids)
            self._mem_bytes -= size
            nbytes += size
        self._mem_count -= taken
        return taken, nbytes

    def _take_disk(self, n: int, pieces: list[Piece], now_ns: int, max_bytes: float = math.inf) -> tuple[int, int]:
        """Up to ``n`` messages from disk, reading on past the records set aside.

        A deferred record not yet due (or an undecodable one) is no message
        to deliver, and a take that stopped at it would leave the consumer
        hungry with deliverable messages behind it. It reads on only while
        records are set aside, up to the records there were when it started:
        a deferred one may be written back behind them (:meth:`_defer`).
        """
        backend = self.backend
        left = backend.depth
        taken = nbytes = 0
        while True:
            before = backend.bytes_read
            got, read = self._read_disk(n - taken, pieces, now_ns, max_bytes - nbytes)
            taken += got
            left -= read
            nbytes += backend.bytes_read - before  # what was read, records set aside and headers included
            if got == read or taken >= n or left <= 0 or nbytes >= max_bytes:
                return taken, nbytes

    def _read_disk(self, n: int, pieces: list[Piece], now_ns: int, max_bytes: float = math.inf) -> tuple[int, int]:
        """One read of up to ``n`` records (stopping at ``max_bytes``): (messages to deliver, records read)."""
        try:
            payloads, positions = self.backend.read_positioned(n, max_bytes)
        except DiskQueueError as exc:
            log.error("cannot read the channel's disk queue", channel=self.name, topic=self.topic_name,
                      error=str(exc))
            self._on_read_failed(self)
            return 0, 0
        if not self._notes and set(map(_KIND, payloads)) <= _PLAIN:  # frames as stored: used as they are
            if payloads:
                pieces.append((list(map(message.frame_id_of, payloads)), payloads, positions))
            return len(payloads), len(payloads)
        frames: list[bytes] = []
        kept: list[int] = []
        for payload, pos in zip(payloads, positions):
            item = self._decode(payload, pos, now_ns)
            if item is not None:
                frames.append(item)
                kept.append(pos)
        if frames:
            neighbours = len(kept) == len(positions) and type(positions) is list
            pieces.append((list(map(message.frame_id_of, frames)), frames, kept if neighbours else tuple(kept)))
        return len(frames), len(payloads)

    def _decode(self, payload: bytes, pos: int, now_ns: int) -> bytes | None:
        """A read record as a frame to deliver now; None if it is deferred, held or undecodable."""
        try:
            frame, due_ns, failed = message.from_disk(payload)
        except message.BadRecord as exc:
            self.dropped_count += 1
            log.error("undecodable message on disk", channel=self.name, topic=self.topic_name, error=str(exc))
            return None
        if due_ns:
            self._deferred_read(due_ns)
        note = self._notes.at(pos) if self._notes else None
        if note:
            frame, due_ns, failed = self._apply_note(frame, pos, note, due_ns, failed)
        if failed:
            self.failed[message.frame_id(frame)] = failed
        if due_ns > now_ns:
            self._defer(frame, due_ns, pos)
            return None
        return frame

    def _apply_note(self, frame: bytes, pos: int, note: dict, due_ns: int, failed: int):
        attempts = note.get("a", message.frame_attempts(frame)) + note.get("i", 0)
        if attempts != message.frame_attempts(frame):
            frame = message.with_attempts(frame, attempts)
        failed = note.get("f", failed) + note.get("i", 0)  # in flight at a crash: a failed delivery too
        if attempts > 1 or failed:
            self._revised[pos] = (attempts, failed)
        return frame, note.get("d", due_ns), failed

    def _sampled(self, pieces: list[Piece], rate: int) -> list[Piece]:
        """nsqd's sample_rate: keep about ``rate`` percent; the rest are dropped for the channel."""
        kept, dropped = keep_sample(pieces, rate)
        for ids, _, _ in dropped:
            if self.failed or self.released:
                self.forget(ids)
        return kept

    # ------------------------------------------------------- consumer verbs
    def requeue(self, item: Item, delay_ns: int, now_ns: int, *, count_attempt: bool = True,
                front: bool = False) -> None:
        """A consumer gave a message back; it was already removed from in-flight.

        NSQ's REQ counts the delivery (attempts) and a failed delivery; an AMQP
        ``released`` counts neither. Without a delay it goes to the back of
        the queue, as nsqd's REQ 0 does (``front``: to the head, for AMQP's
        dispositions and ``LREQ``).
        """
        frame, pos = item
        self.requeue_count += 1
        if count_attempt:
            if self._exhausted(frame):
                self._dead_letter([item])
                return
            frame = message.next_attempt(frame)
            self.count_failure(message.frame_id(frame))
            self._revise(frame, pos)
        if delay_ns > 0:
            self._defer(frame, now_ns + delay_ns, pos)
        elif front:
            self._push_front([(frame, pos)])
            self._wake(1)
        else:
            self._push_back([(frame, pos)])
            self._wake(1)

    def requeue_many(self, items: list[Item], now_ns: int, *, count_attempt: bool) -> None:
        """Give several back at once; the first is delivered first again."""
        if count_attempt:
            for item in reversed(items):
                self.requeue(item, 0, now_ns, front=True)
            return
        self.released.update(message.frame_id(frame) for frame, _ in items)
        self.requeue_count += len(items)
        if items:
            self._push_front(items)
            self._wake(len(items))

    def _revise(self, frame: bytes, pos: int | None) -> None:
        if pos is not None:
            self._revised[pos] = (message.frame_attempts(frame), self.failed.get(message.frame_id(frame), 0))

    def count_failure(self, msg_id: bytes) -> None:
        self.failed[msg_id] = self.failed.get(msg_id, 0) + 1

    def forget(self, ids) -> None:
        """Finished messages leave the failed-count table and the released set (called when either has any)."""
        pop = self.failed.pop
        discard = self.released.discard
        for msg_id in ids:
            pop(msg_id, None)
            discard(msg_id)

    def reject(self, item: Item) -> None:
        """A consumer refused a message for good: it goes to the dead-letter topic."""
        self.rejected_count += 1
        self._dead_letter([item])

    def _exhausted(self, frame: bytes) -> bool:
        """The message has had all the deliveries ``max_attempts`` allows."""
        max_attempts = self.policy.max_attempts
        return bool(max_attempts) and message.frame_attempts(frame) >= max_attempts

    def _give_back(self, items: list[Item], *, front: bool = True) -> None:
        """Delivered messages back to the queue (its head unless not ``front``), or to the dead letters."""
        if self.policy.max_attempts:
            dead = [item for item in items if self._exhausted(item[0])]
            if dead:
                self._dead_letter(dead)
                items = [item for item in items if not self._exhausted(item[0])]
        if items:
            back = [(message.next_attempt(frame), pos) for frame, pos in items]
            for frame, pos in back:
                self._revise(frame, pos)
            (self._push_front if front else self._push_back)(back)
            self._wake(len(items))

    def _dead_letter(self, items: list[Item]) -> None:
        self.dead_letter_count += len(items)
        if self.failed or self.released:
            self.forget([message.frame_id(frame) for frame, _ in items])
        if self.dead_letter is None:
            self.dropped_count += len(items)
            return
        if not self.dead_letter([frame for frame, _ in items]):
            self._dead_pending += items

    def retry_dead_letters(self) -> None:
        """Hand on the dead letters the dead-letter topic could not take (a full disk, its limit).

        Until then the channel keeps them, with their disk records, so a
        crash brings them back as queued messages rather than losing them.
        """
        if self._dead_pending and self.dead_letter is not None:
            items, self._dead_pending = self._dead_pending, []
            if not self.dead_letter([frame for frame, _ in items]):
                self._dead_pending = items

    def drop_oldest(self, count_: int) -> None:
        """Make room under the drop-oldest policy: the head of the queue goes first."""
        pieces: list[Piece] = []
        dropped, _ = self._take_memory(min(count_, self._mem_count), pieces)
        if dropped < count_ and self.backend is not None:
            try:
                dropped += len(self.backend.read_many(count_ - dropped))
            except DiskQueueError as exc:
                log.error("cannot drop from the channel's disk queue", channel=self.name, error=str(exc))
        self.dropped_count += dropped
        if self.failed or self.released:
            self.forget([i for ids, _, _ in pieces for i in ids])
        self._room_made()

    def _drop_deferred(self, count: int) -> None:
        self.dropped_count += count
        if dropped := self._log_throttle.due(count):
            log.warning("ephemeral channel's deferred messages full, dropping", channel=self.name,
                        topic=self.topic_name, dropped=dropped)

    def _defer(self, frame: bytes, due_ns: int, pos: int | None) -> None:
        backend = self.backend
        if backend is None and len(self._deferred) >= max(self.mem_queue_size, 1):
            self._drop_deferred(1)  # no disk to spill to: bounded as its memory queue is
            if self.failed:
                self.failed.pop(message.frame_id(frame), None)
            return
        if len(self._deferred) >= max(self.mem_queue_size, 1) and backend is not None:
            if pos is not None and len(self._deferred_index) < DEFERRED_INDEX:  # its record stays
                heapq.heappush(self._deferred_index, (due_ns, next(self._seq), pos))
                return
            failed = self.failed.pop(message.frame_id(frame), 0) if self.failed else 0
            try:
                backend.put(message.to_disk(frame, due_ns=due_ns, failed=failed))
            except DiskQueueError as exc:  # a full disk: the heap goes past its bound rather than lose it
                if kept := self._log_throttle.due():
                    log.error("deferred messages kept in memory", channel=self.name, count=kept, error=str(exc))
            else:
                self._deferred_to_disk(due_ns)
                return
        heapq.heappush(self._deferred, (due_ns, next(self._seq), frame, pos))

    def _deferred_to_disk(self, due_ns: int, count: int = 1) -> None:
        due = self._disk_due
        if due_ns not in due:
            heapq.heappush(self._disk_due_times, due_ns)
        due[due_ns] = due.get(due_ns, 0) + count
        self._deferred_on_disk += count

    def _deferred_read(self, due_ns: int) -> None:
        """A deferred record was read from disk: not on disk any more, unless the scan found it due already.

        (A record written before a restart was never counted: it counts as depth until read.)
        """
        left = self._disk_due.get(due_ns)
        if left:
            self._deferred_on_disk -= 1
            if left > 1:
                self._disk_due[due_ns] = left - 1
            else:
                del self._disk_due[due_ns]

    def _disk_deferred_due(self, now_ns: int) -> int:
        """How many deferred records on disk are due by ``now_ns``; from now on they count as depth."""
        times = self._disk_due_times
        due = 0
        while times and times[0] <= now_ns:
            due += self._disk_due.pop(heapq.heappop(times), 0)
        self._deferred_on_disk -= due
        return due

    # ------------------------------------------------------------ queue scan
    def process_in_flight(self, now_ns: int) -> bool:
        """Requeue timed-out messages, at most ``EXAMINE_STEP`` (``timeouts_left`` says whether
        it stopped there: the caller comes back after other tasks ran; 100,000 at once held the
        event loop for 250 ms); True if there was any (never in a deleted channel)."""
        self.timeouts_left = False
        if self.exiting:
            return False
        dirty = False
        left = EXAMINE_STEP
        for sub in list(self.subscriptions.values()):
            items = sub.in_flight.expire(now_ns, left)
            if items:
                dirty = True
                left -= len(items)
                sub.timeout_count += len(items)
                sub.consumer.timed_out(len(items))
                self._timed_out(items)
                sub.consumer.wake()
                if not left:
                    break
        if left:
            items = self.leases.expire(now_ns, left)
            if items:
                dirty = True
                left -= len(items)
                self._timed_out(items)
        self.timeouts_left = not left
        if dirty:
            self._wake(self._mem_count)
            self.settled()
        if self._dead_pending:
            self.retry_dead_letters()
        return dirty

    def _timed_out(self, items: list[Item]) -> None:
        self.timeout_count += len(items)
        for frame, _ in items:
            self.count_failure(message.frame_id(frame))
        self._give_back(items, front=False)

    def process_deferred(self, now_ns: int) -> bool:
        """Move deferred messages that are due to the queue; True if there was any.

        Those on disk stay there, in the queue's order, until a take reads
        them: once they are due they count as depth, and hungry consumers
        are woken to read them. A deleted channel is left alone (its queue is gone).
        """
        if self.exiting:
            return False
        disk_due = self._disk_deferred_due(now_ns)
        if disk_due:
            self._wake(disk_due)
        deferred = self._deferred
        index = self._deferred_index
        if (not deferred or deferred[0][0] > now_ns) and (not index or index[0][0] > now_ns):
            return bool(disk_due)
        due: list[Item] = []
        while deferred and deferred[0][0] <= now_ns:
            _, _, frame, pos = heapq.heappop(deferred)
            due.append((frame, pos))
        if index and index[0][0] <= now_ns:
            due += self._read_indexed(now_ns)
        for ids, frames, positions in pieces(due):
            self._chunks.append((ids, frames, positions))
            self._mem_count += len(ids)
            self._mem_bytes += sum(map(len, frames))
        self._wake(self._mem_count)
        return True

    def _read_indexed(self, now_ns: int) -> list[Item]:
        """The indexed deferred records due by ``now_ns``, read back, with the attempts and failures
        they had when they were deferred (kept as revisions of their records)."""
        index = self._deferred_index
        positions: list[int] = []
        while index and index[0][0] <= now_ns:
            positions.append(heapq.heappop(index)[2])
        try:
            payloads = self.backend.read_at(positions)
        except DiskQueueError as exc:
            log.error("cannot read deferred messages back", channel=self.name, topic=self.topic_name,
                      error=str(exc))
            return []
        items: list[Item] = []
        for pos, payload in zip(positions, payloads):
            try:
                if payload is None:
                    raise message.BadRecord("no valid record at its position")
                frame, _, failed = message.from_disk(payload)
            except message.BadRecord as exc:
                self.dropped_count += 1
                log.error("deferred message lost on disk", channel=self.name, topic=self.topic_name,
                          error=str(exc))
                continue
            revised = self._revised.get(pos)
            if revised is not None:
                frame = message.with_attempts(frame, revised[0])
                failed = revised[1]
            if failed:
                self.failed[message.frame_id(frame)] = failed
            items.append((frame, pos))
        return items

    # ------------------------------------------------------------- admin
    def set_policy(self, policy: ChannelPolicy, overrides: dict | None = None) -> None:
        self.policy = policy
        if overrides is not None:
            self.overrides = dict(overrides)
        self._room_made()

    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self.wake_all()

    def empty(self) -> None:
        """Drop every queued, deferred and in-flight message (as nsqd's Empty).

        Consumers are woken: the in-flight messages they lost gave them room
        again, and one whose RDY they filled is not hungry, so no publish would.
        """
        self._chunks.clear()
        self._head = 0
        self._mem_count = self._mem_bytes = 0
        self._deferred.clear()
        self._deferred_index.clear()
        self._deferred_on_disk = 0
        self._disk_due.clear()
        self._disk_due_times.clear()
        for sub in self.subscriptions.values():
            sub.in_flight.clear()
        self.leases.clear()
        self.failed.clear()
        self.released.clear()
        self._revised.clear()
        self._dead_pending.clear()
        if self.backend is not None:
            self.backend.empty()
        self._room_made()
        self.wake_all()

    # -------------------------------------------------------- durability
    def _kept(self) -> tuple[list, int]:
        """The disk records of unfinished messages, for the disk queue's checkpoint.

        Queued messages, messages in flight (noted, so a restart counts the
        delivery), deferred ones (noted with their due time) and leased ones
        (noted with the lease); messages whose attempts or failures changed
        get a note of their own.
        """
        out: list = []
        held = 0
        head = self._head
        for index, (_, _, positions) in enumerate(self._chunks):
            if positions is None:
                continue
            start = head if index == 0 else 0
            if start >= len(positions):
                continue
            held += len(positions) - start
            if type(positions) is list:
                out.append((positions[start], positions[-1], None))
            else:
                out += [(pos, pos, None) for pos in positions[start:]]
        refine = False
        for sub in self.subscriptions.values():
            runs, n = sub.in_flight.kept(IN_FLIGHT_NOTE)
            out += runs
            held += n
            refine = refine or sub.in_flight.refine_later
        if refine:  # batches kept whole this time, finished in part maybe: only their rest next time
            self.backend.kept_changed()
        runs, _ = self.leases.kept()  # not counted: reserved records are never read back
        out += runs
        for due_ns, _, _, pos in self._deferred:
            if pos is not None:
                out.append((pos, pos, {"d": due_ns}))
                held += 1
        for due_ns, _, pos in self._deferred_index:
            out.append((pos, pos, {"d": due_ns}))
        held += len(self._deferred_index)
        for _, pos in self._dead_pending:
            if pos is not None:
                out.append((pos, pos, None))
                held += 1
        if self._revised:
            out += self._revised_notes(out)
        return out, held

    def _revised_notes(self, live: list) -> list:
        """Notes for revised messages still unfinished; the others leave the table."""
        firsts = sorted((first, last) for first, last, _ in live)
        starts = [first for first, _ in firsts]
        notes = []
        for pos, (attempts, failed) in list(self._revised.items()):
            index = bisect.bisect_right(starts, pos) - 1
            if index >= 0 and pos <= firsts[index][1]:
                note = {"a": attempts}
                if failed:
                    note["f"] = failed
                notes.append((pos, pos, note))
            else:
                del self._revised[pos]
        return notes

    def _recover(self) -> None:
        """After a restart: take back the leases noted on disk; the rest is read back lazily."""
        backend = self.backend
        self._notes = _Notes(backend.recovered_kept)
        leased: dict[str, tuple[list[int], int]] = {}
        for first, _, note in backend.recovered_kept:
            if isinstance(note, dict) and "l" in note:
                positions, _ = leased.setdefault(str(note["l"]), ([], int(note.get("t", 0)) * 1_000_000))
                positions.append(first)
        if not leased:
            return
        now_ns = self.clock()
        restored = 0
        for name, (positions, timeout_ns) in leased.items():
            items: list[Item] = []
            for start in range(0, len(positions), _RESTORE_STEP):
                step = positions[start:start + _RESTORE_STEP]
                for pos, payload in zip(step, backend.read_at(step)):
                    try:
                        frame = message.from_disk(payload)[0] if payload is not None else None
                    except message.BadRecord:
                        frame = None
                    if frame is None:
                        log.error("a leased message's record is unreadable", channel=self.name, lease=name)
                        continue
                    note = self._notes.at(pos) or {}
                    if "a" in note:
                        frame = message.with_attempts(frame, note["a"])
                    items.append((frame, pos))
            if items:
                self.leases.restore(name, items, now_ns, timeout_ns or self.lease_timeout_ns)
                restored += len(items)
        log.info("leases recovered", channel=self.name, topic=self.topic_name, leases=len(leased),
                 messages=restored)

    def shutdown_records(self, lent: set[bytes] = frozenset()) -> list[bytes]:
        """Shutdown: the disk records every memory-only message still needs, in delivery order.

        Messages that have a record already stay where they are: the final
        checkpoint keeps them, with their notes, and so do those the topic
        ``lent`` (their records are the topic's). In-flight messages go back
        to the head of the queue first (their delivery counts), then come the
        memory-only part of the queue and of the deferred heap, deferred ones
        with their due times. Leased memory-only messages are written here at
        once, noted with their lease, so they come back in it (without it if
        the disk refuses them: then they are written with the queued ones).
        """
        for sub in list(self.subscriptions.values()):
            self._give_back(sub.in_flight.drain())
        failed = self.failed
        records = [message.to_disk(f, failed=failed.get(message.frame_id(f), 0)) for f in self._persist_leases()]
        head = self._head
        for index, (ids, frames, positions) in enumerate(self._chunks):
            if positions is None:
                start = head if index == 0 else 0
                records += [message.to_disk(f, failed=failed.get(i, 0))
                            for i, f in zip(ids[start:], frames[start:]) if i not in lent]
        records += [message.to_disk(f, due_ns=due, failed=failed.get(message.frame_id(f), 0))
                    for due, _, f, pos in sorted(self._deferred) if pos is None and message.frame_id(f) not in lent]
        self.retry_dead_letters()  # else they come back queued
        records += [message.to_disk(f) for f, pos in self._dead_pending if pos is None]
        return records

    def _persist_leases(self) -> list[bytes]:
        """Leased memory-only messages get records; the final checkpoint notes them with their lease.

        What the disk refuses (all of a lease's or none) is returned, to be
        written in steps with the queued messages: the lease is lost, the
        messages need not be, and the rest of the channel is still written.
        """
        refused: list[bytes] = []
        for lease in self.leases:
            items = lease.in_flight.drain()
            memory = [frame for frame, pos in items if pos is None]
            try:
                written_at = self.backend.put_positioned(memory) if memory else []
            except DiskQueueError as exc:
                log.error("leased messages written without their lease at shutdown", channel=self.name,
                          topic=self.topic_name, lease=lease.name, count=len(memory), error=str(exc))
                refused += memory
                lease.restore([item for item in items if item[1] is not None], 0)
                continue
            self.backend.reserve(written_at)
            positions = iter(written_at)
            items = [(frame, pos if pos is not None else next(positions)) for frame, pos in items]
            lease.restore(items, 0)
        return refused


class _Notes:
    """The notes a stopped channel left on its kept records, looked up by position.

    Records are read back in position order, so once a lookup passes the
    last noted position the notes are dropped and reading takes its fast
    path again.
    """

    def __init__(self, kept) -> None:
        noted = sorted(((first, last, note) for first, last, note in kept if isinstance(note, dict)),
                       key=lambda k: (k[0], k[1]))
        self._single: dict[int, dict] = {}
        for first, last, note in noted:  # a record may have several notes (due time, revised attempts): all apply
            if first == last:
                self._single[first] = {**self._single.get(first, {}), **note}
        self._ranges = [(first, last, note) for first, last, note in noted if first != last]
        self._starts = [first for first, _, _ in self._ranges]
        self._end = max((last for _, last, _ in noted), default=-1)

    def __bool__(self) -> bool:
        return self._end >= 0

    def at(self, pos: int) -> dict | None:
        if pos > self._end:
            self._single, self._ranges, self._starts, self._end = {}, [], [], -1
            return None
        note = None
        if self._ranges:
            index = bisect.bisect_right(self._starts, pos) - 1
            if index >= 0 and pos <= self._ranges[index][1]:
                note = dict(self._ranges[index][2])
        single = self._single.pop(pos, None)
        if single is not None:
            note = {**(note or {}), **single}
        return note

