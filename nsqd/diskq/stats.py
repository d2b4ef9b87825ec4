"""The statistics snapshot a queue reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DiskQueueStatistics:
    depth: int
    """Records stored and not yet read."""
    bytes_written: int
    """Record bytes (headers included) accepted since the queue was opened."""
    bytes_read: int
    """Record bytes (headers included) read since the queue was opened."""
    segments: int
    """Segment files holding unread records."""
    corrupt_records_skipped: int
    """Damaged spots skipped since open, torn tails cut on open included; each is at least one record."""
    bytes_skipped: int
    """Bytes skipped or cut off because they did not form valid records."""
    syncs: int
    """Commits (fsync rounds in the worker thread) completed since open."""
    last_error: str | None
    """The most recent write, sync or read error, if any."""
