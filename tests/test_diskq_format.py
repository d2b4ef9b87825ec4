"""Unit tests of the record codec, file naming and metadata encoding."""

import dataclasses
import errno
import json
import os
import struct
import zlib

from crc32c import crc32c

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nsqd.diskq.errors import DiskQueueError
from nsqd.diskq.metadata import (
    CheckpointFile,
    Metadata,
    decode_metadata,
    encode_metadata,
    load_metadata,
    load_newest,
    save_metadata,
)
from nsqd.diskq.naming import QueueFiles, escape_name
from nsqd.diskq.records import (
    BLOCK_RECORDS,
    SEGMENT_HEADER_SIZE,
    HeaderState,
    Outcome,
    check_segment_header,
    encode_record,
    encode_records,
    find_next_record,
    parse_records,
    scan_records,
    segment_header,
)


def fetch_from(data: bytes):
    return lambda position, size: data[position:position + size]


def test_record_layout_is_length_crc_payload():
    encoded = encode_records([b"hello"])
    length, crc = struct.unpack(">II", encoded[:8])
    assert length == 5
    assert crc == crc32c(b"\x00\x00\x00\x05hello")
    assert encoded[8:] == b"hello"


def test_documented_example_record():
    assert encode_record(b"hello") == bytes.fromhex("00000005 3923f9b4 68656c6c6f")


def test_single_and_batch_encodings_agree():
    payloads = [b"", b"abc", bytes(range(256)) * 3]
    assert b"".join(encode_record(p) for p in payloads) == encode_records(payloads)


def parse_one_by_one(buf, offset, max_count, min_size, max_size):
    """The record format read the plain way: what parse_records must agree with."""
    out, marks, count = [], [], 0
    while count < max_count:
        if offset + 8 > len(buf):
            return offset, out, marks, Outcome.SHORT
        length, crc = struct.unpack_from(">II", buf, offset)
        if not min_size <= length <= max_size:
            return offset, out, marks, Outcome.DAMAGED
        if offset + 8 + length > len(buf):
            return offset, out, marks, Outcome.SHORT
        if crc32c(buf[offset:offset + 4] + buf[offset + 8:offset + 8 + length]) != crc:
            return offset, out, marks, Outcome.DAMAGED
        out.append(buf[offset + 8:offset + 8 + length])
        marks.append(offset)
        offset += 8 + length
        count += 1
    return offset, out, marks, Outcome.COUNT_REACHED


@settings(max_examples=300, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 3 * BLOCK_RECORDS)), min_size=1, max_size=5),
    damage=st.one_of(st.none(), st.floats(0, 1)),
    cut=st.integers(0, 30),
    max_count=st.integers(1, 6 * BLOCK_RECORDS),
    start=st.integers(0, 2),
)
def test_blocks_of_one_length_parse_as_records_one_by_one(runs, damage, cut, max_count, start):
    payloads = [bytes([n % 251]) * length for n, (length, times) in enumerate(runs) for _ in range(times)]
    skip = encode_records(payloads[:start])
    buf = bytearray(encode_records(payloads))
    if damage is not None:
        buf[int(damage * (len(buf) - 1))] ^= 0x41
    buf = bytes(buf[:len(buf) - cut])
    out, marks = [], []
    offset, count, outcome = parse_records(buf, len(skip), max_count, 0, 40, out, marks)
    want_offset, want_out, want_marks, want_outcome = parse_one_by_one(buf, len(skip), max_count, 0, 40)
    assert (offset, out, marks, outcome) == (want_offset, want_out, want_marks, want_outcome)
    assert count == len(want_out)


@pytest.mark.parametrize("count", [1, BLOCK_RECORDS - 1, BLOCK_RECORDS, BLOCK_RECORDS + 1, 3 * BLOCK_RECORDS + 7])
def test_batches_of_one_length_encode_as_single_records(count):
    payloads = [b"%09d" % i for i in range(count)]
    assert encode_records(payloads) == b"".join(map(encode_record, payloads))
    views = [memoryview(p) for p in payloads]
    assert encode_records(views) == b"".join(map(encode_record, payloads))


def test_a_damaged_record_inside_a_block_stops_there():
    payloads = [b"%07d" % i for i in range(3 * BLOCK_RECORDS)]
    buf = bytearray(encode_records(payloads))
    bad = BLOCK_RECORDS + 5
    buf[bad * 15 + 10] ^= 1  # a payload byte of record ``bad`` (15 bytes a record)
    out: list[bytes] = []
    offset, count, outcome = parse_records(bytes(buf), 0, 1000, 0, 100, out)
    assert (offset, count, outcome) == (bad * 15, bad, Outcome.DAMAGED)
    assert out == payloads[:bad]


def test_encode_then_parse_round_trips_in_order():
    payloads = [b"", b"a", b"\x00" * 300, bytes(range(256))]
    out: list[bytes] = []
    offset, count, outcome = parse_records(encode_records(payloads), 0, 100, 0, 1000, out)
    assert out == payloads
    assert count == 4
    assert outcome is Outcome.SHORT
    assert offset == sum(8 + len(p) for p in payloads)


def test_parse_stops_at_count_and_on_short_buffer():
    data = encode_records([b"one", b"two", b"three"])
    out: list[bytes] = []
    offset, count, outcome = parse_records(data, 0, 2, 0, 100, out)
    assert (out, count, outcome) == ([b"one", b"two"], 2, Outcome.COUNT_REACHED)
    out.clear()
    assert parse_records(data[:-1], offset, 10, 0, 100, out) == (offset, 0, Outcome.SHORT)
    assert out == []


def test_corrupt_length_is_detected_by_checksum():
    data = bytearray(encode_records([b"abcdef", b"next"]))
    data[3] = 5  # length 6 -> 5: still in range, but the checksum covers the length
    out: list[bytes] = []
    assert parse_records(bytes(data), 0, 10, 0, 100, out) == (0, 0, Outcome.DAMAGED)
    assert out == []


def test_length_outside_limits_is_damage():
    data = encode_records([b"x" * 50])
    assert parse_records(data, 0, 10, 0, 49, [])[2] is Outcome.DAMAGED
    assert parse_records(data, 0, 10, 51, 100, [])[2] is Outcome.DAMAGED


def test_find_next_record_skips_garbage_between_records():
    good = encode_records([b"after"])
    data = encode_records([b"before"]) + b"\x00\x00\x00\x03garbage\x00\x01" + good
    start = len(encode_records([b"before"]))
    assert find_next_record(fetch_from(data), start, len(data), 0, 100) == len(data) - len(good)


def test_find_next_record_without_zero_lead_optimisation():
    good = encode_records([b"payload"])
    data = b"\xff" * 37 + good
    assert find_next_record(fetch_from(data), 0, len(data), 0, 1 << 30) == 37


def test_find_next_record_ignores_a_record_cut_by_the_limit():
    data = b"junk" + encode_records([b"tail"])
    assert find_next_record(fetch_from(data), 0, len(data) - 1, 0, 100) is None


def test_find_next_record_reads_payloads_beyond_its_window(monkeypatch):
    monkeypatch.setattr("nsqd.diskq.records.SCAN_WINDOW", 64)
    big = encode_records([b"z" * 500])
    data = b"\x01\x02\x03" + big
    assert find_next_record(fetch_from(data), 0, len(data), 0, 1000) == 3


def test_scan_counts_records_and_damage():
    first = encode_records([b"a" * 10, b"b" * 10])
    damaged = bytearray(encode_records([b"c" * 10]))
    damaged[-1] ^= 0xFF
    last = encode_records([b"d" * 10])
    data = first + bytes(damaged) + last + b"\x00\x00\x00"
    result = scan_records(fetch_from(data), 0, len(data), 0, 100)
    assert result.records == 3
    assert result.end == len(data) - 3
    assert result.damaged_regions == 2
    assert result.damaged_bytes == len(damaged) + 3


def test_scan_follows_records_longer_than_the_window(monkeypatch):
    monkeypatch.setattr("nsqd.diskq.records.SCAN_WINDOW", 100)
    data = encode_records([b"q" * 30, b"r" * 400, b"s" * 30])
    result = scan_records(fetch_from(data), 0, len(data), 0, 1000)
    assert (result.records, result.end, result.damaged_regions) == (3, len(data), 0)


def test_segment_header_states(tmp_path):
    assert check_segment_header(segment_header()) is HeaderState.VALID
    assert len(segment_header()) == SEGMENT_HEADER_SIZE
    assert check_segment_header(segment_header()[:9]) is HeaderState.TORN
    assert check_segment_header(b"X" * 16) is HeaderState.BAD_MAGIC
    newer = segment_header()[:8] + struct.pack(">H", 2) + segment_header()[10:]
    assert check_segment_header(newer) is HeaderState.OTHER_VERSION


@pytest.mark.parametrize(
    ("name", "escaped"),
    [
        ("orders", "orders"),
        ("orders:archive", "orders%3Aarchive"),
        ("t.x:ch#ephemeral", "t.x%3Ach%23ephemeral"),
        ("100%", "100%25"),
        ("a/b", "a%2Fb"),
        ("é", "%C3%A9"),
    ],
)
def test_names_are_escaped_reversibly(name, escaped):
    assert escape_name(name) == escaped


def test_bad_names_are_refused():
    with pytest.raises(DiskQueueError, match="empty"):
        escape_name("")
    with pytest.raises(DiskQueueError, match="too long"):
        escape_name(":" * 100)


def test_segment_listing_matches_only_this_queue(tmp_path):
    files = QueueFiles(tmp_path, "t:c")
    for name in ["t%3Ac.diskq.000001.dat", "t%3Ac.diskq.000010.dat", "t%3Ac.diskq.0000002.dat",
                 "t%3Acx.diskq.000003.dat", "t%3Ac.diskq.000004.dat.bad", "t%3Ac.diskq.meta.json"]:
        (tmp_path / name).write_bytes(b"")
    assert files.list_segments() == [1, 2, 10]
    assert files.segment_path(7).name == "t%3Ac.diskq.000007.dat"


def test_metadata_round_trip_and_rejections(tmp_path):
    meta = Metadata(read_segment=1, read_position=16, write_segment=3, write_position=999, depth=42)
    assert decode_metadata(encode_metadata(meta)) == meta
    path = tmp_path / "m.json"
    save_metadata(path, meta)
    assert load_metadata(path) == meta
    assert not (tmp_path / "m.json.tmp").exists()
    assert load_metadata(tmp_path / "missing.json") is None
    tampered = encode_metadata(meta).replace(b"42", b"43")
    for bad, reason in [
        (b"{garbage", "JSON"),
        (b"[1, 2]", "object"),
        (tampered, "checksum"),
        (encode_metadata(meta).replace(b'"version":3', b'"version":9'), "version"),
    ]:
        with pytest.raises(ValueError, match=reason):
            decode_metadata(bad)


def test_metadata_written_with_spaces_and_the_checksum_among_the_keys_is_still_read():
    """Files written before the checksum went last, in one serialisation, are read as they were."""
    fields = {"version": 3, "read_segment": 1, "read_position": 16, "write_segment": 3, "write_position": 999,
              "depth": 2, "release_segment": -1, "release_position": 0, "kept": [[20, 40], [50, 50, {"d": 7}]],
              "kept_count": 2, "sequence": 4}
    checksum = zlib.crc32(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    old = (json.dumps({**fields, "checksum": checksum}, sort_keys=True) + "\n").encode()
    meta = decode_metadata(old)
    assert (meta.depth, meta.kept, meta.sequence) == (2, ((20, 40, None), (50, 50, {"d": 7})), 4)
    assert decode_metadata(encode_metadata(meta)) == meta


def test_checkpoint_file_is_overwritten_in_place_and_the_newest_save_wins(tmp_path):
    meta_path, checkpoint_path = tmp_path / "m.json", tmp_path / "m.checkpoint.json"
    save_metadata(meta_path, Metadata(read_segment=0, read_position=16, write_segment=0, write_position=16,
                                      depth=0, sequence=4))
    checkpoint = CheckpointFile((checkpoint_path, tmp_path / "m.checkpoint.b.json"))
    long = Metadata(read_segment=1, read_position=16, write_segment=2, write_position=500, depth=9,
                    kept=tuple((i, i, {"a": i}) for i in range(50)), kept_count=50, sequence=5)
    checkpoint.save(long)
    inode = checkpoint_path.stat().st_ino
    short = Metadata(read_segment=2, read_position=16, write_segment=2, write_position=900, depth=3, sequence=6)
    checkpoint.save(short)
    assert checkpoint_path.stat().st_ino == inode  # no new file: written in place
    assert load_metadata(checkpoint_path) == short  # and cut to the shorter document
    assert load_newest([meta_path, checkpoint_path]) == (short, [])

    checkpoint_path.write_bytes(encode_metadata(short)[:40])  # torn by a power loss
    newest, unusable = load_newest([meta_path, checkpoint_path])
    assert newest.sequence == 4 and [path for path, _ in unusable] == [checkpoint_path]
    checkpoint.remove()
    assert not checkpoint_path.exists()
    assert load_newest([meta_path, checkpoint_path])[0].sequence == 4


def test_a_checkpoint_save_never_goes_over_the_newest_synced_one(tmp_path):
    """One file overwritten in place: after a power loss it may hold zeros or a torn document (its
    save not yet written back), and recovery fell back to the metadata saved when the queue
    opened. With two slots, the newest one a sync covered is never written over."""
    paths = (tmp_path / "q.checkpoint.json", tmp_path / "q.checkpoint.b.json")
    checkpoint = CheckpointFile(paths)

    def meta(sequence):
        return Metadata(read_segment=1, read_position=16 * sequence, write_segment=1, write_position=4096,
                        depth=9, sequence=sequence)

    checkpoint.save(meta(1))
    fd = checkpoint.unsynced_fd()
    assert fd is not None
    checkpoint.save(meta(2))  # not synced yet: the same slot again
    assert load_metadata(paths[0]) == meta(2) and not paths[1].exists()
    checkpoint.synced(fd)
    assert checkpoint.unsynced_fd() is None
    checkpoint.save(meta(3))  # the synced one (2) is kept
    assert (load_metadata(paths[0]), load_metadata(paths[1])) == (meta(2), meta(3))
    checkpoint.synced(checkpoint.unsynced_fd())
    checkpoint.close()  # the queue rested: the slots are opened again at the next save
    checkpoint.save(meta(4))
    assert (load_metadata(paths[0]), load_metadata(paths[1])) == (meta(4), meta(3))

    paths[0].write_bytes(bytes(len(encode_metadata(meta(4)))))  # zeros: a power loss before write-back
    newest, unusable = load_newest(paths)
    assert newest == meta(3) and [path for path, _ in unusable] == [paths[0]]
    checkpoint.remove()
    assert not any(path.exists() for path in paths)


def test_a_checkpoint_that_only_moved_the_write_position_needs_no_sync(tmp_path):
    """Lost, it would deliver nothing again (recovery scans the segments from the older write
    position): a queue only written pays no fsync for its checkpoints. The synced one is kept."""
    paths = (tmp_path / "q.checkpoint.json", tmp_path / "q.checkpoint.b.json")
    checkpoint = CheckpointFile(paths)
    base = Metadata(read_segment=1, read_position=16, write_segment=1, write_position=100, depth=3, sequence=1)
    checkpoint.save(base)
    checkpoint.synced(checkpoint.unsynced_fd())
    for sequence in (2, 3):  # written on
        checkpoint.save(dataclasses.replace(base, write_position=100 * sequence, depth=sequence + 2,
                                            sequence=sequence))
        assert checkpoint.unsynced_fd() is None
    assert (load_metadata(paths[0]).sequence, load_metadata(paths[1]).sequence) == (1, 3)
    read = dataclasses.replace(base, read_position=64, write_position=400, sequence=4)
    checkpoint.save(read)  # where reading stands moved
    assert checkpoint.unsynced_fd() is not None
    assert load_metadata(paths[0]).sequence == 1 and load_metadata(paths[1]) == read
    checkpoint.remove()


def test_a_checkpoint_file_opened_again_is_never_emptied_first(tmp_path, monkeypatch):
    """A queue that rests closes its checkpoint file and opens it again at its next save. Opened
    with O_TRUNC, a kill or a full disk between the truncate and the write left it empty, and
    recovery went back to the metadata saved at open: every message finished since was delivered
    again. Now every state the file passes through holds a valid document."""
    path = tmp_path / "q.checkpoint.json"
    first = Metadata(read_segment=3, read_position=16, write_segment=3, write_position=800, depth=2,
                     kept=tuple((i, i, {"a": i}) for i in range(20)), kept_count=20, sequence=7)
    checkpoint = CheckpointFile((path, tmp_path / "q.checkpoint.b.json"))
    checkpoint.save(first)
    checkpoint.close()  # the queue rested

    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    reopened = CheckpointFile((path, tmp_path / "q.checkpoint.b.json"))
    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", no_space)
        shorter = Metadata(read_segment=4, read_position=16, write_segment=4, write_position=16, depth=0,
                           sequence=8)
        with pytest.raises(OSError):
            reopened.save(shorter)
    assert load_metadata(path) == first  # still there, whole

    writes = []
    real_pwrite = os.pwrite

    def recorded(fd, data, offset):
        writes.append(bytes(data))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", recorded)
    reopened.save(shorter)
    assert decode_metadata(writes[-1]) == shorter  # padded with blanks to the old size: valid as written
    assert len(writes[-1]) == len(encode_metadata(first))
    assert path.read_bytes() == encode_metadata(shorter)  # and cut to size after


def test_metadata_keeps_the_release_point_and_kept_intervals():
    meta = Metadata(read_segment=2, read_position=500, write_segment=3, write_position=999, depth=7,
                    release_segment=1, release_position=16, kept=((1 << 32 | 16, 1 << 32 | 300, None),
                                                                 (2 << 32 | 40, 2 << 32 | 40, {"due": 5})),
                    kept_count=4)
    again = decode_metadata(encode_metadata(meta))
    assert again == meta
    assert again.release == (1, 16)
    for bad in ([[5, 4]], [[1]], [["a", 2]], [[-1, 2]]):
        document = json.loads(encode_metadata(meta))
        document["kept"] = bad
        document.pop("checksum")
        document["checksum"] = zlib.crc32(json.dumps(document, sort_keys=True, separators=(",", ":")).encode())
        with pytest.raises(ValueError, match="kept"):
            decode_metadata(json.dumps(document).encode())


def test_version_1_metadata_is_read_with_the_release_at_the_read_position():
    fields = {"version": 1, "read_segment": 3, "read_position": 40, "write_segment": 4, "write_position": 16,
              "depth": 2}
    fields["checksum"] = zlib.crc32(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    meta = decode_metadata(json.dumps(fields).encode())
    assert meta.release == (3, 40) and meta.kept == ()
