"""Rebuilding the queue state from the files on open.

The metadata is checked against the segment files; where they disagree the
files win. The scan past the metadata's write position always runs, so
records written after the last metadata save are found, a torn tail is cut
off and new writes append right after the last good record.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import structlog

from .errors import DiskQueueError
from .metadata import Kept, Metadata, load_newest
from .naming import QueueFiles
from .records import (
    FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    HeaderState,
    ScanResult,
    check_segment_header,
    first_record_is_ours,
    header_version,
    scan_records,
    segment_header,
)

#: why the metadata is not trusted when records were lost with the files (see _Recovery.run)
SEGMENTS_MISSING = "segments between read and write position are missing"


@dataclass(frozen=True)
class RecoveredState:
    release_segment: int
    release_position: int
    """Where reading starts: records between here and the read position are
    delivered again only if ``kept`` lists them."""
    read_segment: int
    read_position: int
    write_segment: int
    write_position: int
    depth: int
    """Unread records: the kept ones plus everything after the read position."""
    kept: tuple[Kept, ...]
    kept_count: int
    """Of ``depth``, the records the kept intervals hold."""
    damaged_records: int
    damaged_bytes: int
    sequence: int
    """Of the metadata used (0 without): saves go on from here."""
    on_disk: Metadata | None = None
    """The metadata file's document, when no checkpoint file is left beside it (after an orderly
    stop): opening need not save the metadata again if it already says what the files say."""
    fresh: bool = False
    """The queue has no file at all (a new topic or channel): no metadata file says the same as
    an empty one, so opening writes nothing."""


class _Recovery:
    def __init__(self, files: QueueFiles, min_size: int, max_size: int, log: structlog.typing.FilteringBoundLogger):
        self.files = files
        self.min_size = min_size
        self.max_size = max_size
        self.log = log
        self.sizes: dict[int, int] = {}
        self.damaged_records = 0
        self.damaged_bytes = 0

    def run(self) -> RecoveredState:
        meta, unusable = self._load_metadata()
        segments = self._check_headers(self.files.list_segments())
        if meta is not None:
            segments = self._remove_consumed(segments, meta.release[0])
        if not segments:
            start = meta.write_segment if meta is not None else 0
            return RecoveredState(start, 0, start, 0, start, 0, 0, (), 0, self.damaged_records, self.damaged_bytes,
                                  meta.sequence if meta is not None else 0, self._alone(meta),
                                  fresh=meta is None and not unusable and not self.sizes)

        read_segment, read_position = self._read_start(meta, segments)
        release_segment, release_position = read_segment, read_position
        kept: tuple[Kept, ...] = ()
        kept_count = 0
        if meta is not None and (read_segment, read_position) == (meta.read_segment, max(meta.read_position, SEGMENT_HEADER_SIZE)):
            kept = meta.kept  # notes on records ahead of the read position count too (reserved ones)
            wanted = meta.release
            if wanted < (read_segment, read_position):
                present = [s for s in segments if s >= wanted[0]]
                release_segment = present[0]
                release_position = max(wanted[1], SEGMENT_HEADER_SIZE) if release_segment == wanted[0] else SEGMENT_HEADER_SIZE
                if release_position > self.sizes[release_segment]:
                    release_position = SEGMENT_HEADER_SIZE
                kept_count = meta.kept_count
        distrust = self._distrust(meta, read_segment, read_position) if meta is not None else "no metadata"
        trusted = distrust is None
        if trusted:
            scan_segment, scan_position, depth = meta.write_segment, meta.write_position, meta.depth
        else:
            scan_segment, scan_position, depth = read_segment, read_position, 0
            self.log.warning("diskq_recounting_depth", from_segment=read_segment, from_position=read_position)
        # segments gone from between matching read and write positions took records with them, and so
        # did a read segment gone or cut short below the read position while the saved write position
        # is intact: the saved depth less what is left past the saved read position and before the
        # saved write position is a count of the loss
        counting_loss = distrust == SEGMENTS_MISSING or (meta is not None and self._read_segment_lost(meta))
        found_before_saved_end = 0

        tail = segments[-1]
        write_segment, write_position = tail, SEGMENT_HEADER_SIZE
        for segment in segments:
            if segment < scan_segment:
                continue
            start = max(scan_position if segment == scan_segment else 0, SEGMENT_HEADER_SIZE)
            # records before the saved read position (a read segment cut short) are not in the saved depth
            counted = counting_loss and (segment, start) >= (meta.read_segment, meta.read_position)
            if counting_loss and segment == meta.write_segment and start < meta.write_position:
                before = self._scan(segment, start, meta.write_position)
                found_before_saved_end += before.records if counted else 0
                depth += before.records
                start = meta.write_position
            found = self._scan(segment, start)
            depth += found.records
            if counted and segment < meta.write_segment:
                found_before_saved_end += found.records
            if segment == tail:
                write_position = found.end
                if self.sizes[segment] > found.end:
                    self._truncate_tail(segment, found.end)
        if counting_loss and meta.depth > found_before_saved_end:
            lost = meta.depth - found_before_saved_end
            self.log.warning("diskq_records_lost_with_missing_segments", records=lost)
            self.damaged_records += lost
        if scan_segment > tail:
            # The saved write segment was never created: nothing was written there.
            write_segment, write_position = scan_segment, 0
        return RecoveredState(
            release_segment, release_position, read_segment, read_position, write_segment, write_position,
            depth + kept_count, kept, kept_count, self.damaged_records, self.damaged_bytes,
            meta.sequence if meta is not None else 0,
            self._alone(meta),
        )

    def _alone(self, meta: Metadata | None) -> Metadata | None:
        """The metadata file's document if no checkpoint file is beside it (see RecoveredState.on_disk)."""
        return meta if meta is not None and not any(path.exists() for path in self.files.checkpoint_paths) else None

    def _load_metadata(self) -> tuple[Metadata | None, list]:
        meta, unusable = load_newest([self.files.metadata_path, *self.files.checkpoint_paths])
        for path, reason in unusable:
            self.log.warning("diskq_metadata_unusable", path=str(path), reason=reason)
        return meta, unusable

    def _check_headers(self, segments: list[int]) -> list[int]:
        """Drop files too short to hold a record; restore damaged magic or version bytes; refuse
        a segment of another format."""
        usable = []
        for segment in segments:
            path = self.files.segment_path(segment)
            with open(path, "r+b") as stream:
                head = stream.read(SEGMENT_HEADER_SIZE)
                state = check_segment_header(head)
                if state is HeaderState.OTHER_VERSION:
                    size = os.fstat(stream.fileno()).st_size - SEGMENT_HEADER_SIZE
                    if not first_record_is_ours(stream.read, size):
                        raise DiskQueueError(
                            f"{path}: segment format version {header_version(head)} is not supported (this "
                            f"build reads version {FORMAT_VERSION}): move the queue's files aside to start "
                            f"without them, or start the build that wrote them")
                if state in (HeaderState.BAD_MAGIC, HeaderState.OTHER_VERSION):
                    self.log.warning("diskq_segment_header_repaired", path=str(path), found=head.hex())
                    stream.seek(0)
                    stream.write(segment_header())
                    stream.flush()
                    os.fsync(stream.fileno())
                    self.damaged_bytes += SEGMENT_HEADER_SIZE
                self.sizes[segment] = os.fstat(stream.fileno()).st_size
            if state is HeaderState.TORN:
                self.log.warning("diskq_torn_segment_removed", path=str(path), size=len(head))
                os.unlink(path)
                continue
            usable.append(segment)
        return usable

    def _remove_consumed(self, segments: list[int], release_segment: int) -> list[int]:
        """Segments before the saved release segment were finished before the last save."""
        for segment in segments:
            if segment < release_segment:
                self.log.info("diskq_consumed_segment_removed", segment=segment)
                os.unlink(self.files.segment_path(segment))
        return [segment for segment in segments if segment >= release_segment]

    def _read_segment_lost(self, meta: Metadata) -> bool:
        """The saved read segment is gone or shorter than the read position, while the saved write
        position, past it, is still in its segment."""
        read_size = self.sizes.get(meta.read_segment)
        return ((read_size is None or meta.read_position > read_size)
                and (meta.write_segment, meta.write_position) > (meta.read_segment, meta.read_position)
                and meta.write_segment != meta.read_segment
                and SEGMENT_HEADER_SIZE <= meta.write_position <= self.sizes.get(meta.write_segment, 0))

    def _read_start(self, meta: Metadata | None, segments: list[int]) -> tuple[int, int]:
        if meta is not None and meta.read_segment in self.sizes:
            if meta.read_position <= self.sizes[meta.read_segment]:
                return meta.read_segment, max(meta.read_position, SEGMENT_HEADER_SIZE)
            self.log.warning("diskq_read_position_past_end", segment=meta.read_segment, position=meta.read_position)
        elif meta is not None and meta.read_segment == meta.write_segment > segments[-1] and meta.write_position == 0:
            # read to the end, then a new segment started (see DiskQueue.seal_if_drained) that was
            # never written: the older segments hold only records released or kept
            return meta.read_segment, SEGMENT_HEADER_SIZE
        return segments[0], SEGMENT_HEADER_SIZE

    def _distrust(self, meta: Metadata, read_segment: int, read_position: int) -> str | None:
        """Why the saved depth may not count the records up to the saved write position (None: it does)."""
        reason = None
        if (read_segment, read_position) != (meta.read_segment, max(meta.read_position, SEGMENT_HEADER_SIZE)):
            reason = "read position does not match the files"
        elif (meta.write_segment, max(meta.write_position, SEGMENT_HEADER_SIZE)) < (read_segment, read_position):
            reason = "write position is before the read position"
        elif any(s not in self.sizes for s in range(meta.read_segment, meta.write_segment)):
            reason = SEGMENTS_MISSING
        elif meta.write_position > self.sizes.get(meta.write_segment, 0):
            reason = "write position is past the end of its segment"
        if reason is not None:
            self.log.warning("diskq_metadata_disagrees_with_files", reason=reason, metadata=str(meta))
        return reason

    def _scan(self, segment: int, start: int, limit: int | None = None) -> ScanResult:
        """Count records from ``start``; records found are fsynced, as the writer may have died before."""
        fd = os.open(self.files.segment_path(segment), os.O_RDONLY | os.O_CLOEXEC)
        try:
            found = scan_records(
                lambda position, size: os.pread(fd, size, position),
                start,
                self.sizes[segment] if limit is None else min(limit, self.sizes[segment]),
                self.min_size,
                self.max_size,
            )
            if found.records:
                os.fsync(fd)
            return found
        finally:
            os.close(fd)

    def _truncate_tail(self, segment: int, end: int) -> None:
        """Cut everything after the last good record so appends follow it."""
        path = self.files.segment_path(segment)
        cut = self.sizes[segment] - end
        self.log.warning("diskq_torn_tail_truncated", path=str(path), valid_end=end, removed_bytes=cut)
        self.damaged_records += 1
        self.damaged_bytes += cut
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, end)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.sizes[segment] = end


def recover(
    files: QueueFiles, min_size: int, max_size: int, log: structlog.typing.FilteringBoundLogger
) -> RecoveredState:
    """Read the metadata, check it against the files, repair both."""
    return _Recovery(files, min_size, max_size, log).run()
