"""Appending records to segments through a bounded in-memory buffer.

Puts only encode into memory; bytes reach the files in large ``pwrite``
calls. Buffered bytes are kept per segment ("extents"), so a rotation never
forces a write in the middle of a batch and a failed write loses nothing:
the bytes stay buffered and the next flush retries at the same offsets.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from os import pwrite

from .naming import QueueFiles
from .records import RECORD_HEADER_SIZE, SEGMENT_HEADER_SIZE, encode_record, encode_records, segment_header


class Extent:
    """Bytes of one segment not yet written, starting at file offset ``start``."""

    __slots__ = ("segment", "start", "data")

    def __init__(self, segment: int, start: int, data: bytes = b"") -> None:
        self.segment = segment
        self.start = start
        self.data = bytearray(data)

    @property
    def end(self) -> int:
        return self.start + len(self.data)


class SegmentWriter:
    """Owns the write side: the current segment, its buffer and its file descriptors.

    The last extent is the current segment; earlier ones are sealed segments
    whose tail is still buffered. Descriptors of sealed segments move to
    ``retired`` once written, for the next sync to fsync and close.
    """

    def __init__(self, files: QueueFiles, segment: int, position: int, max_bytes_per_file: int) -> None:
        self._files = files
        self._max_bytes = max_bytes_per_file
        self._extents = [Extent(segment, position)]
        self._fds: dict[int, int] = {}
        self.retired: list[int] = []
        self.directory_changed = False
        self.buffered = 0
        """Bytes accepted but not yet written to a file."""

    @property
    def segment(self) -> int:
        return self._extents[-1].segment

    @property
    def end(self) -> int:
        """Logical end of the current segment, buffered bytes included."""
        return self._extents[-1].end

    def extent(self, segment: int) -> Extent | None:
        for extent in self._extents:
            if extent.segment == segment:
                return extent
        return None

    def append(self, payloads: Sequence[bytes], size: int) -> int:
        """Buffer encoded records (``size`` bytes with headers); returns segments started."""
        current = self._extents[-1]
        if current.end == 0:
            current.data += segment_header()
            self.buffered += SEGMENT_HEADER_SIZE
        if current.end + size <= self._max_bytes:
            current.data += encode_records(payloads) if len(payloads) > 1 else encode_record(payloads[0])
            self.buffered += size
            return 0
        return self._append_rotating(payloads)

    def _append_rotating(self, payloads: Sequence[bytes]) -> int:
        """Slow path: the batch crosses a segment boundary; place record by record.

        A segment holds at least one record, so a record larger than
        ``max_bytes_per_file`` gets a segment of its own.
        """
        started = 0
        current = self._extents[-1]
        for payload in payloads:
            size = RECORD_HEADER_SIZE + len(payload)
            if current.end > SEGMENT_HEADER_SIZE and current.end + size > self._max_bytes:
                current = Extent(current.segment + 1, 0, segment_header())
                self._extents.append(current)
                self.buffered += SEGMENT_HEADER_SIZE
                started += 1
            current.data += encode_record(payload)
            self.buffered += size
        return started

    def flush(self) -> None:
        """Write every buffered byte; on OSError the unwritten rest stays buffered."""
        while True:
            extent = self._extents[0]
            if extent.data:
                fd = self._fd_for(extent)
                while extent.data:
                    written = pwrite(fd, extent.data, extent.start)
                    extent.start += written
                    del extent.data[:written]
                    self.buffered -= written
            if len(self._extents) == 1:
                return
            del self._extents[0]
            fd = self._fds.pop(extent.segment, None)
            if fd is not None:
                self.retired.append(fd)

    def _fd_for(self, extent: Extent) -> int:
        fd = self._fds.get(extent.segment)
        if fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
            if extent.start == 0:
                flags |= os.O_TRUNC
                self.directory_changed = True
            fd = os.open(self._files.segment_path(extent.segment), flags, 0o644)
            self._fds[extent.segment] = fd
        return fd

    def unsynced_fds(self) -> list[int]:
        """Descriptors whose data a sync must cover: sealed segments, then the current one."""
        current = self._fds.get(self.segment)
        return self.retired + ([] if current is None else [current])

    def close_retired(self, fds: list[int]) -> None:
        """Close sealed-segment descriptors that a sync has covered."""
        synced = set(fds)
        for fd in self.retired:
            if fd in synced:
                os.close(fd)
        self.retired = [fd for fd in self.retired if fd not in synced]

    def reset(self, segment: int) -> None:
        """Drop everything buffered and start afresh at an empty ``segment``."""
        self.close()
        self._extents = [Extent(segment, 0)]
        self.buffered = 0

    def close(self) -> None:
        """Close every descriptor without writing what is buffered."""
        for fd in [*self._fds.values(), *self.retired]:
            os.close(fd)
        self._fds.clear()
        self.retired = []
