"""The disk queue: a crash-safe FIFO of opaque records in segment files.

Puts encode into a bounded memory buffer and never wait for the disk; the
:meth:`DiskQueue.run` task makes data durable in a worker thread, either
because a caller waits for it (group commit: one fsync serves every waiter
of a round) or because ``sync_every`` puts or ``sync_timeout`` seconds have
passed (a checkpoint, which also saves the metadata).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import structlog
import trio

from . import sync
from .errors import DiskQueueError, DiskQueueReadError, DiskQueueWriteError, MessageSizeError
from .lock import acquire_queue_lock
from .metadata import Metadata, save_metadata
from .naming import QueueFiles, fsync_directory
from .reader import SegmentReader
from .records import MAX_RECORD_LENGTH, RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE
from .recovery import recover
from .stats import DiskQueueStatistics
from .writer import SegmentWriter

logger = structlog.get_logger("nsqd.diskq")

FLUSH_THRESHOLD = 256 * 1024
"""Buffered bytes that trigger a write to the segment file."""

BUFFER_LIMIT = 4 * 1024 * 1024
"""Buffered bytes beyond which a put fails if the buffer cannot be written."""


class _CommitRound:
    """The waiters one fsync will release."""

    __slots__ = ("done", "error", "waiters")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: DiskQueueError | None = None
        self.waiters = 0

    def finish(self, error: DiskQueueError | None) -> None:
        self.error = error
        self.done.set()


class DiskQueue:
    """A named FIFO queue of byte payloads stored under ``data_path``.

    Every method is called from the Trio thread; only fsync work runs in
    worker threads, started by :meth:`run`.
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
    ) -> None:
        if not 0 <= min_msg_size <= max_msg_size <= MAX_RECORD_LENGTH:
            raise ValueError(
                f"need 0 <= min_msg_size <= max_msg_size <= {MAX_RECORD_LENGTH}, "
                f"got {min_msg_size} and {max_msg_size}"
            )
        if max_bytes_per_file <= SEGMENT_HEADER_SIZE + RECORD_HEADER_SIZE:
            raise ValueError(f"max_bytes_per_file must exceed {SEGMENT_HEADER_SIZE + RECORD_HEADER_SIZE}")
        if sync_every < 1 or sync_timeout <= 0:
            raise ValueError("sync_every must be at least 1 and sync_timeout positive")
        self.name = name
        self._min_size = min_msg_size
        self._max_size = max_msg_size
        self._sync_every = sync_every
        self._sync_timeout = sync_timeout
        self._files = QueueFiles(data_path, name)
        self._log = logger.bind(queue=name)
        try:
            self._lock_fd = acquire_queue_lock(self._files.lock_path, name)
        except OSError as exc:
            raise DiskQueueError(f"disk queue {name!r}: cannot open in {data_path}: {exc}") from exc
        try:
            state = recover(self._files, min_msg_size, max_msg_size, self._log)
        except OSError as exc:
            os.close(self._lock_fd)
            raise DiskQueueError(f"disk queue {name!r}: cannot recover its files in {data_path}: {exc}") from exc
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._writer = SegmentWriter(self._files, state.write_segment, state.write_position, max_bytes_per_file)
        self._reader = SegmentReader(
            self._files,
            self._writer,
            state.read_segment,
            state.read_position,
            min_msg_size,
            max_msg_size,
            self._log,
        )
        self._depth = state.depth
        self._segment_sizes: dict[int, int] = {}
        self._recovered_damage = (state.damaged_records, state.damaged_bytes)
        self._put_count = 0
        self._durable_count = 0
        self._bytes_written = 0
        self._syncs = 0
        self._puts_since_checkpoint = 0
        self._checkpoint_due = False
        self._metadata_dirty = False
        self._last_checkpoint = float("-inf")
        self._write_error: DiskQueueWriteError | None = None
        self._last_error: str | None = None
        self._gate = sync.SyncGate()
        self._wakeup = trio.Event()
        self._next_round = _CommitRound()
        self._running = False
        self._closed = False
        self._reconcile_depth()
        self._save_metadata_now()
        self._log.info(
            "diskq_opened",
            depth=self._depth,
            read=(state.read_segment, state.read_position),
            write=(state.write_segment, state.write_position),
        )

    # -- writing -----------------------------------------------------------

    def put(self, payload: bytes) -> None:
        """Append one record; see :meth:`put_many`."""
        size = len(payload)
        if size < self._min_size or size > self._max_size:
            self._check_open()
            self._raise_size_error((payload,))
        self._append((payload,), 1, size + RECORD_HEADER_SIZE)

    def put_many(self, payloads: Sequence[bytes]) -> None:
        """Append a batch in order; all or none of it is accepted.

        Raises MessageSizeError if any payload is outside the size limits and
        DiskQueueWriteError if the buffer is full and cannot be written.
        """
        count = len(payloads)
        if not count:
            self._check_open()
            return
        if min(map(len, payloads)) < self._min_size or max(map(len, payloads)) > self._max_size:
            self._check_open()
            self._raise_size_error(payloads)
        self._append(payloads, count, sum(map(len, payloads)) + RECORD_HEADER_SIZE * count)

    def _append(self, payloads: Sequence[bytes], count: int, size: int) -> None:
        if self._closed:
            raise DiskQueueError(f"disk queue {self.name!r} is closed")
        writer = self._writer
        if writer.buffered and writer.buffered + size > BUFFER_LIMIT:
            try:
                writer.flush()
            except OSError as exc:
                raise self._write_failed(exc) from exc
            self._clear_write_error()
        if writer.append(payloads, size):
            self._request_checkpoint()
        self._depth += count
        self._put_count += count
        self._bytes_written += size
        self._metadata_dirty = True
        self._puts_since_checkpoint += count
        if self._puts_since_checkpoint >= self._sync_every:
            self._request_checkpoint()
        if writer.buffered >= FLUSH_THRESHOLD:
            self._try_flush()

    def _raise_size_error(self, payloads: Sequence[bytes]) -> None:
        for index, payload in enumerate(payloads):
            if not self._min_size <= len(payload) <= self._max_size:
                raise MessageSizeError(
                    f"disk queue {self.name!r}: payload {index} is {len(payload)} bytes, "
                    f"outside [{self._min_size}, {self._max_size}]; nothing of this batch was stored"
                )

    def _try_flush(self) -> None:
        """Write the buffer; a failure is remembered, the data stays buffered."""
        try:
            self._writer.flush()
        except OSError as exc:
            self._write_failed(exc)
        else:
            self._clear_write_error()

    def _write_failed(self, exc: OSError) -> DiskQueueWriteError:
        error = DiskQueueWriteError.from_os_error(
            exc,
            f"disk queue {self.name!r}: cannot write to {self._files.directory} "
            f"({self._writer.buffered} bytes kept in memory and retried; puts fail while the "
            f"buffer is over {BUFFER_LIMIT} bytes)",
        )
        if self._write_error is None or self._write_error.errno != error.errno:
            self._log.error("diskq_write_failed", error=str(error), errno=error.errno)
        self._write_error = error
        self._last_error = str(error)
        return error

    def _clear_write_error(self) -> None:
        if self._write_error is not None:
            self._log.info("diskq_write_recovered", after=str(self._write_error))
            self._write_error = None

    # -- reading -----------------------------------------------------------

    def read_many(self, max_count: int) -> list[bytes]:
        """Remove and return up to ``max_count`` records, oldest first; [] if none."""
        self._check_open()
        if max_count <= 0:
            return []
        reader = self._reader
        try:
            records = reader.read_many(max_count)
        except OSError as exc:
            error = DiskQueueReadError.from_os_error(
                exc, f"disk queue {self.name!r}: cannot read {self._files.segment_path(reader.segment)}"
            )
            self._last_error = str(error)
            raise error from exc
        if records:
            self._depth = max(0, self._depth - len(records))
            self._metadata_dirty = True
        if reader.consumed:
            self._request_checkpoint()
        if len(records) < max_count:
            self._reconcile_depth()
        return records

    def _reconcile_depth(self) -> None:
        """At the end of the data the depth is zero; a difference means records were lost to damage."""
        if self._depth and self._reader.caught_up:
            self._log.warning("diskq_depth_reconciled", counted=self._depth, actual=0)
            self._depth = 0

    @property
    def depth(self) -> int:
        """Records stored and not yet read."""
        return self._depth

    # -- durability ---------------------------------------------------------

    @property
    def depth_bytes(self) -> int:
        """Bytes of unread records, headers included, buffered ones too (for byte limits)."""
        reader, writer = self._reader, self._writer
        total = 0
        for segment in range(reader.segment, writer.segment + 1):
            end = writer.end if segment == writer.segment else self._segment_end(segment)
            start = reader.position if segment == reader.segment else SEGMENT_HEADER_SIZE
            total += max(end - start, 0)
        return total

    def _segment_end(self, segment: int) -> int:
        """Size of a finished segment: what is still buffered, else the file (cached: it no longer grows)."""
        extent = self._writer.extent(segment)
        if extent is not None:
            return extent.end
        size = self._segment_sizes.get(segment)
        if size is None:
            try:
                size = os.path.getsize(self._files.segment_path(segment))
            except OSError:
                return 0
            self._segment_sizes[segment] = size
            if len(self._segment_sizes) > 1024:
                for old in [s for s in self._segment_sizes if s < self._reader.segment]:
                    del self._segment_sizes[old]
        return size

    async def wait_durable(self) -> None:
        """Return once every record put before this call is on stable storage.

        Needs :meth:`run` to be running; raises DiskQueueWriteError if the
        commit that should have covered these records failed.
        """
        target = self._put_count
        if self._durable_count >= target:
            return
        self._check_open()
        if not self._running:
            raise DiskQueueError(f"disk queue {self.name!r}: wait_durable() needs run() to be running")
        commit = self._next_round
        if not commit.waiters:
            self._wakeup.set()
        commit.waiters += 1
        await commit.done.wait()
        if commit.error is not None:
            raise _copy_for_waiter(commit.error)

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
                with trio.move_on_at(self._last_checkpoint + self._sync_timeout):
                    await self._wakeup.wait()
                self._wakeup = trio.Event()
                if self._closed:
                    break
                overdue = trio.current_time() >= self._last_checkpoint + self._sync_timeout
                checkpoint = self._checkpoint_due or (overdue and self._dirty())
                if checkpoint or self._next_round.waiters:
                    with trio.CancelScope(shield=True):
                        await self._commit(checkpoint)
                elif overdue:
                    self._last_checkpoint = trio.current_time()
        finally:
            self._running = False
            if not self._closed:
                self._next_round.finish(DiskQueueError(f"disk queue {self.name!r}: run() stopped"))
                self._next_round = _CommitRound()

    def _dirty(self) -> bool:
        return self._metadata_dirty or self._durable_count < self._put_count or bool(self._writer.buffered)

    def _request_checkpoint(self) -> None:
        if not self._checkpoint_due:
            self._checkpoint_due = True
            self._wakeup.set()

    async def _commit(self, checkpoint: bool) -> None:
        """One round: write the buffer, fsync in a thread, release the waiters."""
        commit, self._next_round = self._next_round, _CommitRound()
        target = self._put_count
        if checkpoint:  # on failure too: the next try waits for the timeout, no busy retry
            self._checkpoint_due = False
            self._last_checkpoint = trio.current_time()
        try:
            plan = self._plan(checkpoint)
            try:
                await trio.to_thread.run_sync(sync.execute, plan, self._files, self._gate)
            except OSError as exc:
                self._writer.directory_changed |= plan.sync_directory
                if plan.metadata is not None:
                    self._reader.consumed[:0] = plan.consumed
                    self._metadata_dirty = True
                raise self._write_failed(exc) from exc
        except DiskQueueWriteError as error:
            commit.finish(error)
            return
        if plan.generation == self._gate.generation:
            self._writer.close_retired(plan.retired)
        self._durable_count = max(self._durable_count, target)
        self._syncs += 1
        commit.finish(None)

    def _plan(self, checkpoint: bool) -> sync.SyncPlan:
        writer = self._writer
        try:
            writer.flush()
        except OSError as exc:
            raise self._write_failed(exc) from exc
        self._clear_write_error()
        plan = sync.SyncPlan(
            generation=self._gate.generation,
            fds=writer.unsynced_fds(),
            retired=list(writer.retired),
            sync_directory=writer.directory_changed,
        )
        writer.directory_changed = False
        if checkpoint:
            plan.metadata = self._snapshot()
            plan.consumed, self._reader.consumed = self._reader.consumed, []
            self._metadata_dirty = False
            self._puts_since_checkpoint = 0
        return plan

    def _snapshot(self) -> Metadata:
        """Positions and depth as of now; only valid with an empty write buffer."""
        return Metadata(
            read_segment=self._reader.segment,
            read_position=self._reader.position,
            write_segment=self._writer.segment,
            write_position=self._writer.end,
            depth=self._depth,
        )

    def _save_metadata_now(self) -> None:
        try:
            save_metadata(self._files.metadata_path, self._snapshot())
        except OSError as exc:
            self._metadata_dirty = True
            self._last_error = f"disk queue {self.name!r}: cannot save metadata: {exc}"
            self._log.error("diskq_metadata_save_failed", error=str(exc))

    # -- lifecycle -----------------------------------------------------------

    def empty(self) -> None:
        """Drop every record and segment file; the queue stays open."""
        self._check_open()
        with self._gate.lock:
            self._gate.generation += 1
            fresh = self._writer.segment + 1
            self._writer.reset(fresh)
            self._reader.reset(fresh)
            doomed = self._files.list_segments()
            for segment in doomed:
                _unlink_if_present(self._files.segment_path(segment))
            self._depth = 0
            self._save_metadata_now()
        self._log.info("diskq_emptied", removed_segments=len(doomed))
        self._durable_count = self._put_count
        self._release_waiters(None)

    def close(self) -> None:
        """Write and fsync everything, save the metadata, release the files.

        Blocks; meant for shutdown. Raises DiskQueueWriteError if buffered
        records could not be written (they are lost).
        """
        if self._closed:
            return
        error: DiskQueueWriteError | None = None
        try:
            self._writer.flush()
        except OSError as exc:
            error = DiskQueueWriteError.from_os_error(
                exc,
                f"disk queue {self.name!r}: closed with {self._writer.buffered} bytes that could not "
                f"be written to {self._files.directory}; they are lost",
            )
            self._last_error = str(error)
            self._log.error("diskq_close_lost_records", error=str(error), errno=error.errno)
        with self._gate.lock:
            self._gate.generation += 1
            try:
                for fd in self._writer.unsynced_fds():
                    os.fdatasync(fd)
                if error is None:
                    save_metadata(self._files.metadata_path, self._snapshot())
                    for segment in self._reader.consumed:
                        _unlink_if_present(self._files.segment_path(segment))
                elif self._writer.directory_changed:
                    fsync_directory(self._files.directory)
            except OSError as exc:
                error = error or self._write_failed(exc)
            finally:
                self._shut()
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
                self._lock_fd = acquire_queue_lock(self._files.lock_path, self.name)
            self._shut()
            for segment in self._files.list_segments():
                _unlink_if_present(self._files.segment_path(segment))
            metadata = self._files.metadata_path
            for path in (metadata, metadata.with_name(metadata.name + ".tmp"), self._files.lock_path):
                _unlink_if_present(path)
        self._log.info("diskq_deleted")
        self._release_waiters(DiskQueueError(f"disk queue {self.name!r} was deleted"))

    def _shut(self) -> None:
        self._writer.close()
        self._reader.close()
        os.close(self._lock_fd)
        self._closed = True
        self._wakeup.set()

    def _release_waiters(self, error: DiskQueueError | None) -> None:
        self._next_round.finish(error)
        self._next_round = _CommitRound()

    def _check_open(self) -> None:
        if self._closed:
            raise DiskQueueError(f"disk queue {self.name!r} is closed")

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
            buffered_bytes=writer.buffered,
            last_error=self._last_error,
        )


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
