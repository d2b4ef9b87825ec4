"""The metadata file: where reading, writing and releasing stand, and the depth.

Metadata is a hint that saves a full scan on open, never the source of
truth: it carries a checksum and recovery checks it against the segment
files. It lives in three files. The metadata file is replaced atomically
(temp file, fsync, rename, fsync directory) on open, empty and close; two
checkpoint files are overwritten in place in turn by the checkpoints in
between, one ``pwrite`` each, fsynced by the queue's next commit round (a
rename costs a few hundred microseconds, a ``pwrite`` a few). Each save
carries a sequence number and the newest valid file wins, so a torn
checkpoint falls back to the one before: records finished since then are
delivered again, none is lost.

Version 3 adds the sequence number; version 2 the release point. Records before it are finished and their
segments may go; records between it and the read position were read but
may still be unfinished: ``kept`` lists those that are, as inclusive
position intervals, each with an optional note from the queue's owner
(for nsqd: attempts, due time, lease). Version 1 and 2 files are still
read: their sequence is 0 and a version 1 release point is its read position.
"""

from __future__ import annotations

import errno
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .naming import fsync_directory
from .reserve import reserve_now

METADATA_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)

#: one kept interval: first and last position (inclusive), and an optional note
Kept = tuple[int, int, object]


@dataclass(frozen=True)
class Metadata:
    read_segment: int
    read_position: int
    write_segment: int
    write_position: int
    depth: int
    release_segment: int = -1
    """-1: the same as the read position (version 1, or nothing kept)."""
    release_position: int = 0
    kept: tuple[Kept, ...] = field(default=())
    kept_count: int = 0
    """How many records the kept intervals hold (part of ``depth`` once reopened)."""
    sequence: int = 0
    """Grows with every save: of the metadata and checkpoint files, the higher one is newer."""

    @property
    def release(self) -> tuple[int, int]:
        if self.release_segment < 0:
            return self.read_segment, self.read_position
        return self.release_segment, self.release_position


_INT_FIELDS = ("read_segment", "read_position", "write_segment", "write_position", "depth")
_FIELDS = (*_INT_FIELDS, "release_segment", "release_position", "kept", "kept_count", "sequence")


def _checksum(fields: dict) -> int:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return zlib.crc32(canonical.encode("ascii"))


def encode_metadata(meta: Metadata) -> bytes:
    """The fields as compact JSON with sorted keys (what the checksum is taken of), and the
    checksum added last: one serialisation, which for a channel keeping 100,000 deferred
    messages' notes is most of a checkpoint's cost."""
    fields = {"version": METADATA_VERSION, **{name: getattr(meta, name) for name in _FIELDS}}
    fields["kept"] = [(first, last) if note is None else (first, last, note) for first, last, note in meta.kept]
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("ascii")
    return b"%s,\"checksum\":%d}\n" % (canonical[:-1], zlib.crc32(canonical))


def decode_metadata(data: bytes) -> Metadata:
    """Parse metadata, raising ValueError on anything not written by :func:`encode_metadata`."""
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    checksum = document.pop("checksum", None)
    version = document.get("version")
    if version not in _READABLE_VERSIONS:
        raise ValueError(f"unsupported metadata version {version!r}")
    if checksum != _checksum(document):
        raise ValueError("checksum mismatch")
    del document["version"]
    kept = document.pop("kept", [])
    if not isinstance(kept, list) or not all(_kept_ok(k) for k in kept):
        raise ValueError("kept intervals must be [first, last] or [first, last, note] with first <= last")
    try:
        meta = Metadata(**document, kept=tuple((k[0], k[1], k[2] if len(k) > 2 else None) for k in kept))
    except TypeError as exc:
        raise ValueError(f"wrong fields ({exc})") from None
    ints = [getattr(meta, name) for name in (*_INT_FIELDS, "release_position", "kept_count", "sequence")]
    if not all(type(value) is int and value >= 0 for value in ints) or type(meta.release_segment) is not int:
        raise ValueError("fields must be non-negative integers")
    return meta


def _kept_ok(item: object) -> bool:
    return (isinstance(item, list) and len(item) in (2, 3) and type(item[0]) is int and type(item[1]) is int
            and 0 <= item[0] <= item[1])


def load_metadata(path: Path) -> Metadata | None:
    """The saved metadata; None if missing. Raises ValueError if unusable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return decode_metadata(data)


def load_newest(paths: Sequence[Path]) -> tuple[Metadata | None, list[tuple[Path, str]]]:
    """The valid saved metadata with the highest sequence, and why the unusable files were not used."""
    newest: Metadata | None = None
    unusable: list[tuple[Path, str]] = []
    for path in paths:
        try:
            meta = load_metadata(path)
        except (ValueError, OSError) as exc:
            unusable.append((path, str(exc)))
            continue
        if meta is not None and (newest is None or meta.sequence > newest.sequence):
            newest = meta
    return newest, unusable


def save_metadata(path: Path, meta: Metadata) -> None:
    """Replace the metadata file atomically and durably (fsync of the file and the directory)."""
    temporary = stage_metadata(path, meta, fsync=True)
    os.replace(temporary, path)
    fsync_directory(path.parent)


def stage_metadata(path: Path, meta: Metadata, *, fsync: bool) -> Path:
    """Write ``meta`` to the metadata file's temporary file (for a rename over it); returns its path.
    Without ``fsync`` the caller makes it durable before the rename (see ``queue.close_many``)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as stream:
        stream.write(encode_metadata(meta))
        stream.flush()
        if fsync:
            os.fsync(stream.fileno())
    return temporary


class CheckpointFile:
    """The checkpoint files: two slots, each overwritten in place, saved in turn.

    A save is one ``pwrite`` into the page cache: it survives the process
    being killed. For a power loss, the queue's next commit round fsyncs the
    slot saved last (:meth:`unsynced_fd`, :meth:`synced`), and a save never
    goes over the newest slot a sync covered: after a power loss the slot a
    save may have torn (or left as zeros, in blocks reserved but not yet
    written back) loses to that one, and records finished since the save
    before last are delivered again. With one file, torn, recovery fell back
    to the metadata file saved when the queue opened, and every record
    finished since came back.

    A save that changed only where writing stands (and the depth) from the
    synced one needs no sync: were it lost, recovery would deliver nothing
    again, only scan the segments from the older write position. So a queue
    that is only written pays no fsync for its checkpoints.
    """

    def __init__(self, paths: tuple[Path, Path]) -> None:
        self._slots = (_Slot(paths[0]), _Slot(paths[1]))
        #: the slot saved last, and its read state (see _read_state); None: neither since removed
        self._current: int | None = None
        self._current_state: tuple = ()
        #: the slot of the newest save a sync covered, never written over, and its read state
        self._synced: int | None = None
        self._synced_state: tuple = ()

    def save(self, meta: Metadata) -> None:
        if self._synced is not None:
            target = 1 - self._synced
        else:
            target = 0 if self._current is None else self._current
        self._slots[target].save(encode_metadata(meta))
        self._current, self._current_state = target, _read_state(meta)

    def unsynced_fd(self) -> int | None:
        """The open descriptor of the slot saved last, if a sync should cover it: its read state
        differs from the synced one's."""
        if self._current is None or self._current == self._synced:
            return None
        if self._synced is not None and self._current_state == self._synced_state:
            return None
        return self._slots[self._current].fd

    def synced(self, fd: int) -> None:
        """A sync of ``fd`` (from :meth:`unsynced_fd`) completed."""
        if self._current is not None and self._slots[self._current].fd == fd:
            self._synced, self._synced_state = self._current, self._current_state

    def remove(self) -> None:
        """Close and delete both slots (the metadata file now holds a newer save)."""
        for slot in self._slots:
            slot.remove()
        self._current = self._synced = None

    def close(self) -> None:
        for slot in self._slots:
            slot.close()


def _read_state(meta: Metadata) -> tuple:
    """What a checkpoint says about reading: where it stands and what is still kept."""
    return (meta.read_segment, meta.read_position, meta.release_segment, meta.release_position,
            meta.kept, meta.kept_count)


class _Slot:
    """One checkpoint file, overwritten in place (kept open while its queue is busy).

    The file is never emptied first (no ``O_TRUNC`` when it is opened again
    after its queue rested: a kill, or a full disk, right after the truncate
    left an empty file, and recovery went back to the metadata saved at
    open). A shorter document is written padded with blanks to the old size,
    which JSON ignores, and cut to size after; a longer one gets its blocks
    reserved first, so a full disk refuses the save before anything is
    overwritten (a short write had torn the file: every FIN since the open
    came back). Should a write fail all the same, the last document goes
    back in its place. Short of a power loss, every state the file passes
    through is a valid document.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self._size = 0
        #: the document the file holds, to put back if a save fails part-way
        self._saved = b""

    def save(self, data: bytes) -> None:
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._size = os.fstat(self.fd).st_size
            self._saved = os.pread(self.fd, self._size, 0)
        size = len(data)
        if size < self._size:
            data += b" " * (self._size - size)
        elif size > self._size:
            reserve_now(self.fd, 0, size)
        try:
            written = os.pwrite(self.fd, data, 0)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write of {self.path} ({written} of {len(data)} bytes)")
        except OSError:
            self._put_back()
            raise
        if size < self._size:
            os.ftruncate(self.fd, size)
        self._size = size
        self._saved = data[:size]

    def _put_back(self) -> None:
        """Write the last document over a torn save (its blocks are the file's already)."""
        try:
            os.pwrite(self.fd, self._saved, 0)
            os.ftruncate(self.fd, self._size)  # a longer save may have extended the file part-way
        except OSError:
            pass

    def remove(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
