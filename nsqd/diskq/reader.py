"""Reading records in order across segments, skipping damage.

The reader parses large chunks read with ``pread`` (every record is in its
file by the time its put returned), so reading costs a few C-level calls per
record. A record with a bad length or checksum is skipped by searching
forward for the next record that verifies.
"""

from __future__ import annotations

import math
import os

import structlog

from .naming import QueueFiles
from .records import (
    RECORD_HEADER_SIZE,
    SCAN_WINDOW,
    SEGMENT_HEADER_SIZE,
    Outcome,
    find_next_record,
    parse_records,
    position,
    record_length_at,
    split_position,
)
from .writer import SegmentWriter


class SegmentReader:
    """The read position and everything needed to advance it."""

    def __init__(
        self,
        files: QueueFiles,
        writer: SegmentWriter,
        segment: int,
        offset: int,
        min_size: int,
        max_size: int,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self._files = files
        self._writer = writer
        self._min_size = min_size
        self._max_size = max_size
        self._log = log
        self._fd: int | None = None
        self._sealed_size: int | None = None
        self.damaged_records = 0
        self.damaged_bytes = 0
        self.bytes_read = 0
        #: segments released while records before and after them were kept (the queue's holes):
        #: passed over, never opened
        self.holes: set[int] = set()
        self._start_segment(segment, offset)

    def _start_segment(self, segment: int, offset: int) -> None:
        self.close()
        while segment in self.holes and segment < self._writer.segment:
            segment, offset = segment + 1, SEGMENT_HEADER_SIZE
        self.segment = segment
        self.offset = max(offset, SEGMENT_HEADER_SIZE)
        self._chunk = b""
        self._chunk_start = self.offset
        self._sealed_size = None

    @property
    def position(self) -> int:
        return position(self.segment, self.offset)

    @property
    def caught_up(self) -> bool:
        writer = self._writer
        return self.segment > writer.segment or (
            self.segment == writer.segment and self.offset >= max(writer.end, SEGMENT_HEADER_SIZE))

    def skip_to_end(self) -> None:
        """Move past everything written (records the caller holds itself)."""
        writer = self._writer
        if self.segment != writer.segment:
            self._start_segment(writer.segment, writer.end)
        else:
            self.offset = max(writer.end, SEGMENT_HEADER_SIZE)
            self._chunk = b""
            self._chunk_start = self.offset

    def skip_to(self, pos: int) -> None:
        """Move to a record boundary at or after the current position (records the caller holds)."""
        segment, offset = split_position(pos)
        if segment != self.segment:
            self._start_segment(segment, offset)
        else:
            self.offset = offset
            self._chunk = b""
            self._chunk_start = offset

    def jump(self, segment: int, offset: int) -> None:
        """Back to an earlier spot (a batch taken back)."""
        self._start_segment(segment, offset)

    def record_at(self, pos: int) -> bytes | None:
        """The payload of the record at ``pos``, or None if no valid record starts there."""
        segment, offset = split_position(pos)
        try:
            fd = os.open(self._files.segment_path(segment), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            head = os.pread(fd, RECORD_HEADER_SIZE, offset)
            length = record_length_at(head, 0)
            if length is None or not self._min_size <= length <= self._max_size:
                return None
            data = head + os.pread(fd, length, offset + RECORD_HEADER_SIZE)
        finally:
            os.close(fd)
        found: list[bytes] = []
        parse_records(data, 0, 1, self._min_size, self._max_size, found)
        return found[0] if found else None

    def read_many(self, max_count: int, positions: list[int] | None = None,
                  max_bytes: float = math.inf) -> list[bytes]:
        """Up to ``max_count`` payloads in order; their positions go to ``positions`` if given.

        Reading stops once the payloads add up to ``max_bytes`` or more: past
        it by at most what one scan window holds (or one record, if bigger).
        Raises OSError only if nothing was read; otherwise returns what was
        read and lets the next call meet the error again.
        """
        out: list[bytes] = []
        try:
            self._read_into(out, max_count, positions, max_bytes)
        except OSError:
            if not out:
                raise
        self.bytes_read += sum(map(len, out)) + RECORD_HEADER_SIZE * len(out)
        return out

    def _read_into(self, out: list[bytes], max_count: int, positions: list[int] | None,
                   max_bytes: float) -> None:
        nbytes = 0
        while len(out) < max_count and nbytes < max_bytes:
            chunk = self._chunk
            start = self.offset - self._chunk_start
            offsets: list[int] | None = None if positions is None else []
            offset, _, outcome = parse_records(chunk, start, max_count - len(out), self._min_size, self._max_size,
                                               out, offsets)
            if offsets:
                positions += map(position(self.segment, self._chunk_start).__add__, offsets)
            self.offset = self._chunk_start + offset
            if outcome is Outcome.COUNT_REACHED:
                return
            nbytes += offset - start  # the records parsed, headers included
            limit = self._limit()
            if limit is None:
                self._skip_missing_segment()
                continue
            if outcome is Outcome.SHORT:
                if self._chunk_start + len(chunk) < limit:
                    length = record_length_at(chunk, offset)
                    want = SCAN_WINDOW if length is None else max(SCAN_WINDOW, RECORD_HEADER_SIZE + length)
                    if self._load(min(want, limit - self.offset)):
                        continue
                elif self.offset >= limit:
                    if self.segment >= self._writer.segment:
                        return
                    self._start_segment(self.segment + 1, SEGMENT_HEADER_SIZE)
                    continue
            self._skip_damage(limit)

    def _load(self, size: int) -> bool:
        """Make the chunk start at the read offset; False if the data ends early."""
        self._chunk = self._fetch(self.offset, size)
        self._chunk_start = self.offset
        return len(self._chunk) == size

    def _limit(self) -> int | None:
        """End of the data in the current segment; None if its file is gone."""
        writer = self._writer
        if self.segment == writer.segment:
            return writer.end
        if self._sealed_size is None:
            try:
                self._sealed_size = os.fstat(self._open()).st_size
            except FileNotFoundError:
                return None
        return self._sealed_size

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self._files.segment_path(self.segment), os.O_RDONLY | os.O_CLOEXEC)
        return self._fd

    def _fetch(self, offset: int, size: int) -> bytes:
        return os.pread(self._open(), size, offset)

    def _skip_damage(self, limit: int) -> None:
        damaged_at = self.offset
        resume = find_next_record(self._fetch, damaged_at + 1, limit, self._min_size, self._max_size)
        resume_at = limit if resume is None else resume
        self.damaged_records += 1
        self.damaged_bytes += resume_at - damaged_at
        self._log.warning(
            "diskq_damaged_record_skipped",
            segment=self.segment,
            position=damaged_at,
            skipped_bytes=resume_at - damaged_at,
            resumed=resume is not None,
        )
        self.offset = resume_at
        self._chunk = b""
        self._chunk_start = resume_at

    def _skip_missing_segment(self) -> None:
        self._log.error("diskq_segment_missing", segment=self.segment, path=str(self._files.segment_path(self.segment)))
        self._start_segment(self.segment + 1, SEGMENT_HEADER_SIZE)

    def reset(self, segment: int) -> None:
        self._start_segment(segment, SEGMENT_HEADER_SIZE)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
