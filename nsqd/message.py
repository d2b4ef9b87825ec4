"""The message, held as its encoded wire frame.

A message lives its whole life as one immutable ``bytes`` object: the complete
NSQ message frame ``size(4) | type=2(4) | ts(8) | attempts(2) | id(16) | body``.
It is encoded once at publish; only a redelivery re-encodes it (to bump the
attempts field). Channels share the same frame objects, so fan-out copies
nothing and there is no Python object per message on the hot path.

The disk record payload (see docs/diskq-format.md) of a plain message is the
frame itself, so spilling to disk and reading back copy nothing. A message
with extra fields (due time, failed deliveries, room for more) is stored as
``0(4) | 255(4) | ext_len(2) | ext | ts(8) | attempts(2) | id(16) | body``:
the wire message behind a block of TLV fields, so the format can grow
without a break. The second word tells the two apart.
"""

from __future__ import annotations

import operator
from itertools import repeat
import struct

FRAME_TYPE_RESPONSE = 0
FRAME_TYPE_ERROR = 1
FRAME_TYPE_MESSAGE = 2

MSG_ID_LENGTH = 16
#: bytes of a message frame before the body
FRAME_OVERHEAD = 8 + 8 + 2 + MSG_ID_LENGTH
#: the size field counts everything after itself
_SIZE_OVERHEAD = FRAME_OVERHEAD - 4

_HEADER = struct.Struct(">iiqH")
_ATTEMPTS = struct.Struct(">H")
_FRAME_HEAD = struct.Struct(">ii")
_EXT_LEN = struct.Struct(">H")
_TLV_HEAD = struct.Struct(">BB")
_U64 = struct.Struct(">Q")

EXT_DUE_NS = 1
EXT_FAILED = 2


def encode_header(body_len: int, timestamp_ns: int, attempts: int = 1) -> bytes:
    """The 26 bytes in front of a message's id and body."""
    return _HEADER.pack(body_len + _SIZE_OVERHEAD, FRAME_TYPE_MESSAGE, timestamp_ns, attempts)


def encode_frame(msg_id: bytes, body: bytes, timestamp_ns: int, attempts: int = 1) -> bytes:
    return b"".join((encode_header(len(body), timestamp_ns, attempts), msg_id, body))


def encode_frames(ids: list[bytes], bodies, timestamp_ns: int) -> list[bytes]:
    """Frames for a batch (one timestamp): a header per run of equal body sizes, one join per message.

    Bodies may be memoryview slices of a received MPUB: joining copies each
    body once, straight into its frame.
    """
    join = b"".join
    if len(bodies) == 1:  # a single PUB
        return [join((encode_header(len(bodies[0]), timestamp_ns), ids[0], bodies[0]))]
    sizes = list(map(len, bodies))
    if sizes and sizes.count(sizes[0]) == len(sizes):  # one size (the usual batch): joined in C
        return list(map(join, zip(repeat(encode_header(sizes[0], timestamp_ns)), ids, bodies)))
    frames: list[bytes] = []
    append = frames.append
    last_size = -1
    header = b""
    for msg_id, body in zip(ids, bodies):
        size = len(body)
        if size != last_size:
            header = encode_header(size, timestamp_ns)
            last_size = size
        append(join((header, msg_id, body)))
    return frames


def encode_response(data: bytes) -> bytes:
    return _FRAME_HEAD.pack(len(data) + 4, FRAME_TYPE_RESPONSE) + data


def encode_error(data: bytes) -> bytes:
    return _FRAME_HEAD.pack(len(data) + 4, FRAME_TYPE_ERROR) + data


def frame_id(frame: bytes) -> bytes:
    return frame[18:34]


#: ``frame_id`` as a C-level callable, for ``map`` over many frames
frame_id_of = operator.itemgetter(slice(18, 34))


def frame_attempts(frame: bytes) -> int:
    return _ATTEMPTS.unpack_from(frame, 16)[0]


def frame_timestamp(frame: bytes) -> int:
    return struct.unpack_from(">q", frame, 8)[0]


def frame_body(frame: bytes) -> bytes:
    return frame[FRAME_OVERHEAD:]


def with_attempts(frame: bytes, attempts: int) -> bytes:
    """The same message with a new attempts count (saturating at 65535)."""
    return b"".join((frame[:16], _ATTEMPTS.pack(min(attempts, 0xFFFF)), frame[18:]))


def next_attempt(frame: bytes) -> bytes:
    """The frame to store for a message going back to the queue after a delivery."""
    return with_attempts(frame, frame_attempts(frame) + 1)


#: second word of a payload: a plain frame, or an extended record
PLAIN_KIND = b"\x00\x00\x00\x02"
EXTENDED_KIND = b"\x00\x00\x00\xff"
_EXTENDED_HEAD = b"\x00\x00\x00\x00" + EXTENDED_KIND


def to_disk(frame: bytes, due_ns: int = 0, failed: int = 0) -> bytes:
    """Disk record payload for a frame: the frame itself unless it has extra fields."""
    if not due_ns and not failed:
        return frame
    ext = b""
    if due_ns:
        ext += _TLV_HEAD.pack(EXT_DUE_NS, 8) + _U64.pack(due_ns)
    if failed:
        ext += _TLV_HEAD.pack(EXT_FAILED, 2) + _ATTEMPTS.pack(min(failed, 0xFFFF))
    return b"".join((_EXTENDED_HEAD, _EXT_LEN.pack(len(ext)), ext, frame[8:]))


class BadRecord(ValueError):
    """A disk payload that does not decode as a message."""


def from_disk(payload: bytes) -> tuple[bytes, int, int]:
    """Decode a disk payload into ``(frame, due_ns, failed)``.

    Unknown extension fields are skipped, so older code reads newer records.
    """
    kind = payload[4:8]
    if kind == PLAIN_KIND:
        if len(payload) < FRAME_OVERHEAD or _FRAME_HEAD.unpack_from(payload)[0] != len(payload) - 4:
            raise BadRecord("message frame with a wrong size")
        return payload, 0, 0
    if kind != EXTENDED_KIND or len(payload) < 10:
        raise BadRecord("not a message record")
    ext_len = _EXT_LEN.unpack_from(payload, 8)[0]
    start = 10 + ext_len
    if len(payload) < start + FRAME_OVERHEAD - 8:
        raise BadRecord("record shorter than a message header")
    due_ns = failed = 0
    pos = 10
    while pos < start:
        if pos + 2 > start:
            raise BadRecord("truncated extension field")
        kind_, size = _TLV_HEAD.unpack_from(payload, pos)
        pos += 2
        if pos + size > start:
            raise BadRecord("extension field overruns its block")
        if kind_ == EXT_DUE_NS and size == 8:
            due_ns = _U64.unpack_from(payload, pos)[0]
        elif kind_ == EXT_FAILED and size == 2:
            failed = _ATTEMPTS.unpack_from(payload, pos)[0]
        pos += size
    wire = payload[start:]
    frame = _FRAME_HEAD.pack(len(wire) + 4, FRAME_TYPE_MESSAGE) + wire
    return frame, due_ns, failed


def from_go_message(data: bytes) -> bytes:
    """A frame from a Go nsqd message record (``ts | attempts | id | body``)."""
    if len(data) < FRAME_OVERHEAD - 8:
        raise BadRecord("Go message shorter than its header")
    return _FRAME_HEAD.pack(len(data) + 4, FRAME_TYPE_MESSAGE) + data
