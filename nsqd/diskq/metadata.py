"""The metadata file: where reading, writing and releasing stand, and the depth.

Metadata is a hint that saves a full scan on open, never the source of
truth: it carries a checksum, is replaced atomically (temp file, fsync,
rename, fsync directory), and recovery checks it against the segment files.

Version 2 adds the release point. Records before it are finished and their
segments may go; records between it and the read position were read but
may still be unfinished: ``kept`` lists those that are, as inclusive
position intervals, each with an optional note from the queue's owner
(for nsqd: attempts, due time, lease). Version 1 files (no release point)
are still read: their release point is their read position.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from .naming import fsync_directory

METADATA_VERSION = 2
_READABLE_VERSIONS = (1, 2)

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

    @property
    def release(self) -> tuple[int, int]:
        if self.release_segment < 0:
            return self.read_segment, self.read_position
        return self.release_segment, self.release_position


_INT_FIELDS = ("read_segment", "read_position", "write_segment", "write_position", "depth")
_FIELDS = (*_INT_FIELDS, "release_segment", "release_position", "kept", "kept_count")


def _checksum(fields: dict) -> int:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return zlib.crc32(canonical.encode("ascii"))


def encode_metadata(meta: Metadata) -> bytes:
    fields = {"version": METADATA_VERSION, **{name: getattr(meta, name) for name in _FIELDS}}
    fields["kept"] = [[first, last] if note is None else [first, last, note] for first, last, note in meta.kept]
    return (json.dumps({**fields, "checksum": _checksum(fields)}, sort_keys=True) + "\n").encode("ascii")


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
    ints = [getattr(meta, name) for name in (*_INT_FIELDS, "release_position", "kept_count")]
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


def save_metadata(path: Path, meta: Metadata, durable: bool = True) -> None:
    """Replace the metadata file atomically; with ``durable``, also fsync it and the directory.

    Checkpoints save without fsync: the new file survives a crash of the
    process, and after a power loss an older (or unreadable) one only means
    that records finished since then are delivered again, never that one is
    lost (the metadata is a hint: recovery checks it against the files).
    """
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as stream:
        stream.write(encode_metadata(meta))
        if durable:
            stream.flush()
            os.fsync(stream.fileno())
    os.replace(temporary, path)
    if durable:
        fsync_directory(path.parent)
