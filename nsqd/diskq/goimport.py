"""Reading queues left by Go nsqd (go-diskqueue files), to migrate their backlog.

go-diskqueue stores ``<name>.diskqueue.%06d.dat`` segments of records framed
as a 4-byte big-endian length and the payload, with no checksum, plus a text
metadata file ``<name>.diskqueue.meta.dat``::

    depth
    readFileNum,readPos
    writeFileNum,writePos

Go nsqd names a topic's queue after the topic and a channel's queue
``<topic>:<channel>``. Without checksums a bad length cannot be resynchronised
from, so the rest of that segment is skipped and counted; payloads are
returned as stored (Go nsqd message encoding).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

from .naming import starting_with

logger = structlog.get_logger("nsqd.diskq")

GO_MIN_MSG_SIZE = 26
"""Go nsqd's smallest valid message: timestamp, attempts and a 16-byte id."""
GO_MAX_MSG_SIZE = 1024 * 1024 + GO_MIN_MSG_SIZE
"""Go nsqd's default ``--max-msg-size`` plus the message header, as go-diskqueue is configured."""

_LENGTH = struct.Struct(">I")
_METADATA = re.compile(rb"\s*(\d+)\n(\d+),(\d+)\n(\d+),(\d+)\n?\s*")


@dataclass(frozen=True)
class GoQueueMetadata:
    depth: int
    read_file: int
    read_position: int
    write_file: int
    write_position: int


#: what go-diskqueue puts between a queue's name and the rest of its file names
GO_MARKER = ".diskqueue."


def go_stem(name: str) -> str:
    """What every file name of Go's queue called ``name`` starts with."""
    return name + GO_MARKER


class _GoFiles:
    def __init__(self, name: str, data_path: str | os.PathLike[str], present: list[str] | None = None) -> None:
        self.directory = Path(data_path)
        self._stem = go_stem(name)
        self.metadata_path = self.directory / f"{self._stem}meta.dat"
        self._present = present
        self._segment = re.compile(re.escape(self._stem) + r"(\d{6,})\.dat")
        self._leftover = re.compile(
            re.escape(self._stem) + r"(\d{6,}\.dat\.bad|meta\.dat\.\d+\.tmp)"
        )

    def segment_path(self, number: int) -> Path:
        return self.directory / f"{self._stem}{number:06d}.dat"

    def segments(self) -> list[int]:
        return sorted(int(m.group(1)) for m in self._matches(self._segment))

    def leftovers(self) -> list[str]:
        """Files go-diskqueue leaves besides segments: renamed bad segments, metadata temp files."""
        return [m.string for m in self._matches(self._leftover)]

    def _matches(self, pattern: re.Pattern[str]) -> list[re.Match[str]]:
        names = self._present
        if names is None:
            try:
                names = starting_with(self.directory, self._stem)
            except FileNotFoundError:
                return []
        return [m for m in map(pattern.fullmatch, names) if m]


def go_queue_exists(name: str, data_path: str | os.PathLike[str], present: list[str] | None = None) -> bool:
    """Whether Go nsqd left a queue called ``name`` in ``data_path``.

    ``present``: the names of a listing just taken that start with
    :func:`go_stem` (see ``DirectoryListing``), instead of a new listing.
    """
    if present is not None and not present:
        return False
    files = _GoFiles(name, data_path, present)
    if present is not None:
        return files.metadata_path.name in present or bool(files.segments())
    return files.metadata_path.exists() or bool(files.segments())


def read_go_metadata(name: str, data_path: str | os.PathLike[str]) -> GoQueueMetadata | None:
    """The saved positions; None if the file is missing or unreadable."""
    path = _GoFiles(name, data_path).metadata_path
    try:
        match = _METADATA.fullmatch(path.read_bytes())
    except FileNotFoundError:
        return None
    if match is None:
        logger.warning("diskq_go_metadata_unusable", path=str(path))
        return None
    return GoQueueMetadata(*map(int, match.groups()))


class GoQueueRecords(Iterator[bytes]):
    """Payloads of a Go queue in order, from its saved read position.

    ``skipped_records`` and ``skipped_bytes`` count what could not be read:
    a bad length skips the rest of its segment, a torn record ends it.
    """

    def __init__(self, name: str, data_path: str | os.PathLike[str], min_msg_size: int, max_msg_size: int) -> None:
        self.name = name
        self.records = 0
        self.skipped_records = 0
        self.skipped_bytes = 0
        self._files = _GoFiles(name, data_path)
        self._min = min_msg_size
        self._max = max_msg_size
        self._payloads = self._read_all()

    def __next__(self) -> bytes:
        return next(self._payloads)

    def _read_all(self) -> Iterator[bytes]:
        meta = read_go_metadata(self.name, self._files.directory)
        segments = self._files.segments()
        first, position = (meta.read_file, meta.read_position) if meta else (segments[0] if segments else 0, 0)
        for number in segments:
            if number >= first:
                yield from self._read_segment(number, position if number == first else 0)

    def _read_segment(self, number: int, position: int) -> Iterator[bytes]:
        path = self._files.segment_path(number)
        with open(path, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            stream.seek(position)
            while position < size:
                header = stream.read(4)
                length = _LENGTH.unpack(header)[0] if len(header) == 4 else None
                if length is not None and not self._min <= length <= self._max:
                    self._skip(path, position, size, f"invalid length {length}")
                    return
                payload = stream.read(length) if length is not None else b""
                if length is None or len(payload) < length:
                    self._skip(path, position, size, "torn record at end of file")
                    return
                position += 4 + length
                self.records += 1
                yield payload

    def _skip(self, path: Path, position: int, size: int, reason: str) -> None:
        self.skipped_records += 1
        self.skipped_bytes += size - position
        logger.warning(
            "diskq_go_records_skipped", path=str(path), position=position, skipped_bytes=size - position, reason=reason
        )


def iter_go_queue(
    name: str,
    data_path: str | os.PathLike[str],
    *,
    min_msg_size: int = GO_MIN_MSG_SIZE,
    max_msg_size: int = GO_MAX_MSG_SIZE,
) -> GoQueueRecords:
    """Iterate the unread payloads of Go nsqd's queue ``name`` (see :class:`GoQueueRecords`)."""
    return GoQueueRecords(name, data_path, min_msg_size, max_msg_size)


def remove_go_queue(name: str, data_path: str | os.PathLike[str]) -> None:
    """Delete every file of Go nsqd's queue ``name``, once its records are imported."""
    files = _GoFiles(name, data_path)
    paths = [files.segment_path(n) for n in files.segments()]
    paths += [files.directory / leftover for leftover in files.leftovers()]
    paths.append(files.metadata_path)
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
