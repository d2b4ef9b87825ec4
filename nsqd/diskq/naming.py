"""File names of one queue inside the data directory.

Queue names come from topic and channel names and may hold ``:``, ``#`` and
other characters that are unsafe or ambiguous in file names, so they are
percent-escaped; the escaping is reversible, so two queues never share files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import DiskQueueError

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_MAX_ESCAPED_NAME = 200


def escape_name(name: str) -> str:
    """Percent-escape every byte of the UTF-8 name outside ``[A-Za-z0-9._-]``."""
    if not name:
        raise DiskQueueError("disk queue name must not be empty")
    escaped = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in name.encode("utf-8"))
    if len(escaped) > _MAX_ESCAPED_NAME:
        raise DiskQueueError(
            f"disk queue name {name!r} is too long for a file name "
            f"({len(escaped)} bytes escaped, at most {_MAX_ESCAPED_NAME})"
        )
    return escaped


def fsync_directory(directory: Path) -> None:
    """Make file creations, renames and removals in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class QueueFiles:
    """Paths of the segment, metadata, checkpoint and lock files of one queue."""

    def __init__(self, data_path: str | os.PathLike[str], name: str) -> None:
        self.directory = Path(data_path)
        self.name = name
        self._stem = escape_name(name) + ".diskq."
        self._segment_pattern = re.compile(re.escape(self._stem) + r"(\d{6,})\.dat")
        self.metadata_path = self.directory / (self._stem + "meta.json")
        self.checkpoint_path = self.directory / (self._stem + "checkpoint.json")
        self.lock_path = self.directory / (self._stem + "lock")

    def segment_path(self, segment: int) -> Path:
        return self.directory / f"{self._stem}{segment:06d}.dat"

    def list_segments(self) -> list[int]:
        """Numbers of the segment files present, oldest first."""
        numbers = []
        for entry in os.scandir(self.directory):
            match = self._segment_pattern.fullmatch(entry.name)
            if match:
                numbers.append(int(match.group(1)))
        return sorted(numbers)

