"""File names of one queue inside the data directory.

Queue names come from topic and channel names and may hold ``:``, ``#`` and
other characters that are unsafe or ambiguous in file names, so they are
percent-escaped; the escaping is reversible, so two queues never share files.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote_to_bytes

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


def unescape_name(escaped: str) -> str:
    """The name :func:`escape_name` made ``escaped`` of; ValueError if it made no such thing."""
    try:
        name = unquote_to_bytes(escaped).decode("utf-8")
        if escape_name(name) == escaped:
            return name
    except (UnicodeDecodeError, DiskQueueError):
        pass
    raise ValueError(f"{escaped!r} is not an escaped queue name")


def fsync_directory(directory: Path) -> None:
    """Make file creations, renames and removals in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: what this disk queue puts between a queue's escaped name and the rest of its file names
QUEUE_MARKER = ".diskq."
#: what a segment of an emptied or deleted queue is renamed with until it is unlinked (see trash.py)
TRASH_SUFFIX = ".trash"


def queue_stem(name: str) -> str:
    """What every file name of the queue called ``name`` starts with."""
    return escape_name(name) + QUEUE_MARKER


class DirectoryListing:
    """One listing of a data directory, grouped by the queue each name can belong to.

    Opening thousands of queues at start-up then lists the directory once,
    not once a queue (which made a restart with 3,000 topics take 70 s), and
    a queue created later, found nowhere in it, lists nothing at all. A
    name is filed under the part up to each ``markers`` occurrence in it, so
    a queue whose own name holds a marker still finds its files; callers
    match the names they get as they match a fresh listing.
    """

    def __init__(self, directory: str | os.PathLike[str], markers: tuple[str, ...]) -> None:
        self._stems: dict[str, list[str]] = {}
        for name in os.listdir(directory):
            for marker in markers:
                at = name.find(marker)
                while at >= 0:
                    self._stems.setdefault(name[:at + len(marker)], []).append(name)
                    at = name.find(marker, at + 1)

    def stems(self, marker: str) -> list[str]:
        """The stems ending in ``marker`` of the queues not yet opened, in order."""
        return sorted(stem for stem in self._stems if stem.endswith(marker))

    def names(self, stem: str) -> list[str]:
        """The names starting with ``stem`` (an empty list if none)."""
        return self._stems.get(stem, [])

    def forget(self, stem: str) -> None:
        """The queue of ``stem`` was opened: its files may change from now on."""
        self._stems.pop(stem, None)


class QueueFiles:
    """Paths of the segment, metadata, checkpoint and lock files of one queue.

    ``present``: the queue's names from a listing just taken
    (:class:`DirectoryListing`), used by the first :meth:`list_segments`
    instead of listing the directory again.
    """

    def __init__(self, data_path: str | os.PathLike[str], name: str, present: list[str] | None = None) -> None:
        self.directory = Path(data_path)
        self.name = name
        self._stem = queue_stem(name)
        self._present = present
        self.metadata_path = self.directory / (self._stem + "meta.json")
        #: the two checkpoint files, saved in turn (see metadata.CheckpointFile)
        self.checkpoint_paths = (self.directory / (self._stem + "checkpoint.json"),
                                 self.directory / (self._stem + "checkpoint.b.json"))
        self.lock_path = self.directory / (self._stem + "lock")

    def segment_path(self, segment: int) -> Path:
        return self.directory / f"{self._stem}{segment:06d}.dat"

    def trash_path(self, segment: int) -> Path:
        return self.directory / f"{self._stem}{segment:06d}.dat{TRASH_SUFFIX}"

    def list_segments(self) -> list[int]:
        """Numbers of the segment files present, oldest first."""
        names, self._present = self._present, None
        if names is None:
            names = starting_with(self.directory, self._stem)
        return sorted(number for number in map(self._segment_number, names) if number is not None)

    def _segment_number(self, name: str) -> int | None:
        """The number of a segment file's name (``<stem>NNNNNN.dat``, six digits or more), else None."""
        if not (name.startswith(self._stem) and name.endswith(".dat")):
            return None
        digits = name[len(self._stem):-4]
        return int(digits) if len(digits) >= 6 and digits.isascii() and digits.isdigit() else None


def starting_with(directory: Path, stem: str) -> list[str]:
    """The names in ``directory`` that start with ``stem``: a prefix test first, the slow match after."""
    return [name for name in os.listdir(directory) if name.startswith(stem)]

