"""Appending records to segments: written to the OS before the call returns, all or nothing.

A put is a confirmation's promise: the bytes are handed to the kernel
(``pwrite``) before :meth:`SegmentWriter.write` returns, so a crash of the
process loses nothing that was put, as go-diskqueue's ``Put`` guarantees. A
batch is one ``pwrite`` per segment it touches. If any write fails (a full
disk, an I/O error) the batch is rolled back: the segment is cut back to where
the batch began and segments it created are removed, so the caller can refuse
the whole batch and nothing of it reappears after a restart.

Once a segment holds ``RESERVE_AHEAD`` bytes, its blocks are reserved that
far ahead of its end (``nsqd/diskq/reserve.py``), so a busy queue's appends
land in allocated blocks and a small queue reserves nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import accumulate, repeat
from operator import add
from os import pwrite

from .naming import QueueFiles
from .reserve import reserve
from .records import RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE, encode_record, encode_records, position, segment_header


#: how far ahead of a busy segment's end its blocks are reserved (the first this many bytes are not)
RESERVE_AHEAD = 4 << 20
#: the most bytes one write joins into a buffer: a bigger batch (256 messages of 1 MB kept at
#: shutdown, 1,000 taken over from Go nsqd) is written in parts, still all or nothing
WRITE_STEP_BYTES = 4 << 20


class SegmentWriter:
    """Owns the write side: the current segment, its descriptor and its end.

    Descriptors of sealed segments move to ``retired`` for the next sync to
    fsync and close.
    """

    def __init__(self, files: QueueFiles, segment: int, end: int, max_bytes_per_file: int) -> None:
        self._files = files
        self._max_bytes = max_bytes_per_file
        self.segment = segment
        self.end = end
        """Bytes of the current segment in its file; 0 while the file does not exist."""
        self._fd: int | None = None
        #: the current segment's blocks are reserved up to here (or it is below RESERVE_AHEAD)
        self._reserved = 0
        self.retired: list[int] = []
        self.directory_changed = False

    def write(self, payloads: Sequence[bytes], size: int, want_positions: bool) -> list[int] | None:
        """Write encoded records (``size`` bytes with headers); returns their positions if asked.

        Raises OSError after rolling the batch back.
        """
        if size > WRITE_STEP_BYTES and len(payloads) > 1:
            return self._write_parts(payloads, want_positions)
        start = self.end or SEGMENT_HEADER_SIZE
        if start + size > self._max_bytes and (self.end > SEGMENT_HEADER_SIZE or len(payloads) > 1):
            return self._write_rotating(payloads, want_positions)
        data = encode_records(payloads) if len(payloads) > 1 else encode_record(payloads[0])
        if not self.end:
            data = segment_header() + data
        fd = self._current_fd()
        if self.end + len(data) > self._reserved:
            self._reserve(fd, self.end + len(data))
        self._write_all(fd, data, self.end, rollback_to=self.end)
        self.end += len(data)
        if not want_positions:
            return None
        sizes = map(add, map(len, payloads), repeat(RECORD_HEADER_SIZE))
        positions = list(accumulate(sizes, initial=position(self.segment, start)))
        positions.pop()
        return positions

    def _write_parts(self, payloads: Sequence[bytes], want_positions: bool) -> list[int] | None:
        """A batch over WRITE_STEP_BYTES, a part at a time: memory for one part, not the whole.

        A part that fails is rolled back by its own write; then the parts
        before it are cut (the descriptors they retired are left to the next
        sync to close, as for any rollback: a sync in flight may hold one).
        """
        segment, end = self.segment, self.end
        positions: list[int] = []
        first = 0
        try:
            while first < len(payloads):
                last, size = first + 1, RECORD_HEADER_SIZE + len(payloads[first])
                while last < len(payloads) and size + RECORD_HEADER_SIZE + len(payloads[last]) <= WRITE_STEP_BYTES:
                    size += RECORD_HEADER_SIZE + len(payloads[last])
                    last += 1
                written = self.write(payloads[first:last], size, want_positions)
                if written is not None:
                    positions += written
                first = last
        except OSError:
            if (self.segment, self.end) != (segment, end):
                self.rollback(segment, end)
            raise
        return positions if want_positions else None

    def _write_rotating(self, payloads: Sequence[bytes], want_positions: bool) -> list[int] | None:
        """Slow path: the batch crosses a segment boundary; place record by record.

        A segment holds at least one record, so a record larger than
        ``max_bytes_per_file`` gets a segment of its own.
        """
        groups: list[tuple[int, int, bytearray]] = []  # (segment, file offset, bytes)
        positions: list[int] = []
        segment, end = self.segment, self.end
        current = bytearray(b"" if end else segment_header())
        offset = end
        end = end or SEGMENT_HEADER_SIZE
        for payload in payloads:
            size = RECORD_HEADER_SIZE + len(payload)
            if end > SEGMENT_HEADER_SIZE and end + size > self._max_bytes:
                groups.append((segment, offset, current))
                segment, offset, end = segment + 1, 0, SEGMENT_HEADER_SIZE
                current = bytearray(segment_header())
            positions.append(position(segment, end))
            current += encode_record(payload)
            end += size
        groups.append((segment, offset, current))
        first_segment, first_end, first_fd = self.segment, self.end, self._fd
        opened: list[tuple[int, int]] = []  # (segment, fd) created by this batch
        try:
            for segment, offset, data in groups:
                if segment == first_segment:
                    fd = self._current_fd()
                    first_fd = fd
                else:
                    fd = self._create(segment)
                    opened.append((segment, fd))
                self._write_all(fd, data, offset, rollback_to=offset if segment == first_segment else None)
        except OSError:
            for number, fd in opened:
                os.close(fd)
                _unlink_quietly(self._files.segment_path(number))
            if first_fd is not None:
                _truncate_quietly(first_fd, first_end)
                self._reserved = 0
            raise
        if opened:  # every sealed segment's descriptor waits for the next sync
            if first_fd is not None:
                self.retired.append(first_fd)
            self.retired += [fd for _, fd in opened[:-1]]
            self.segment, self._fd = opened[-1]
            self._reserved = 0
        self.end = groups[-1][1] + len(groups[-1][2])
        return positions if want_positions else None

    def _reserve(self, fd: int, needed: int) -> None:
        """Reserve blocks ``RESERVE_AHEAD`` past ``needed`` (once the segment holds that much)."""
        if needed <= RESERVE_AHEAD:
            self._reserved = RESERVE_AHEAD
            return
        start, self._reserved = self._reserved, min(needed + RESERVE_AHEAD, self._max_bytes)
        reserve(fd, start, self._reserved - start)  # refused: the writes allocate as they go

    def _write_all(self, fd: int, data: bytes | bytearray, offset: int, rollback_to: int | None) -> None:
        view = memoryview(data)
        written = 0
        try:
            while written < len(view):
                written += pwrite(fd, view[written:], offset + written)
        except OSError:
            if written and rollback_to is not None:
                _truncate_quietly(fd, rollback_to)
                self._reserved = 0  # a truncate frees the blocks reserved past the size
            raise

    def _current_fd(self) -> int:
        if self._fd is None:
            if self.end == 0:
                self._fd = self._create(self.segment)
            else:
                self._fd = os.open(self._files.segment_path(self.segment), os.O_WRONLY | os.O_CLOEXEC)
        return self._fd

    def _create(self, segment: int) -> int:
        fd = os.open(self._files.segment_path(segment), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.directory_changed = True
        return fd

    def rollback(self, segment: int, end: int) -> None:
        """Cut everything written after ``(segment, end)`` (a batch taken back)."""
        if self.segment != segment:
            if self._fd is not None:
                os.close(self._fd)
            for number in range(segment + (1 if end else 0), self.segment + 1):
                _unlink_quietly(self._files.segment_path(number))
            self.segment = segment
            self._fd = os.open(self._files.segment_path(segment), os.O_WRONLY | os.O_CLOEXEC) if end else None
        if self._fd is not None:
            os.ftruncate(self._fd, end)
        self.end = end
        self._reserved = 0

    def seal(self) -> None:
        """End the current segment where it is: the next write starts the next segment."""
        if self._fd is not None:
            self.retired.append(self._fd)  # the next sync covers and closes it
            self._fd = None
        self.segment += 1
        self.end = 0
        self._reserved = 0

    def unsynced_fds(self) -> list[int]:
        """Descriptors whose data a sync must cover: sealed segments, then the current one."""
        return self.retired + ([] if self._fd is None else [self._fd])

    def close_retired(self, fds: list[int]) -> None:
        """Close sealed-segment descriptors that a sync has covered."""
        synced = set(fds)
        for fd in self.retired:
            if fd in synced:
                os.close(fd)
        self.retired = [fd for fd in self.retired if fd not in synced]

    def reset(self, segment: int) -> None:
        """Start afresh at an empty ``segment``."""
        self.close()
        self.segment = segment
        self.end = 0
        self._reserved = 0

    def close(self) -> None:
        for fd in [*([] if self._fd is None else [self._fd]), *self.retired]:
            os.close(fd)
        self._fd = None
        self.retired = []


def _truncate_quietly(fd: int, size: int) -> None:
    """Cut a partial batch off; if even that fails, recovery's checksums drop the torn part."""
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass


def _unlink_quietly(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
