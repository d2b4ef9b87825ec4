"""Segment headers, record encoding and the resynchronising record scan.

A record is ``length (uint32 BE) | crc (uint32 BE) | payload`` where ``crc``
is the CRC-32C (Castagnoli, computed in hardware where the CPU has it) of the
four length bytes followed by the payload: a damaged length fails the check
instead of sending the reader to a wrong offset. When
a record fails, :func:`find_next_record` searches forward byte by byte for
the next record that verifies, so damage costs only the damaged records.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from enum import Enum
from itertools import repeat

from crc32c import crc32c


MAGIC = b"NSQDSKQ\n"
FORMAT_VERSION = 1
SEGMENT_HEADER_SIZE = 16
RECORD_HEADER_SIZE = 8
MAX_RECORD_LENGTH = 0xFFFFFFFF

_SEGMENT_HEADER = struct.Struct(">8sHHI")  # magic, version, flags, reserved
_RECORD_HEADER = struct.Struct(">II")
_LENGTH = struct.Struct(">I")

SCAN_WINDOW = 1 << 20

OFFSET_BITS = 32
MAX_SEGMENT_BYTES = 1 << OFFSET_BITS
"""Segments stay below 4 GiB, so a record's offset fits the low 32 bits of its position."""


def position(segment: int, offset: int) -> int:
    """A record's position: its segment number and byte offset in one ordered integer."""
    return segment << OFFSET_BITS | offset


def split_position(pos: int) -> tuple[int, int]:
    return pos >> OFFSET_BITS, pos & (MAX_SEGMENT_BYTES - 1)

Fetch = Callable[[int, int], bytes]
"""``fetch(position, size)`` returns the bytes there; fewer only at the data end."""


def segment_header() -> bytes:
    return _SEGMENT_HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0)


class HeaderState(Enum):
    VALID = "valid"
    TORN = "torn"  # shorter than a header: the file was cut while being created
    BAD_MAGIC = "bad magic"
    OTHER_VERSION = "other version"  # damaged, or another format: its first record tells


def check_segment_header(data: bytes) -> HeaderState:
    """Classify a segment's first bytes."""
    if len(data) < SEGMENT_HEADER_SIZE:
        return HeaderState.TORN
    magic, version, _flags, _reserved = _SEGMENT_HEADER.unpack_from(data)
    if magic != MAGIC:
        return HeaderState.BAD_MAGIC
    if version != FORMAT_VERSION:
        return HeaderState.OTHER_VERSION
    return HeaderState.VALID


def header_version(data: bytes) -> int:
    return _SEGMENT_HEADER.unpack_from(data)[1]


def first_record_is_ours(read: Callable[[int], bytes], size: int) -> bool:
    """Whether what follows a segment header is one of our records (or nothing): ``read(n)``
    reads on from the header, ``size`` bytes being left. A header whose version is not ours over
    records that verify was damaged, not written by another format."""
    head = read(RECORD_HEADER_SIZE)
    if len(head) < RECORD_HEADER_SIZE:
        return True
    length, crc = _RECORD_HEADER.unpack(head)
    if length > size - RECORD_HEADER_SIZE:
        return False
    return crc32c(read(length), crc32c(head[:4])) == crc


def encode_record(payload: bytes) -> bytes:
    """Encode one record; cheaper than a batch of one."""
    length = _LENGTH.pack(len(payload))
    return length + _LENGTH.pack(crc32c(payload, crc32c(length))) + payload


#: records :func:`parse_records` checks and cuts, and :func:`encode_records` packs, with one struct
BLOCK_RECORDS = 64
_BLOCK_FORMATS: dict[int, struct.Struct] = {}


def _block_format(length: int) -> struct.Struct:
    """``BLOCK_RECORDS`` records of one payload length, as one struct (cached for a few lengths)."""
    block = _BLOCK_FORMATS.get(length)
    if block is None:
        if len(_BLOCK_FORMATS) >= 16:
            _BLOCK_FORMATS.clear()
        block = _BLOCK_FORMATS[length] = struct.Struct(">" + f"II{length}s" * BLOCK_RECORDS)
    return block


def encode_records(payloads: Sequence[bytes]) -> bytes:
    """Encode a batch with a few C-level calls per record and one join.

    Records of one length (a batch of equal-size messages, the usual MPUB)
    share their length's checksum seed, and are packed ``BLOCK_RECORDS`` at
    a time by one struct.
    """
    crc32 = crc32c
    count = len(payloads)
    lengths = list(map(len, payloads))
    if count >= BLOCK_RECORDS and lengths.count(lengths[0]) == count:
        try:
            return _encode_one_length(payloads, lengths[0])
        except struct.error:  # a payload that is not bytes (a memoryview): the general way below
            pass
    parts: list[bytes] = [b""] * (2 * count)
    parts[0::2] = list(
        map(_RECORD_HEADER.pack, lengths, map(crc32, payloads, map(crc32, map(_LENGTH.pack, lengths))))
    )
    parts[1::2] = payloads
    return b"".join(parts)


def _encode_one_length(payloads: Sequence[bytes], length: int) -> bytes:
    count = len(payloads)
    crcs = list(map(crc32c, payloads, repeat(crc32c(_LENGTH.pack(length)), count)))
    block = _block_format(length).pack
    fields: list = [length] * (3 * BLOCK_RECORDS)
    out: list[bytes] = []
    whole = count - count % BLOCK_RECORDS
    for start in range(0, whole, BLOCK_RECORDS):
        fields[1::3] = crcs[start:start + BLOCK_RECORDS]
        fields[2::3] = payloads[start:start + BLOCK_RECORDS]
        out.append(block(*fields))
    if whole < count:
        rest = count - whole
        parts: list[bytes] = [b""] * (2 * rest)
        parts[0::2] = list(map(_RECORD_HEADER.pack, repeat(length, rest), crcs[whole:]))
        parts[1::2] = payloads[whole:]
        out.append(b"".join(parts))
    return b"".join(out)


class Outcome(Enum):
    COUNT_REACHED = 1
    SHORT = 2  # the buffer ends inside a record header or payload
    DAMAGED = 3  # the record at the returned offset has a bad length or checksum


def parse_records(
    buf: bytes,
    offset: int,
    max_count: int,
    min_size: int,
    max_size: int,
    out: list[bytes],
    marks: list[int] | None = None,
) -> tuple[int, int, Outcome]:
    """Append consecutive valid payloads from ``buf[offset:]`` to ``out``.

    ``marks``, when given, receives the offset in ``buf`` of each record.
    Returns the offset after the last good record, how many were appended
    and why parsing stopped. This loop is the read hot path: a run of
    records of one length (what a producer of fixed-size messages writes) is
    cut ``BLOCK_RECORDS`` at a time by one ``unpack_from``, their lengths
    compared in bulk and their checksums computed by ``map``; anything else,
    damage included, goes record by record.
    """
    crc32 = crc32c
    unpack_from = _RECORD_HEADER.unpack_from
    end = len(buf)
    count = 0
    last_length = -1  # the previous record's length; ``seed`` is the checksum of its length bytes
    seed = 0
    slow_until = 0  # after a block that did not verify, record by record for a block's worth
    while count < max_count:
        body = offset + RECORD_HEADER_SIZE
        if body > end:
            return offset, count, Outcome.SHORT
        length, crc = unpack_from(buf, offset)
        if length < min_size or length > max_size:
            return offset, count, Outcome.DAMAGED
        stride = RECORD_HEADER_SIZE + length
        if (length == last_length and count >= slow_until and count + BLOCK_RECORDS <= max_count
                and offset + stride * BLOCK_RECORDS <= end):
            fields = _block_format(length).unpack_from(buf, offset)
            payloads = fields[2::3]
            if (fields[0::3].count(length) == BLOCK_RECORDS
                    and list(map(crc32, payloads, repeat(seed, BLOCK_RECORDS))) == list(fields[1::3])):
                out += payloads
                if marks is not None:
                    marks += range(offset, offset + stride * BLOCK_RECORDS, stride)
                offset += stride * BLOCK_RECORDS
                count += BLOCK_RECORDS
                continue
            slow_until = count + BLOCK_RECORDS
        stop = body + length
        if stop > end:
            return offset, count, Outcome.SHORT
        if length != last_length:
            seed = crc32(buf[offset:body - 4])
            last_length = length
        payload = buf[body:stop]
        if crc32(payload, seed) != crc:
            return offset, count, Outcome.DAMAGED
        out.append(payload)
        if marks is not None:
            marks.append(offset)
        offset = stop
        count += 1
    return offset, count, Outcome.COUNT_REACHED


def record_length_at(buf: bytes, offset: int) -> int | None:
    """The length field at ``offset``, or None if the header is not all there."""
    if offset + RECORD_HEADER_SIZE > len(buf):
        return None
    return _LENGTH.unpack_from(buf, offset)[0]


def find_next_record(fetch: Fetch, start: int, limit: int, min_size: int, max_size: int) -> int | None:
    """First position in ``[start, limit)`` where a whole valid record begins.

    When ``max_size`` fits in 24 bits a record's first length byte is zero, so
    candidates are found with ``bytes.find`` instead of trying every byte.
    """
    crc32 = crc32c
    unpack_from = _RECORD_HEADER.unpack_from
    zero_lead = max_size < 1 << 24
    position = start
    while position + RECORD_HEADER_SIZE <= limit:
        window = fetch(position, min(SCAN_WINDOW, limit - position))
        last = len(window) - RECORD_HEADER_SIZE
        if last < 0:
            return None
        candidate = 0
        while candidate <= last:
            if zero_lead:
                candidate = window.find(b"\0", candidate, last + 1)
                if candidate < 0:
                    break
            length, crc = unpack_from(window, candidate)
            body = candidate + RECORD_HEADER_SIZE
            if min_size <= length <= max_size and position + body + length <= limit:
                if body + length <= len(window):
                    payload = window[body:body + length]
                else:
                    payload = fetch(position + body, length)
                if crc32(payload, crc32(window[candidate:body - 4])) == crc:
                    return position + candidate
            candidate += 1
        position += last + 1
    return None


class ScanResult:
    """What a scan of one segment region found."""

    __slots__ = ("records", "end", "damaged_regions", "damaged_bytes")

    def __init__(self, start: int) -> None:
        self.records = 0
        self.end = start  # just past the last valid record
        self.damaged_regions = 0
        self.damaged_bytes = 0


def scan_records(fetch: Fetch, start: int, limit: int, min_size: int, max_size: int) -> ScanResult:
    """Count the valid records in ``[start, limit)``, skipping damage."""
    result = ScanResult(start)
    position = start
    want = SCAN_WINDOW
    while position < limit:
        asked = min(want, limit - position)
        window = fetch(position, asked)
        offset, count, outcome = parse_records(window, 0, 1 << 62, min_size, max_size, [])  # bounded by the window
        result.records += count
        more_data = len(window) == asked and position + asked < limit
        position += offset
        if count:
            result.end = position
        want = SCAN_WINDOW
        if outcome is Outcome.SHORT and more_data:
            length = record_length_at(window, offset)
            if length is not None:
                want = max(SCAN_WINDOW, RECORD_HEADER_SIZE + length)
            continue
        if position >= limit:
            break
        resume = find_next_record(fetch, position + 1, limit, min_size, max_size)
        damaged_to = limit if resume is None else resume
        result.damaged_regions += 1
        result.damaged_bytes += damaged_to - position
        position = damaged_to
    return result
