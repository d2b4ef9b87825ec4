"""The disk queue: a crash-safe FIFO of opaque records in segment files.

Every put is written to the operating system before it returns, all or
nothing, so a crash of the process never loses a record whose put returned;
a put that cannot be written (a full disk) raises and leaves no trace. Making
records durable against power loss is the :meth:`DiskQueue.run` task's job,
through io_uring (or a worker thread where it cannot be used): because a
caller waits for it (group commit: one ``fdatasync`` serves every waiter of
a round; the next round gathers while the current one syncs and starts the
moment it settles, with no pass of the scheduler in between, and before the
settled round's waiters are answered, so that the disk syncs while they
are) or because
``sync_every`` puts and reads or ``sync_timeout`` seconds have passed (a
checkpoint, which also saves the metadata).

Reading does not release. A record that was read stays on disk until the
queue's owner no longer needs it: at every checkpoint the owner's
:attr:`DiskQueue.keeper` says which read records it still holds (a channel's
queued, in-flight and deferred messages), the queue saves that list with the
metadata, moves its release point to the first of them and deletes the
segments before it. After a crash reading starts again at the release point,
and of the records between it and the saved read position only the kept ones
come back. A queue without a keeper releases what it reads.
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import functools
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import trio

from . import sync, uring
from .errors import DiskQueueError, DiskQueueReadError, DiskQueueWriteError, MessageSizeError
from .lock import acquire_queue_lock
from .metadata import CheckpointFile, Kept, Metadata, save_metadata, stage_metadata
from .naming import QueueFiles, fsync_directory
from .reader import SegmentReader
from .records import (
    MAX_RECORD_LENGTH, MAX_SEGMENT_BYTES, OFFSET_BITS, RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE, position, split_position,
)
from .recovery import recover
from .stats import DiskQueueStatistics
from .writer import SegmentWriter

if TYPE_CHECKING:
    import outcome  # trio's own dependency: the type of what a worker thread hands back

    from .trash import TrashBin

logger = structlog.get_logger("nsqd.diskq")

#: a queue read to its end starts a new segment once its current one holds this much, so that the
#: read one can go (without this a drained queue kept up to --max-bytes-per-file on disk until
#: it filled that segment, space a full disk never got back); see :meth:`DiskQueue.seal_if_drained`
SEAL_DRAINED = 16 << 20
#: ... and at any size while the file system has less than this free (looked at once a second at
#: most per queue): a nearly full disk gets its consumers' room back before a write fails
LOW_SPACE = 64 << 20

#: what a keeper returns: the read records still held (as kept intervals) and how many records they are
KeptSnapshot = tuple[list[Kept], int]


class _CommitRound:
    """The waiters one fsync will release: tasks waiting on it, and callbacks.

    Its event and list are made only for a round that gets waiters: every
    checkpoint starts a new round, and a busy daemon has thousands of
    queues whose rounds nobody waits for (each object a young one for the
    garbage collector to look at).
    """

    __slots__ = ("finished", "error", "waiters", "_done", "_callbacks")

    def __init__(self) -> None:
        self.finished = False
        self.error: DiskQueueError | None = None
        self.waiters = 0
        self._done: trio.Event | None = None
        self._callbacks: list[Callable[[DiskQueueError | None], None]] | None = None

    async def wait(self) -> None:
        if not self.finished:
            if self._done is None:
                self._done = trio.Event()
            await self._done.wait()

    def add_callback(self, callback: Callable[[DiskQueueError | None], None]) -> None:
        if self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def finish(self, error: DiskQueueError | None) -> None:
        self.error = error
        self.finished = True
        if self._done is not None:
            self._done.set()
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback(error)
            except Exception:  # a waiter's bug must not stop the queue's commits
                logger.exception("diskq_durable_callback_failed")


class DiskQueue:
    """A named FIFO queue of byte payloads stored under ``data_path``.

    Every method is called from the Trio thread; only fsync work runs in
    worker threads, started by :meth:`run`. ``present_files``: the queue's
    file names from a listing of ``data_path`` just taken (see
    ``naming.DirectoryListing``), so that opening it lists nothing more.
    """

    def __init__(
        self,
        name: str,
        data_path: str | os.PathLike[str],
        *,
        max_bytes_per_file: int = 100 * 1024 * 1024,
        min_msg_size: int = 0,
        max_msg_size: int = 1024 * 1024 + 64,
        sync_every: int = 2500,
        sync_timeout: float = 2.0,
        present_files: list[str] | None = None,
        trash: TrashBin | None = None,
        lock_file: bool = True,
    ) -> None:
        if not 0 <= min_msg_size <= max_msg_size <= MAX_RECORD_LENGTH:
            raise ValueError(
                f"need 0 <= min_msg_size <= max_msg_size <= {MAX_RECORD_LENGTH}, "
                f"got {min_msg_size} and {max_msg_size}"
            )
        if not SEGMENT_HEADER_SIZE + RECORD_HEADER_SIZE < max_bytes_per_file < MAX_SEGMENT_BYTES:
            raise ValueError(f"max_bytes_per_file must be in ({SEGMENT_HEADER_SIZE + RECORD_HEADER_SIZE}, "
                             f"{MAX_SEGMENT_BYTES})")
        if sync_every < 1 or sync_timeout <= 0:
            raise ValueError("sync_every must be at least 1 and sync_timeout positive")
        self.name = name
        self._min_size = min_msg_size
        self._max_size = max_msg_size
        self._sync_every = sync_every
        self._sync_timeout = sync_timeout
        self._files = QueueFiles(data_path, name, present_files)
        #: where emptied and deleted segments go to be unlinked off the loop (None: unlinked here)
        self._trash = trash
        self._log = logger.bind(queue=name)
        #: the descriptor holding the queue's lock file; None when the owner locks the whole data path
        self._lock_fd: int | None = None
        self._lock_file = lock_file
        self._lock()
        try:
            state = recover(self._files, min_msg_size, max_msg_size, self._log)
        except OSError as exc:
            self._unlock()
            raise DiskQueueError(f"disk queue {name!r}: cannot recover its files in {data_path}: {exc}") from exc
        except BaseException:
            self._unlock()
            raise
        self._writer = SegmentWriter(self._files, state.write_segment, state.write_position, max_bytes_per_file)
        self._reader = SegmentReader(self._files, self._writer, state.release_segment, state.release_position,
                                     min_msg_size, max_msg_size, self._log)
        #: the records between the release point and this position come back only if kept
        self._filter_until: int | None = None
        self._filter_firsts: list[int] = []
        self._filter_lasts: list[int] = []
        self._kept_unread = 0
        saved_read = position(state.read_segment, state.read_position)
        #: records the owner took back itself (kept with a note marked ``"r"``): reading skips them
        self._reserved = {first for first, _, note in state.kept if _reserved_note(note)}
        #: segments between the release point and the read position with no kept record left,
        #: released while older and newer ones are still held (see :meth:`_plan`)
        self._holes = self._reader.holes
        if self._reader.position < saved_read:
            self._filter_until = saved_read
            self._filter_firsts, self._filter_lasts = _union(state.kept)
            self._kept_unread = state.kept_count
            holes = _uncovered(state.kept, state.release_segment + 1, min(state.read_segment, state.write_segment))
            self._holes.update(holes)
            self._discard_segments(holes)  # a crash after the checkpoint that released them
        #: the owner's notes on the records it kept before the last stop: (first, last, note)
        self.recovered_kept: tuple[Kept, ...] = tuple(k for k in state.kept if k[2] is not None)
        self._depth = state.depth - sum(1 for pos in self._reserved if pos >= saved_read)
        if self._depth <= 0 and self._filter_until is None and not self._reader.caught_up:
            self._depth = 1  # never 0 with records past the read position (see _read): reading settles it
        self._oldest_segment = state.release_segment
        #: when the free space of the file system was last looked at (see _low_on_space)
        self._space_checked_at = -math.inf
        self._release = self._reader.position
        self._segment_sizes: dict[int, int] = {}
        self._recovered_damage = (state.damaged_records, state.damaged_bytes)
        #: set by the owner: the read records it still holds, asked at every checkpoint
        self.keeper: Callable[[], KeptSnapshot] | None = None
        self._put_count = 0
        self._durable_count = 0
        self._bytes_written = 0
        self._syncs = 0
        self._ops_since_checkpoint = 0
        #: records were read since the last checkpoint (a crash would read them again)
        self._read_since_checkpoint = False
        #: the round that was to sync the checkpoint saved last before the queue rested failed
        self._settle_failed = False
        self._checkpoint_due = False
        self._metadata_dirty = False
        self._last_checkpoint = float("-inf")
        self._last_error: str | None = None
        #: the ongoing write or sync failure, None once a write and a sync succeed again
        self.failing: str | None = None
        self._failing_save = False
        self._sequence = state.sequence
        self._checkpoint_file = CheckpointFile(self._files.checkpoint_paths)
        #: the metadata file's document while no checkpoint file is newer (None: not known to be so)
        self._on_disk: Metadata | None = None
        self._gate = sync.SyncGate()
        #: the io_uring for the commits' fdatasyncs: opened by the first commit
        #: (most queues of a daemon never commit), closed when run() ends
        self._ring: uring.SyncRing | None = None
        #: io_uring cannot be used here (unavailable, or it refused a submission)
        self._ring_refused = False
        #: run()'s wake-up: the flag, and where run() parks until it is raised (one lot for the
        #: queue's life, not an event per wake-up)
        self._woken = False
        self._wakeup = trio.lowlevel.ParkingLot()
        self._next_round = _CommitRound()
        #: a round that synced, whose waiters are answered once the next round is under way (never
        #: across an await: see :meth:`_release_synced`)
        self._synced_round: _CommitRound | None = None
        #: the round being committed (its sync under way)
        self._committing: _CommitRound | None = None
        self._running = False
        #: run() was started with start_soon and will be running soon (see :meth:`run_scheduled`)
        self._run_scheduled = False
        self._closed = False
        if state.fresh:  # no file says what an empty metadata file would: nothing to write (two
            self._on_disk = self._snapshot()  # fsyncs on the event loop per new topic or channel)
        else:
            self._save_metadata_now(state.on_disk)
        self._log.info(
            "diskq_opened",
            depth=self._depth,
            release=(state.release_segment, state.release_position),
            read=(state.read_segment, state.read_position),
            write=(state.write_segment, state.write_position),
        )

    # -- writing -----------------------------------------------------------

    def put(self, payload: bytes) -> None:
        """Append one record; see :meth:`put_many`."""
        self._append((payload,), False)

    def put_many(self, payloads: Sequence[bytes]) -> None:
        """Append a batch in order, written to the OS before this returns; all or none of it.

        Raises MessageSizeError if any payload is outside the size limits and
        DiskQueueWriteError if it cannot be written (nothing of it is stored).
        """
        self._append(payloads, False)

    def put_positioned(self, payloads: Sequence[bytes]) -> list[int]:
        """:meth:`put_many`, returning each record's position."""
        return self._append(payloads, True) or []

    def put_held(self, payloads: Sequence[bytes], hold: int | None = None) -> list[int]:
        """Append records whose first ``hold`` (default: all) the caller keeps and delivers itself.

        Write-through: the read position moves past the held records, so they
        are never read back, and they stay on disk until the keeper stops
        listing them; the rest stay unread. Needs a queue with nothing unread
        (else the reader would skip unread records).
        """
        if self._depth:
            raise DiskQueueError(f"disk queue {self.name!r}: put_held needs a queue with nothing unread")
        hold = len(payloads) if hold is None else hold
        positions = self._append(payloads, True) or []
        self._end_filter()
        if hold >= len(payloads):
            self._reader.skip_to_end()
        elif hold:
            self._reader.skip_to(positions[hold])
        self._depth -= hold
        return positions

    def reserve(self, positions: Sequence[int]) -> None:
        """Records just put that the owner keeps itself (a lease): never read back, kept until released."""
        self._reserved.update(positions)
        self._depth -= len(positions)

    def mark(self) -> tuple:
        """Where the queue stands, for :meth:`undo` (a batch that another queue failed to take)."""
        writer, reader = self._writer, self._reader
        return (writer.segment, writer.end, reader.segment, reader.offset, self._depth, self._put_count,
                self._bytes_written)

    def undo(self, mark: tuple) -> None:
        """Take back everything put since :meth:`mark`, as if it never was (nothing was read since)."""
        segment, end, read_segment, read_offset, depth, put_count, bytes_written = mark
        self._writer.rollback(segment, end)
        if (self._reader.segment, self._reader.offset) != (read_segment, read_offset):
            self._reader.jump(read_segment, read_offset)
        self._depth, self._put_count, self._bytes_written = depth, put_count, bytes_written

    def read_at(self, positions: Sequence[int]) -> list[bytes | None]:
        """The records at ``positions`` (None where none verifies), without moving the read position."""
        return [self._reader.record_at(pos) for pos in positions]

    @property
    def bytes_read(self) -> int:
        """Bytes of records read so far, headers included (a counter: what one read took is its growth)."""
        return self._reader.bytes_read

    @property
    def read_position(self) -> int:
        return self._reader.position

    @property
    def recovering(self) -> bool:
        """Still reading the records kept before the last stop (the rest of them are skipped)."""
        return self._filter_until is not None

    def _append(self, payloads: Sequence[bytes], want_positions: bool) -> list[int] | None:
        self._check_open()
        count = len(payloads)
        if not count:
            return [] if want_positions else None
        sizes = list(map(len, payloads))
        if min(sizes) < self._min_size or max(sizes) > self._max_size:
            self._raise_size_error(payloads)
        size = sum(sizes) + RECORD_HEADER_SIZE * count
        segment = self._writer.segment
        try:
            positions = self._writer.write(payloads, size, want_positions)
        except OSError as exc:
            raise self._write_failed(exc) from exc
        if self._writer.segment != segment:
            self._request_checkpoint()
        self._depth += count
        self._put_count += count
        self._bytes_written += size
        if not self._metadata_dirty:
            self._dirtied()
        self._count_op(count)
        return positions

    def _raise_size_error(self, payloads: Sequence[bytes]) -> None:
        for index, payload in enumerate(payloads):
            if not self._min_size <= len(payload) <= self._max_size:
                raise MessageSizeError(
                    f"disk queue {self.name!r}: payload {index} is {len(payload)} bytes, "
                    f"outside [{self._min_size}, {self._max_size}]; nothing of this batch was stored"
                )

    def _write_failed(self, exc: OSError) -> DiskQueueWriteError:
        error = DiskQueueWriteError.from_os_error(
            exc, f"disk queue {self.name!r}: cannot write to {self._files.directory}")
        if self.failing is None:
            self._log.error("diskq_write_failed", error=str(error), errno=error.errno)
        self.failing = self._last_error = str(error)
        return error

    def _count_op(self, count: int) -> None:
        self._ops_since_checkpoint += count
        if self._ops_since_checkpoint >= self._sync_every:
            self._request_checkpoint()

    # -- reading -----------------------------------------------------------

    def read_many(self, max_count: int) -> list[bytes]:
        """Remove and return up to ``max_count`` records, oldest first; [] if none."""
        return self._read(max_count, None)

    def read_positioned(self, max_count: int,
                        max_bytes: float = math.inf) -> tuple[list[bytes], list[int] | tuple[int, ...]]:
        """:meth:`read_many`, with each record's position; stops once the records add up to
        ``max_bytes`` (past it by at most one scan window, or one record if bigger).

        The positions are a list when the records are neighbours on disk (an
        interval from the first to the last holds them and nothing else), a
        tuple when they may not be: read back after a restart, with the
        records finished before it (and whole released segments) left out.
        """
        positions: list[int] = []
        scattered = self._filter_until is not None or bool(self._reserved)
        records = self._read(max_count, positions, max_bytes)
        return records, tuple(positions) if scattered else positions

    def _read(self, max_count: int, positions: list[int] | None, max_bytes: float = math.inf) -> list[bytes]:
        self._check_open()
        if max_count <= 0:
            return []
        reader = self._reader
        segment = reader.segment
        while True:
            filtering = self._filter_until is not None or bool(self._reserved)
            found = positions if not filtering else (positions if positions is not None else [])
            first = len(found) if found is not None else 0
            try:
                records = reader.read_many(max_count, found, max_bytes)
            except OSError as exc:
                error = DiskQueueReadError.from_os_error(
                    exc, f"disk queue {self.name!r}: cannot read {self._files.segment_path(reader.segment)}")
                self._last_error = str(error)
                raise error from exc
            if filtering:
                read_any = bool(records)
                records = self._filter(records, found, first)
                if self._filter_until is not None and (reader.position >= self._filter_until or reader.caught_up):
                    missing = self._kept_unread
                    self._end_filter()
                    if missing:
                        self._kept_not_found(missing)
                if not records and read_any:
                    continue  # everything read was finished before the stop, or reserved: read on
            break
        if records:
            # never 0 with unread records past the read position (all of them count once the
            # records kept before a restart are read back): a depth that fell short would stop
            # readers, and a durable put would skip past those records
            unread = self._filter_until is None and not reader.caught_up
            self._depth = max(1 if unread else 0, self._depth - len(records))
            if not self._metadata_dirty:
                self._dirtied()
            self._count_op(len(records))
            self._read_since_checkpoint = True
        if reader.segment != segment:  # a segment was read through: it may be released
            self._request_checkpoint()
        if len(records) < max_count or reader.caught_up:  # read to the end (maybe with a full batch)
            self._reconcile_depth()
            end = self._writer.end
            if end >= SEAL_DRAINED:
                self.seal_if_drained(SEAL_DRAINED)
            elif end > SEGMENT_HEADER_SIZE and self._low_on_space():
                self.seal_if_drained(0)
        return records

    def _low_on_space(self) -> bool:
        """Whether the file system is nearly full; room found is trusted for a second, a lack of it
        is looked at again at the next read (a read that could not seal yet, while records kept
        before a restart were read back, kept the last one from looking, and the room never came back)."""
        now = time.monotonic()
        if now < self._space_checked_at + 1:
            return False
        try:
            stat = os.statvfs(self._files.directory)
        except OSError:
            return False
        low = stat.f_bavail * stat.f_frsize < LOW_SPACE
        if not low:
            self._space_checked_at = now
        return low

    def seal_if_drained(self, min_bytes: int = SEAL_DRAINED) -> bool:
        """Start a new segment if everything written was read and the current one holds ``min_bytes``.

        The read segment is then deleted at the checkpoint after its last
        records are released (a drained queue otherwise keeps its current
        segment until that fills). The daemon asks every queue, whatever
        its size, while the disk is full.
        """
        writer, reader = self._writer, self._reader
        if (self._closed or self._depth or self._filter_until is not None
                or writer.end <= SEGMENT_HEADER_SIZE or writer.end < min_bytes or not reader.caught_up):
            return False
        writer.seal()
        reader.jump(writer.segment, SEGMENT_HEADER_SIZE)
        self._request_checkpoint()
        return True

    def _filter(self, records: list[bytes], found: list[int], first: int) -> list[bytes]:
        """Drop the records finished before the last stop (not kept) or reserved, and their positions."""
        until = self._filter_until if self._filter_until is not None else -1
        firsts, lasts = self._filter_firsts, self._filter_lasts
        reserved = self._reserved
        kept_records: list[bytes] = []
        kept_positions: list[int] = []
        for record, pos in zip(records, found[first:]):
            if pos in reserved:
                reserved.discard(pos)
                continue
            if pos >= until:
                kept_records.append(record)
                kept_positions.append(pos)
                continue
            index = bisect.bisect_right(firsts, pos) - 1
            if index >= 0 and pos <= lasts[index]:
                kept_records.append(record)
                kept_positions.append(pos)
                self._kept_unread = max(self._kept_unread - 1, 0)
        del found[first:]
        found += kept_positions
        return kept_records

    def _kept_not_found(self, missing: int) -> None:
        """The records kept before the last stop were read back, and ``missing`` of those the saved
        count promised were not there (damaged, or listed twice by the keeper): the depth counted
        them, so it drops them now rather than when the reader reaches the end of the data."""
        self._log.warning("diskq_kept_records_not_found", records=missing)
        self._depth = max(self._depth - missing, 0 if self._reader.caught_up else 1)

    def _end_filter(self) -> None:
        self._filter_until = None
        self._filter_firsts = self._filter_lasts = []
        self._kept_unread = 0

    def _reconcile_depth(self) -> None:
        """At the end of the data the depth is zero; a difference means records were lost to damage."""
        if self._depth and self._reader.caught_up:
            self._log.warning("diskq_depth_reconciled", counted=self._depth, actual=0)
            self._depth = 0

    @property
    def depth(self) -> int:
        """Records stored and not yet read."""
        return self._depth

    @property
    def depth_bytes(self) -> int:
        """Bytes of unread records, headers included (for byte limits)."""
        return self._bytes_from(self._reader.segment, self._reader.offset)

    @property
    def retained_bytes(self) -> int:
        """Bytes on disk from the release point on: what the disk budget counts."""
        segment, offset = split_position(min(self._release, self._reader.position))
        return self._bytes_from(segment, offset)

    def _bytes_from(self, first_segment: int, first_offset: int) -> int:
        writer = self._writer
        total = 0
        holes = self._holes
        for segment in range(first_segment, writer.segment + 1):
            if segment in holes:
                continue
            end = writer.end if segment == writer.segment else self._segment_end(segment)
            start = first_offset if segment == first_segment else SEGMENT_HEADER_SIZE
            total += max(end - start, 0)
        return total

    def _segment_end(self, segment: int) -> int:
        """Size of a sealed segment (cached: it no longer grows)."""
        size = self._segment_sizes.get(segment)
        if size is None:
            try:
                size = os.path.getsize(self._files.segment_path(segment))
            except OSError:
                return 0
            self._segment_sizes[segment] = size
            if len(self._segment_sizes) > 1024:
                for old in [s for s in self._segment_sizes if s < self._oldest_segment]:
                    del self._segment_sizes[old]
        return size

    # -- durability ---------------------------------------------------------

    async def wait_durable(self) -> None:
        """Return once every record put before this call is on stable storage.

        Needs :meth:`run` to be running, or scheduled (:meth:`run_scheduled`);
        raises DiskQueueWriteError if the commit that should have covered
        these records failed.
        """
        commit = self._join_next_commit("wait_durable")
        if commit is None:
            return
        await commit.wait()
        if commit.error is not None:
            raise _copy_for_waiter(commit.error)

    async def settle_confirmations(self) -> None:
        """Return once the commit rounds that publishes wait on now have answered them.

        Forces no round (a round starts only for a waiter): a stopping daemon
        lets the confirmations under way go out before connections close.
        """
        while (commit := self._unsettled_round()) is not None:
            await commit.wait()

    def _unsettled_round(self) -> _CommitRound | None:
        for commit in (self._committing, self._synced_round, self._next_round):
            if commit is not None and not commit.finished and (commit.waiters or commit is not self._next_round):
                return commit
        return None

    def on_durable(self, callback: Callable[[DiskQueueError | None], None]) -> None:
        """Call ``callback`` once every record put before this call is on stable storage.

        The callback-style :meth:`wait_durable`, for a waiter that is not a
        task (a connection answering from its readiness callback): it runs
        in the :meth:`run` task as the commit round settles, with the
        round's error or None, and at once if nothing waits to be synced.
        It must not raise. Raises DiskQueueError as :meth:`wait_durable` does.
        """
        commit = self._join_next_commit("on_durable")
        if commit is None:
            callback(None)
        else:
            commit.add_callback(callback)

    def _join_next_commit(self, caller: str) -> _CommitRound | None:
        """The round that will make every record put so far durable; None if they are already."""
        if self._durable_count >= self._put_count:
            return None
        self._check_open()
        if not (self._running or self._run_scheduled):
            raise DiskQueueError(f"disk queue {self.name!r}: {caller}() needs run() to be running")
        commit = self._next_round
        if not commit.waiters:
            self._wake()
        commit.waiters += 1
        return commit

    def run_scheduled(self) -> None:
        """:meth:`run` was started (``start_soon``) and begins at the next checkpoint.

        Until then :meth:`wait_durable` joins the next commit round, which
        run() takes on as it begins (close() releases it too): the publish
        that creates a queue is confirmed like any other.
        """
        self._run_scheduled = True

    def kept_changed(self, finished: int = 0) -> None:
        """The keeper's view changed (a message finished or given back): the next periodic checkpoint saves it.

        Without this a FIN after a quiet period was never checkpointed, so a
        crash delivered it again however long ago it was finished.
        ``finished``: records the keeper let go that were never read back
        (write-through), counted as reads towards ``sync_every``.
        """
        if not self._metadata_dirty:
            self._dirtied()
        if finished:
            self._count_op(finished)

    def _dirtied(self) -> None:
        """The queue has something for a checkpoint: wake run(), which sleeps without a deadline while clean.

        A clean queue never wakes on its own, so thousands of idle topics and
        channels cost no CPU (each woke every ``sync_timeout`` before).
        """
        self._metadata_dirty = True
        self._wake()

    def _wake(self) -> None:
        self._woken = True
        self._wakeup.unpark_all()

    def request_checkpoint(self) -> None:
        """Save the keeper's view soon (the owner finished many records)."""
        self._metadata_dirty = True
        self._request_checkpoint()

    def checkpoint_if_read(self) -> None:
        """Save a checkpoint soon if records were read since the last one."""
        if self._read_since_checkpoint:
            self.request_checkpoint()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Group commits and periodic checkpoints, until cancelled or closed."""
        self._check_open()
        if self._running:
            raise DiskQueueError(f"disk queue {self.name!r}: run() is already running")
        self._running = True
        self._last_checkpoint = trio.current_time()
        try:
            task_status.started()
            while not self._closed:
                settle = False
                if self._next_round.waiters:
                    # they joined while the last round synced: start theirs now, not after a scheduler
                    # pass (a pass of busy publishers would be added to every confirmation's wait)
                    await trio.lowlevel.checkpoint_if_cancelled()
                else:
                    if not self._woken:
                        if self._dirty():
                            with trio.move_on_at(self._last_checkpoint + self._sync_timeout):
                                await self._wakeup.park()
                        elif self._checkpoint_file.unsynced_fd() is not None and not self._settle_failed:
                            settle = True  # a round syncs the checkpoint saved last before the queue rests
                        else:  # clean: nothing is due until something changes
                            self._rest()
                            await self._wakeup.park()
                    self._woken = False
                    if self._closed:
                        break
                overdue = trio.current_time() >= self._last_checkpoint + self._sync_timeout
                checkpoint = self._checkpoint_due or (overdue and self._dirty())
                if checkpoint or self._next_round.waiters or settle:
                    with trio.CancelScope(shield=True):
                        await self._commit(checkpoint)
                    # a failed sync is not tried again at once: the queue rests, and its next save
                    # goes to the same file again (the other one holds the last save synced)
                    self._settle_failed = settle and self._checkpoint_file.unsynced_fd() is not None
                    if not self._next_round.waiters:  # no next round to start first
                        self._release_synced()
                elif overdue:
                    self._last_checkpoint = trio.current_time()
        finally:
            self._release_synced()
            self._running = self._run_scheduled = False
            if self._ring is not None:  # nothing in flight: a commit returns once its syncs completed
                self._ring.close()
                self._ring = None
            if not self._closed:
                self._next_round.finish(DiskQueueError(f"disk queue {self.name!r}: run() stopped"))
                self._next_round = _CommitRound()

    def _dirty(self) -> bool:
        return self._metadata_dirty or self._durable_count < self._put_count

    def _request_checkpoint(self) -> None:
        if not self._checkpoint_due:
            self._checkpoint_due = True
            self._wake()

    async def _commit(self, checkpoint: bool) -> None:
        """One round: fsync in a thread if anything is unsynced, release the waiters, save a checkpoint."""
        commit, self._next_round = self._next_round, _CommitRound()
        self._committing = commit
        try:
            await self._commit_round(commit, checkpoint)
        finally:
            self._committing = None

    async def _commit_round(self, commit: _CommitRound, checkpoint: bool) -> None:
        target = self._put_count
        if checkpoint:  # on failure too: the next try waits for the timeout, no busy retry
            self._checkpoint_due = False
            self._last_checkpoint = trio.current_time()
        plan = self._plan(checkpoint)
        if plan.fds or plan.sync_directory:
            await self._sync(plan, commit, target)
            if commit.error is not None:
                return
            if plan.checkpoint_fd is not None and plan.generation == self._gate.generation:
                self._checkpoint_file.synced(plan.checkpoint_fd)
        else:
            self._settle(plan, commit, target, None)
        if plan.metadata is not None:
            self._release_synced()
            await self._checkpoint(plan)

    def _release_synced(self) -> None:
        """Answer the waiters of the round that synced last.

        Called right after the next round's sync was submitted (or when there
        is none to start), and before any await: answering a round's waiters
        (an ``OK`` written to each of dozens of connections) takes as long
        as the sync itself, and done first it kept the disk idle meanwhile.
        """
        commit, self._synced_round = self._synced_round, None
        if commit is not None:
            commit.finish(None)

    async def _sync(self, plan: sync.SyncPlan, commit: _CommitRound, target: int) -> None:
        """Sync the plan's descriptors, through io_uring where it works, and release the waiters.

        A new segment's directory entry, and a round io_uring does not take,
        are synced in a worker thread.
        """
        ring = None if plan.sync_directory else self._commit_ring()
        if ring is not None:
            try:
                ring.submit(plan.fds, plan.generation)
            except OSError as exc:  # nothing is in flight: worker threads from now on
                self._log.warning("diskq_uring_refused", error=str(exc))
                self._ring, self._ring_refused = None, True
                ring.close()
            else:
                self._release_synced()
                error = None
                while ring.in_flight:
                    await trio.lowlevel.wait_readable(ring.fileno)
                    for _, result in ring.reap():
                        if result < 0 and error is None:
                            error = OSError(-result, os.strerror(-result))
                self._settle(plan, commit, target, error)
                return
        await self._sync_in_thread(plan, commit, target)

    def _commit_ring(self) -> uring.SyncRing | None:
        """The queue's io_uring, opened at its first use; None where io_uring cannot be used."""
        if self._ring is None and not self._ring_refused:
            self._ring = uring.open_ring()
            self._ring_refused = self._ring is None
        return self._ring

    async def _sync_in_thread(self, plan: sync.SyncPlan, commit: _CommitRound, target: int) -> None:
        """Run the plan in a worker thread; the waiters are released the moment it returns.

        Unlike ``trio.to_thread.run_sync`` this starts the thread without
        yielding first and settles the round in the callback that reports
        back, not in this task after another scheduler pass: while other
        publishers' batches keep the event loop busy, each of those passes
        would add a batch's time to every confirmation.
        """
        limiter = trio.to_thread.current_default_thread_limiter()
        token = object()
        try:
            limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            self._release_synced()
            await limiter.acquire_on_behalf_of(token)
        settled = trio.Event()
        unexpected: list[BaseException] = []
        trio_token = trio.lowlevel.current_trio_token()

        def report(result: outcome.Outcome[None]) -> None:  # in the Trio thread
            limiter.release_on_behalf_of(token)
            try:
                result.unwrap()
            except OSError as exc:
                self._settle(plan, commit, target, exc)
            except BaseException as exc:  # a bug: raised in this task below, not in the run loop
                unexpected.append(exc)
                commit.finish(DiskQueueError(f"disk queue {self.name!r}: sync failed: {exc!r}"))
            else:
                self._settle(plan, commit, target, None)
                self._release_synced()
            settled.set()

        def deliver(result: outcome.Outcome[None]) -> None:  # in the worker thread
            trio_token.run_sync_soon(report, result)

        # Unnamed: naming the thread for the job and back costs two prctl calls a
        # round, and each returns through the GIL that the event loop holds.
        trio.lowlevel.start_thread_soon(functools.partial(sync.execute, plan, self._files, self._gate), deliver)
        self._release_synced()
        await settled.wait()
        if unexpected:
            raise unexpected[0]

    def _settle(self, plan: sync.SyncPlan, commit: _CommitRound, target: int, error: OSError | None) -> None:
        """Account for a round's sync and release its waiters.

        If the queue was closed or emptied while the round synced, the
        round's error does not count: close() synced everything itself, and
        emptying dropped the records (and either may have closed a
        descriptor before the kernel's sync of it ran).
        """
        self._release_synced()  # the rounds' waiters are answered in order
        if error is not None and plan.generation == self._gate.generation:
            self._writer.directory_changed |= plan.sync_directory
            if plan.metadata is not None:
                self._metadata_dirty = True
            commit.finish(self._write_failed(error))
            return
        if plan.fds or plan.sync_directory:
            if plan.generation == self._gate.generation:
                self._writer.close_retired(plan.retired)
            self._syncs += 1
            if self.failing is not None:
                self._log.info("diskq_write_recovered", after=self.failing)
                self.failing = None
        self._durable_count = max(self._durable_count, target)
        self._synced_round = commit  # answered by _release_synced, once the next round is under way

    async def _checkpoint(self, plan: sync.SyncPlan) -> None:
        """Save the plan's metadata to the checkpoint file, then remove the segments it released.

        The save is a ``pwrite`` in this thread; only unlinking (slow for a
        large file) goes to a worker thread. On a full disk the released
        segments go first, to make room for the save.
        """
        meta = plan.metadata
        assert meta is not None
        error = self._save_checkpoint(plan)
        if error is not None and error.errno in (errno.ENOSPC, errno.EDQUOT) and plan.consumed:
            await trio.to_thread.run_sync(sync.release, plan, self._files, self._gate)
            plan.consumed = []
            error = self._save_checkpoint(plan)
        if error is not None:
            self._metadata_dirty = True
            self.failing = self._last_error = f"disk queue {self.name!r}: cannot save metadata: {error}"
            self._failing_save = True
            self._log.error("diskq_metadata_save_failed", error=str(error))
            return
        if self._failing_save:
            if self.failing is not None:  # (a sync since may have said so already)
                self._log.info("diskq_write_recovered", after=self.failing)
                self.failing = None
            self._failing_save = False
        if plan.consumed:
            await trio.to_thread.run_sync(sync.release, plan, self._files, self._gate)
        if plan.generation == self._gate.generation:
            self._oldest_segment = oldest = max(self._oldest_segment, min(meta.release[0], self._writer.segment))
            holes = self._holes
            holes.update(segment for segment in plan.consumed if segment > oldest)
            if holes and min(holes) < oldest:
                holes.difference_update([segment for segment in holes if segment < oldest])

    def _save_checkpoint(self, plan: sync.SyncPlan) -> OSError | None:
        if self._closed or plan.generation != self._gate.generation:
            return None  # emptied or closed meanwhile: that saved the metadata itself
        self._on_disk = None  # (the checkpoint file is newer from now on)
        try:
            self._checkpoint_file.save(plan.metadata)
        except OSError as exc:
            return exc
        return None

    def _plan(self, checkpoint: bool) -> sync.SyncPlan:
        writer = self._writer
        unsynced = self._put_count > self._durable_count
        plan = sync.SyncPlan(
            generation=self._gate.generation,
            fds=writer.unsynced_fds() if unsynced else list(writer.retired),
            retired=list(writer.retired),
            sync_directory=writer.directory_changed,
        )
        writer.directory_changed = False
        # the checkpoint saved last, made durable with the data (saves never go over the newest
        # synced one, see CheckpointFile)
        plan.checkpoint_fd = self._checkpoint_file.unsynced_fd()
        if plan.checkpoint_fd is not None:
            plan.fds.append(plan.checkpoint_fd)
        if checkpoint:
            self._metadata_dirty = False  # (before the snapshot: its keeper may want another one later)
            meta = plan.metadata = self._snapshot()
            release_segment = meta.release[0]
            plan.consumed = list(range(self._oldest_segment, min(release_segment, writer.segment)))
            reader = self._reader.segment  # (still reading what was kept before a stop: not its own)
            if meta.read_segment > release_segment + 1:
                # one message held long (a REQ retried for hours) must not hold every segment after it
                holes = _uncovered(meta.kept, release_segment + 1, min(meta.read_segment, writer.segment))
                plan.consumed += [segment for segment in holes if segment not in self._holes and segment != reader]
            self._ops_since_checkpoint = 0
            self._read_since_checkpoint = False
        return plan

    def _snapshot(self) -> Metadata:
        """Positions, depth and the keeper's kept records, as of now."""
        reader, writer = self._reader, self._writer
        read_at = reader.position
        depth = self._depth
        kept: list[Kept] = []
        kept_count = 0
        if self.keeper is not None:
            kept, kept_count = self.keeper()
        if self._filter_until is not None:  # still reading what was kept before the last stop
            read_at = self._filter_until
            depth -= self._kept_unread
            kept_count += self._kept_unread
            here = reader.position
            kept = kept + [(max(f, here), l, None) for f, l in zip(self._filter_firsts, self._filter_lasts)
                           if l >= here]
            # the owner's notes on the kept records not read again yet (not its reserved ones: it
            # took those back itself and notes them anew), or a second stop would lose them
            kept += [(max(f, here), l, note) for f, l, note in self.recovered_kept
                     if l >= here and (self.keeper is None or not _reserved_note(note))]
        if self._reserved:
            kept = kept + [(pos, pos, RESERVED_NOTE) for pos in self._reserved]
            # the saved depth counts them, as a recount from the read position would: the open
            # takes those ahead of the read position off again (a depth without them lost the
            # queued records behind them when they outnumbered those: a depth of 0 reads nothing)
            depth += sum(1 for pos in self._reserved if pos >= read_at)
        release = min([read_at, *(k[0] for k in kept)]) if kept else read_at
        if release > reader.position and self._filter_until is not None:
            release = reader.position
        self._release = release
        read_segment, read_offset = split_position(read_at)
        release_segment, release_offset = split_position(release)
        same = release == read_at
        return Metadata(
            read_segment=read_segment,
            read_position=read_offset,
            write_segment=writer.segment,
            write_position=writer.end,
            depth=max(depth, 0),
            release_segment=-1 if same else release_segment,
            release_position=0 if same else release_offset,
            kept=tuple(kept),
            kept_count=kept_count if not same else 0,
            sequence=self._next_sequence(),
        )

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    def _save_metadata_now(self, on_disk: Metadata | None = None) -> None:
        """Save the metadata file durably and remove the checkpoint file; nothing is written when
        ``on_disk``, the metadata file's document, says the same already (an open after an orderly
        stop, and the close of a queue nothing changed since: two fsyncs a queue were most of a
        restart's time)."""
        meta = self._snapshot()
        self._on_disk = on_disk
        if self._on_disk_already(meta):
            return
        self._on_disk = None
        try:
            save_metadata(self._files.metadata_path, meta)
            self._checkpoint_file.remove()
            self._on_disk = meta
        except OSError as exc:
            self._metadata_dirty = True
            self._last_error = f"disk queue {self.name!r}: cannot save metadata: {exc}"
            self._log.error("diskq_metadata_save_failed", error=str(exc))

    def _on_disk_already(self, meta: Metadata) -> bool:
        """Whether the metadata file, with no checkpoint file beside it, says ``meta`` already."""
        return self._on_disk is not None and dataclasses.replace(self._on_disk, sequence=meta.sequence) == meta

    # -- lifecycle -----------------------------------------------------------

    def empty(self) -> None:
        """Drop every record and segment file; the queue stays open."""
        self._check_open()
        with self._gate.lock:
            self._gate.generation += 1
            fresh = self._writer.segment + 1
            self._writer.reset(fresh)
            self._reader.reset(fresh)
            self._end_filter()
            self._holes.clear()
            self._reserved.clear()
            doomed = self._files.list_segments()
            self._discard_segments(doomed)
            self._depth = 0
            self._oldest_segment = fresh
            self._release = self._reader.position
            self._save_metadata_now()
        self._log.info("diskq_emptied", removed_segments=len(doomed))
        self._durable_count = self._put_count
        self._release_waiters(None)

    def skip_unread(self) -> None:
        """Drop every unread record, keeping the read ones the keeper still holds (:meth:`empty`
        drops those too); they go at the checkpoints after it lets them go."""
        self._check_open()
        self._end_filter()
        self._reader.skip_to_end()
        self._depth = 0
        self._request_checkpoint()

    def close(self) -> None:
        """Fsync everything, save the metadata (with the keeper's view), release the files.

        Blocks; meant for shutdown. Raises DiskQueueWriteError if the data
        or the metadata could not be made durable.
        """
        if self._closed:
            return
        self.closed_files(self.close_files())

    def close_files(self) -> DiskQueueWriteError | None:
        """The blocking half of :meth:`close`: fsync, save the metadata, release the files; returns
        the error. It touches nothing of Trio's, so once nothing else uses the queue (its run()
        ended, nothing writes) it may run in a worker thread, many queues at once: a shutdown
        with thousands of queues then pays for their fsyncs together, not one after another.
        :meth:`closed_files` must follow, in the Trio thread."""
        error: DiskQueueWriteError | None = None
        with self._gate.lock:
            self._gate.generation += 1
            try:
                for fd in self._writer.unsynced_fds():
                    os.fdatasync(fd)
                meta = self._snapshot()
                released = list(range(self._oldest_segment, min(meta.release[0], self._writer.segment)))
                if released or not self._on_disk_already(meta):
                    save_error = sync.save_and_release(self._files, meta, released)
                    if save_error is not None:
                        raise save_error
                    self._checkpoint_file.remove()
            except OSError as exc:
                error = self._write_failed(exc)
            finally:
                self._release_files()
        return error

    def _stage_close(self) -> tuple[Metadata, list[int], Path | None]:
        """:meth:`close_files` for many queues at once, first step (see :func:`close_many`): the
        metadata written to its temporary file, unsynced, unless the metadata file says it already
        (None). Returns it with the segments it releases. Raises OSError (nothing is changed)."""
        meta = self._snapshot()
        released = list(range(self._oldest_segment, min(meta.release[0], self._writer.segment)))
        if not released and self._on_disk_already(meta):
            return meta, released, None
        return meta, released, stage_metadata(self._files.metadata_path, meta, fsync=False)

    def _closed_staged(self, meta: Metadata, released: list[int]) -> None:
        """The last step of a group close, once the staged metadata is durable in its place."""
        with self._gate.lock:
            self._gate.generation += 1
            self._on_disk = meta
            sync.unlink_segments(self._files, released)
            self._release_files()

    def _release_files(self) -> None:
        self._checkpoint_file.close()
        self._writer.close()
        self._reader.close()
        self._unlock()
        self._closed = True

    def closed_files(self, error: DiskQueueWriteError | None) -> None:
        """The Trio half of :meth:`close`: wake run() to end, answer the waiters; raises ``error``."""
        self._wake()
        if error is None:
            self._durable_count = self._put_count
        self._log.info("diskq_closed", depth=self._depth)
        self._release_waiters(error)
        if error is not None:
            raise error

    def delete(self) -> None:
        """Close without writing and remove every file of this queue."""
        with self._gate.lock:
            self._gate.generation += 1
            if self._closed:  # closed earlier: hold the lock again while removing
                self._lock()
            self._shut()
            # the segments it may have: no listing of the data path (36 ms at 28,000 files, three
            # times for a topic with two channels, in the event loop); older ones were released
            self._discard_segments(range(self._oldest_segment, self._writer.segment + 1))
            metadata = self._files.metadata_path
            for path in (metadata, metadata.with_name(metadata.name + ".tmp"), *self._files.checkpoint_paths,
                         self._files.lock_path):
                _unlink_if_present(path)
        self._log.info("diskq_deleted")
        self.keeper = None  # it points back at the owner: a cycle would hold both until a full collection
        self._release_waiters(DiskQueueError(f"disk queue {self.name!r} was deleted"))

    def _discard_segments(self, segments: Iterable[int]) -> None:
        """Remove these segments from the queue: renamed into the trash bin, or unlinked here."""
        trashed = []
        for segment in segments:
            path = self._files.segment_path(segment)
            if self._trash is not None:
                try:
                    os.replace(path, trash := self._files.trash_path(segment))
                except FileNotFoundError:
                    continue
                except OSError:  # not renamed: gone the slow way
                    pass
                else:
                    trashed.append(trash)
                    continue
            _unlink_if_present(path)
        if trashed:
            self._trash.discard(trashed)

    def _shut(self) -> None:
        self._release_files()
        self._wake()

    def _lock(self) -> None:
        if not self._lock_file:
            return
        try:
            self._lock_fd = acquire_queue_lock(self._files.lock_path, self.name)
        except OSError as exc:
            raise DiskQueueError(f"disk queue {self.name!r}: cannot open in {self._files.directory}: {exc}") from exc

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _rest(self) -> None:
        """Nothing is due until something changes: give back the descriptors kept open for work.

        A daemon may hold thousands of idle topics and channels; each kept its
        checkpoint file, its segments and its io_uring open, so a client that
        made topics could run the process out of descriptors. Each is opened
        again at its next use.
        """
        with self._gate.lock:  # no round is in flight (run() is parking), but keep to the rule
            self._gate.generation += 1
            self._checkpoint_file.close()
            if not self._writer.retired:
                self._writer.close()
            self._reader.close()
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def _release_waiters(self, error: DiskQueueError | None) -> None:
        self._release_synced()
        self._next_round.finish(error)
        self._next_round = _CommitRound()

    def _check_open(self) -> None:
        if self._closed:
            raise DiskQueueError(f"disk queue {self.name!r} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> DiskQueueStatistics:
        damaged_records, damaged_bytes = self._recovered_damage
        reader, writer = self._reader, self._writer
        return DiskQueueStatistics(
            depth=self._depth,
            bytes_written=self._bytes_written,
            bytes_read=reader.bytes_read,
            segments=writer.segment - reader.segment + (1 if writer.end else 0),
            corrupt_records_skipped=damaged_records + reader.damaged_records,
            bytes_skipped=damaged_bytes + reader.damaged_bytes,
            syncs=self._syncs,
            last_error=self._last_error,
        )


#: the note on a kept record the owner takes back itself: the queue never reads it back
RESERVED_NOTE = {"r": 1}


def _reserved_note(note: object) -> bool:
    return isinstance(note, dict) and bool(note.get("r"))


def _union(kept) -> tuple[list[int], list[int]]:
    """Kept intervals merged into sorted, disjoint ones (firsts, lasts) for lookups."""
    firsts: list[int] = []
    lasts: list[int] = []
    for first, last, _ in sorted(kept, key=lambda k: k[0]):
        if lasts and first <= lasts[-1]:
            lasts[-1] = max(lasts[-1], last)
        else:
            firsts.append(first)
            lasts.append(last)
    return firsts, lasts


def _uncovered(kept: Iterable[Kept], low: int, high: int) -> list[int]:
    """The segments in [low, high) that no kept interval touches."""
    if low >= high:
        return []
    covered = set()
    for first, last, _ in kept:
        first_segment, last_segment = first >> OFFSET_BITS, last >> OFFSET_BITS
        if last_segment >= low and first_segment < high:
            covered.update(range(max(first_segment, low), min(last_segment, high - 1) + 1))
    return [segment for segment in range(low, high) if segment not in covered]


def _copy_for_waiter(error: DiskQueueError) -> DiskQueueError:
    """Each waiter raises its own exception object, so tracebacks do not pile up on a shared one."""
    if isinstance(error, DiskQueueWriteError):
        return DiskQueueWriteError(error.errno, str(error))
    return DiskQueueError(str(error))


def _unlink_if_present(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def close_many(queues: Sequence[DiskQueue]) -> list[DiskQueueWriteError | None]:
    """``close_files()`` for many queues of one data path at once; returns each one's error.

    A queue closed alone fsyncs its data, its metadata's temporary file and
    the directory: at shutdown, thousands of queues one after another took
    many seconds. Here every metadata file is staged unsynced, then one
    ``syncfs`` makes all the data and the staged files durable, the renames
    follow, then one fsync of the directory, and only then are released
    segments removed: the same order, so a crash at any point loses nothing.
    A queue that cannot be staged (a full disk), or all of them if a sync
    fails, are closed on their own, with their own fallbacks and errors.
    Blocking, for a worker thread; nothing else may use the queues meanwhile
    (their run() ended). Each then needs ``closed_files()`` in the Trio thread.
    """
    errors: list[DiskQueueWriteError | None] = [None] * len(queues)
    staged = []
    for index, queue in enumerate(queues):
        try:
            staged.append((index, queue, *queue._stage_close()))
        except OSError:
            errors[index] = queue.close_files()
    if not staged:
        return errors
    directory = staged[0][1]._files.directory
    try:
        sync.sync_filesystem(directory)
    except OSError:
        for index, queue, *_ in staged:
            errors[index] = queue.close_files()
        return errors
    synced = []
    for entry in staged:
        index, queue, _, _, temporary = entry
        try:  # the data is clean by now; syncfs may not report a file's own write-back error, this does
            for fd in queue._writer.unsynced_fds():
                os.fdatasync(fd)
        except OSError as exc:  # (reported once per descriptor: its close_files would not see it)
            errors[index] = queue._write_failed(exc)
            if temporary is not None:
                _unlink_if_present(temporary)
            queue._release_files()
            continue
        synced.append(entry)
    try:
        for _, queue, _, _, temporary in synced:
            if temporary is not None:
                os.replace(temporary, queue._files.metadata_path)
                queue._checkpoint_file.remove()
        fsync_directory(directory)
    except OSError:
        for index, queue, *_ in synced:
            errors[index] = queue.close_files()
        return errors
    for _, queue, meta, released, _ in synced:
        queue._closed_staged(meta, released)
    return errors

