"""Reading records in order across segments, skipping damage.

The reader parses large chunks (``pread`` for bytes already in the file, a
copy of the writer's buffer for bytes not yet written), so reading costs a
few C-level calls per record. A record with a bad length or checksum is
skipped by searching forward for the next record that verifies.
"""

from __future__ import annotations

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
    record_length_at,
)
from .writer import SegmentWriter


class SegmentReader:
    """The read position and everything needed to advance it."""

    def __init__(
        self,
        files: QueueFiles,
        writer: SegmentWriter,
        segment: int,
        position: int,
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
        self.consumed: list[int] = []
        self.damaged_records = 0
        self.damaged_bytes = 0
        self.bytes_read = 0
        self._start_segment(segment, position)

    def _start_segment(self, segment: int, position: int) -> None:
        self.close()
        self.segment = segment
        self.position = max(position, SEGMENT_HEADER_SIZE)
        self._chunk = b""
        self._chunk_start = self.position
        self._sealed_size = None

    @property
    def caught_up(self) -> bool:
        return self.segment >= self._writer.segment and self.position >= self._writer.end

    def read_many(self, max_count: int) -> list[bytes]:
        """Up to ``max_count`` payloads in order.

        Raises OSError only if nothing was read; otherwise returns what was
        read and lets the next call meet the error again.
        """
        out: list[bytes] = []
        try:
            self._read_into(out, max_count)
        except OSError:
            if not out:
                raise
        self.bytes_read += sum(map(len, out)) + RECORD_HEADER_SIZE * len(out)
        return out

    def _read_into(self, out: list[bytes], max_count: int) -> None:
        while len(out) < max_count:
            chunk = self._chunk
            offset, _, outcome = parse_records(
                chunk,
                self.position - self._chunk_start,
                max_count - len(out),
                self._min_size,
                self._max_size,
                out.append,
            )
            self.position = self._chunk_start + offset
            if outcome is Outcome.COUNT_REACHED:
                return
            limit = self._limit()
            if limit is None:
                self._skip_missing_segment()
                continue
            if outcome is Outcome.SHORT:
                if self._chunk_start + len(chunk) < limit:
                    length = record_length_at(chunk, offset)
                    want = SCAN_WINDOW if length is None else max(SCAN_WINDOW, RECORD_HEADER_SIZE + length)
                    if self._load(min(want, limit - self.position)):
                        continue
                elif self.position >= limit:
                    if self.segment >= self._writer.segment:
                        return
                    self.consumed.append(self.segment)
                    self._start_segment(self.segment + 1, SEGMENT_HEADER_SIZE)
                    continue
            self._skip_damage(limit)

    def _load(self, size: int) -> bool:
        """Make the chunk start at the read position; False if the data ends early."""
        self._chunk = self._fetch(self.position, size)
        self._chunk_start = self.position
        return len(self._chunk) == size

    def _limit(self) -> int | None:
        """End of the data in the current segment; None if its file is gone."""
        writer = self._writer
        if self.segment == writer.segment:
            return writer.end
        extent = writer.extent(self.segment)
        if extent is not None:
            return extent.end
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

    def _fetch(self, position: int, size: int) -> bytes:
        """Bytes of the current segment, from the file and/or the writer's buffer."""
        extent = self._writer.extent(self.segment)
        if extent is not None and position >= extent.start:
            index = position - extent.start
            return bytes(extent.data[index:index + size])
        in_file = size if extent is None else min(size, extent.start - position)
        data = os.pread(self._open(), in_file, position)
        if extent is not None and len(data) == in_file < size:
            data += extent.data[:size - in_file]
        return data

    def _skip_damage(self, limit: int) -> None:
        damaged_at = self.position
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
        self.position = resume_at
        self._chunk = b""
        self._chunk_start = resume_at

    def _skip_missing_segment(self) -> None:
        self._log.error("diskq_segment_missing", segment=self.segment, path=str(self._files.segment_path(self.segment)))
        self._start_segment(self.segment + 1, SEGMENT_HEADER_SIZE)

    def reset(self, segment: int) -> None:
        self._start_segment(segment, SEGMENT_HEADER_SIZE)
        self.consumed = []

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
