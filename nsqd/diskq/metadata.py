"""The metadata file: where reading and writing stand, and the depth.

Metadata is a hint that saves a full scan on open, never the source of
truth: it carries a checksum, is replaced atomically (temp file, fsync,
rename, fsync directory), and recovery checks it against the segment files.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from .naming import fsync_directory

METADATA_VERSION = 1


@dataclass(frozen=True)
class Metadata:
    read_segment: int
    read_position: int
    write_segment: int
    write_position: int
    depth: int


def _checksum(fields: dict[str, int]) -> int:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return zlib.crc32(canonical.encode("ascii"))


def encode_metadata(meta: Metadata) -> bytes:
    fields = {"version": METADATA_VERSION, **asdict(meta)}
    return (json.dumps({**fields, "checksum": _checksum(fields)}, sort_keys=True) + "\n").encode("ascii")


def decode_metadata(data: bytes) -> Metadata:
    """Parse metadata, raising ValueError on anything not written by :func:`encode_metadata`."""
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    checksum = document.pop("checksum", None)
    if document.get("version") != METADATA_VERSION:
        raise ValueError(f"unsupported metadata version {document.get('version')!r}")
    if checksum != _checksum(document):
        raise ValueError("checksum mismatch")
    del document["version"]
    try:
        meta = Metadata(**document)
    except TypeError as exc:
        raise ValueError(f"wrong fields ({exc})") from None
    if not all(type(value) is int and value >= 0 for value in asdict(meta).values()):
        raise ValueError("fields must be non-negative integers")
    return meta


def load_metadata(path: Path) -> Metadata | None:
    """The saved metadata; None if missing. Raises ValueError if unusable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return decode_metadata(data)


def save_metadata(path: Path, meta: Metadata) -> None:
    """Replace the metadata file atomically and durably."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as stream:
        stream.write(encode_metadata(meta))
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)
