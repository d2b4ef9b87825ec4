"""Damaged files: torn tails, flipped bits and metadata that disagrees with the files."""

import json
import random
import shutil
import struct

import pytest
import structlog.testing

from nsqd.diskq import DiskQueue, DiskQueueError
from nsqd.diskq.records import SEGMENT_HEADER_SIZE

SEGMENT_BYTES = 4096


def payloads(count, seed=0):
    rng = random.Random(seed)
    return [struct.pack(">I", n) + rng.randbytes(rng.randrange(20, 300)) for n in range(count)]


def write_queue(path, items, **kwargs):
    queue = DiskQueue("q", path, max_bytes_per_file=SEGMENT_BYTES, **kwargs)
    queue.put_many(items)
    queue.close()


def open_queue(path, **kwargs):
    return DiskQueue("q", path, max_bytes_per_file=SEGMENT_BYTES, **kwargs)


def drain(queue):
    out = []
    while chunk := queue.read_many(50):
        out.extend(chunk)
    return out


def record_spans(path, items):
    """(segment file, start, end) of every record, derived from the layout rules."""
    spans, segment, position = [], 0, SEGMENT_HEADER_SIZE
    for item in items:
        size = 8 + len(item)
        if position > SEGMENT_HEADER_SIZE and position + size > SEGMENT_BYTES:
            segment, position = segment + 1, SEGMENT_HEADER_SIZE
        spans.append((path / f"q.diskq.{segment:06d}.dat", position, position + size))
        position += size
    return spans


def flip_bit(file, offset, bit):
    data = bytearray(file.read_bytes())
    data[offset] ^= 1 << bit
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("seed", range(8))
def test_torn_tail_loses_only_the_torn_record(tmp_path, seed):
    items = payloads(60, seed)
    write_queue(tmp_path, items)
    spans = record_spans(tmp_path, items)
    last_file = spans[-1][0]
    in_last = [(index, start, end) for index, (file, start, end) in enumerate(spans) if file == last_file]
    rng = random.Random(seed)
    cut = rng.randrange(SEGMENT_HEADER_SIZE, last_file.stat().st_size)
    with open(last_file, "r+b") as stream:
        stream.truncate(cut)
    survivors = [items[i] for i, (file, start, end) in enumerate(spans) if file != last_file or end <= cut]
    torn = [span for span in in_last if span[1] < cut < span[2]]

    queue = open_queue(tmp_path)
    assert queue.depth == len(survivors)
    stats = queue.statistics()
    assert stats.corrupt_records_skipped == len(torn)
    assert stats.bytes_skipped == (cut - torn[0][1] if torn else 0)
    queue.put(b"appended after repair")
    assert drain(queue) == survivors + [b"appended after repair"]
    queue.close()
    assert open_queue(tmp_path).statistics().corrupt_records_skipped == 0


@pytest.mark.parametrize("seed", range(12))
def test_flipped_bit_loses_only_that_record(tmp_path, seed):
    items = payloads(80, seed)
    write_queue(tmp_path, items)
    spans = record_spans(tmp_path, items)
    rng = random.Random(seed)
    victim = rng.randrange(len(items))
    file, start, end = spans[victim]
    flip_bit(file, rng.randrange(start, end), rng.randrange(8))

    queue = open_queue(tmp_path)
    with structlog.testing.capture_logs() as logs:
        delivered = drain(queue)
    assert delivered == items[:victim] + items[victim + 1:]
    stats = queue.statistics()
    assert (stats.corrupt_records_skipped, stats.bytes_skipped) == (1, end - start)
    assert stats.depth == 0
    skips = [entry for entry in logs if entry["event"] == "diskq_damaged_record_skipped"]
    assert [(entry["position"], entry["skipped_bytes"]) for entry in skips] == [(start, end - start)]
    queue.close()


def test_damaged_length_field_is_resynchronised(tmp_path):
    items = payloads(30)
    write_queue(tmp_path, items)
    file, start, end = record_spans(tmp_path, items)[10]
    with open(file, "r+b") as stream:
        stream.seek(start)
        stream.write(struct.pack(">I", 5000))  # points far past the record
    queue = open_queue(tmp_path)
    assert drain(queue) == items[:10] + items[11:]
    assert queue.statistics().corrupt_records_skipped == 1
    queue.close()


def test_several_damaged_records_in_different_segments(tmp_path):
    items = payloads(120, seed=3)
    write_queue(tmp_path, items)
    spans = record_spans(tmp_path, items)
    victims = [5, 40, 41, 90]
    for victim in victims:
        file, start, end = spans[victim]
        flip_bit(file, end - 1, 0)
    queue = open_queue(tmp_path)
    assert drain(queue) == [item for index, item in enumerate(items) if index not in victims]
    stats = queue.statistics()
    assert stats.corrupt_records_skipped == 3  # 40 and 41 are adjacent: one damaged stretch
    assert stats.bytes_skipped == sum(spans[v][2] - spans[v][1] for v in victims)
    queue.close()


def test_records_outside_the_size_limits_are_skipped_not_fatal(tmp_path):
    items = [b"s" * 10, b"L" * 200, b"s" * 20]
    write_queue(tmp_path, items)
    queue = open_queue(tmp_path, max_msg_size=100)
    assert drain(queue) == [b"s" * 10, b"s" * 20]
    assert queue.statistics().corrupt_records_skipped == 1
    queue.close()


def test_missing_metadata_is_rebuilt_from_the_files(tmp_path):
    items = payloads(100)
    write_queue(tmp_path, items)
    (tmp_path / "q.diskq.meta.json").unlink()
    queue = open_queue(tmp_path)
    assert queue.depth == 100
    assert drain(queue) == items
    queue.close()


def test_garbage_metadata_is_ignored(tmp_path):
    items = payloads(40)
    write_queue(tmp_path, items)
    (tmp_path / "q.diskq.meta.json").write_bytes(b"\x00\xffnot metadata")
    with structlog.testing.capture_logs() as logs:
        queue = open_queue(tmp_path)
    assert any(entry["event"] == "diskq_metadata_unusable" for entry in logs)
    assert queue.depth == 40
    assert drain(queue) == items
    queue.close()


def test_stale_metadata_finds_records_and_segments_written_after_it(tmp_path):
    first, later = payloads(30, seed=1), payloads(70, seed=2)
    write_queue(tmp_path, first)
    queue = open_queue(tmp_path)
    queue.read_many(10)
    queue.close()
    stale = (tmp_path / "q.diskq.meta.json").read_bytes()
    queue = open_queue(tmp_path)
    queue.put_many(later)
    queue.close()
    (tmp_path / "q.diskq.meta.json").write_bytes(stale)  # as if the process died before saving

    queue = open_queue(tmp_path)
    assert queue.depth == 20 + 70
    assert drain(queue) == first[10:] + later
    queue.close()



def test_a_saved_depth_of_0_with_records_past_the_read_position_still_reads_them(tmp_path):
    """A depth that fell short (as an earlier build saved it behind a channel's reserved records)
    must not leave the records after the read position unread: the open counts at least one,
    and reading settles the rest."""
    import dataclasses

    from nsqd.diskq.metadata import load_newest, save_metadata

    items = payloads(30)
    write_queue(tmp_path, items)
    path = tmp_path / "q.diskq.meta.json"
    meta, _ = load_newest([path])
    save_metadata(path, dataclasses.replace(meta, depth=0))
    queue = open_queue(tmp_path)
    assert queue.depth > 0
    assert drain(queue) == items
    assert queue.depth == 0
    queue.close()

def test_write_position_past_end_of_file_triggers_a_recount(tmp_path):
    items = payloads(50)
    write_queue(tmp_path, items)
    spans = record_spans(tmp_path, items)
    last_file, _, _ = spans[-1]
    keep = [i for i, span in enumerate(spans) if span[0] != last_file] + [
        i for i, span in enumerate(spans) if span[0] == last_file][:1]
    with open(last_file, "r+b") as stream:
        stream.truncate(spans[keep[-1]][2])
    with structlog.testing.capture_logs() as logs:
        queue = open_queue(tmp_path)
    assert any(entry.get("reason") == "write position is past the end of its segment" for entry in logs)
    assert queue.depth == len(keep)
    assert drain(queue) == [items[i] for i in keep]
    queue.close()


def test_missing_read_segment_starts_at_the_next_one(tmp_path):
    items = payloads(100)
    write_queue(tmp_path, items)
    spans = record_spans(tmp_path, items)
    spans[0][0].unlink()
    queue = open_queue(tmp_path)
    expected = [item for item, span in zip(items, spans) if span[0] != spans[0][0]]
    assert queue.depth == len(expected)
    assert drain(queue) == expected
    queue.close()


def written_and_read(tmp_path, read_first):
    """A queue of 100 records over several segments, the first ``read_first`` read; (items, spans)."""
    items = payloads(100)
    spans = record_spans(tmp_path, items)
    queue = open_queue(tmp_path)
    queue.put_many(items)
    assert queue.read_many(read_first) == items[:read_first]
    queue.close()
    return items, spans


@pytest.mark.parametrize("read_first", [0, 7])
def test_records_lost_with_a_missing_middle_segment_are_counted(tmp_path, read_first):
    """A segment gone from between the read and write positions took its records: they are
    counted as damage (in /stats and /metrics), not only logged; every other record is delivered."""
    items, spans = written_and_read(tmp_path, read_first)
    files = sorted({span[0] for span in spans})
    assert len(files) >= 4
    middle = files[len(files) // 2]
    middle.unlink()
    lost = sum(1 for span in spans if span[0] == middle)
    queue = open_queue(tmp_path)
    with structlog.testing.capture_logs() as logs:
        expected = [item for item, span in zip(items, spans) if span[0] != middle][read_first:]
        assert queue.depth == len(expected)
        assert drain(queue) == expected
    stats = queue.statistics()
    assert stats.corrupt_records_skipped == lost
    assert not any(entry["event"] == "diskq_damaged_record_skipped" for entry in logs)
    queue.close()
    queue = open_queue(tmp_path)  # counted once: the next start finds nothing missing
    assert queue.statistics().corrupt_records_skipped == 0
    queue.close()


@pytest.mark.parametrize("damage, read_first", [("deleted", 0), ("deleted", 7), ("cut short", 7)])
def test_records_lost_with_the_read_segment_are_counted(tmp_path, damage, read_first):
    """The read segment gone, or cut below the read position, took its unread records: they were
    only logged; now counted as damage as for a segment missing further on."""
    items, spans = written_and_read(tmp_path, read_first)
    first = spans[0][0]
    in_first = sum(1 for span in spans if span[0] == first)
    if damage == "deleted":
        first.unlink()
        left = items[in_first:]
    else:
        with open(first, "r+b") as stream:
            stream.truncate(spans[3][2])
        left = items[:4] + items[in_first:]  # read before, so delivered again rather than lost
    queue = open_queue(tmp_path)
    assert queue.depth == len(left)
    assert drain(queue) == left
    assert queue.statistics().corrupt_records_skipped == in_first - read_first
    queue.close()
    queue = open_queue(tmp_path)  # counted once
    assert queue.statistics().corrupt_records_skipped == 0
    queue.close()


def test_leftover_read_segments_are_removed(tmp_path):
    items = payloads(100)
    write_queue(tmp_path, items)
    spare = tmp_path / "spare.dat"
    shutil.copy(tmp_path / "q.diskq.000000.dat", spare)
    queue = open_queue(tmp_path)
    in_first = sum(1 for span in record_spans(tmp_path, items) if span[0].name.endswith("000000.dat"))
    queue.read_many(in_first + 1)
    queue.close()
    shutil.copy(spare, tmp_path / "q.diskq.000000.dat")  # as if the unlink never happened
    queue = open_queue(tmp_path)
    assert not (tmp_path / "q.diskq.000000.dat").exists()
    assert drain(queue) == items[in_first + 1:]
    queue.close()


def test_torn_segment_header_is_removed(tmp_path):
    items = payloads(10)
    write_queue(tmp_path, items)
    (tmp_path / "q.diskq.000001.dat").write_bytes(b"NSQ")  # creation cut short
    queue = open_queue(tmp_path)
    assert not (tmp_path / "q.diskq.000001.dat").exists()
    queue.put(b"new")
    assert drain(queue) == items + [b"new"]
    queue.close()


def test_damaged_segment_magic_is_repaired_without_losing_records(tmp_path):
    items = payloads(10)
    write_queue(tmp_path, items)
    flip_bit(tmp_path / "q.diskq.000000.dat", 2, 3)
    queue = open_queue(tmp_path)
    assert queue.statistics().bytes_skipped == SEGMENT_HEADER_SIZE
    assert drain(queue) == items
    queue.close()
    assert open_queue(tmp_path).statistics().bytes_skipped == 0


@pytest.mark.parametrize("version", [0, 3, 7])
def test_a_damaged_format_version_over_our_records_is_repaired_without_losing_them(tmp_path, version):
    """One flipped bit in the version bytes had refused the queue, and with it the daemon's start."""
    items = payloads(10)
    write_queue(tmp_path, items)
    with open(tmp_path / "q.diskq.000000.dat", "r+b") as stream:
        stream.seek(8)
        stream.write(struct.pack(">H", version))
    queue = open_queue(tmp_path)
    assert queue.statistics().bytes_skipped == SEGMENT_HEADER_SIZE
    assert drain(queue) == items
    queue.close()
    assert open_queue(tmp_path).statistics().bytes_skipped == 0


def test_a_segment_of_another_format_is_refused(tmp_path):
    """Another version over records that do not verify as ours: another build wrote it."""
    write_queue(tmp_path, payloads(3))
    with open(tmp_path / "q.diskq.000000.dat", "r+b") as stream:
        stream.seek(8)
        stream.write(struct.pack(">H", 7))
        stream.seek(SEGMENT_HEADER_SIZE + 4)  # the first record's checksum, as another format has it
        stream.write(b"\0\0\0\0")
    with pytest.raises(DiskQueueError, match="format version 7 is not supported"):
        open_queue(tmp_path)
    with pytest.raises(DiskQueueError, match="format version 7"):  # not "already open": the lock was released
        open_queue(tmp_path)
    meta = json.loads((tmp_path / "q.diskq.meta.json").read_text())
    assert meta["depth"] == 3  # refusing to open changed nothing
