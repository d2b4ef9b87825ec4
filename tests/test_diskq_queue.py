"""Unit tests of DiskQueue operations on real files."""

import os
import struct

import pytest

from nsqd.diskq import DiskQueue, DiskQueueError, MessageSizeError
from nsqd.diskq import queue as queue_module
from nsqd.diskq import sync as sync_module
from nsqd.diskq.records import SEGMENT_HEADER_SIZE


def records(count, size=100, start=0):
    return [struct.pack(">I", n) + bytes([n % 251]) * (size - 4) for n in range(start, start + count)]


def drain(queue, batch=7):
    out = []
    while chunk := queue.read_many(batch):
        out.extend(chunk)
    return out


def segment_files(path):
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".dat"))


def test_put_and_read_in_fifo_order(tmp_path):
    queue = DiskQueue("orders", tmp_path)
    queue.put(b"first")
    queue.put_many([b"second", b"third"])
    assert queue.depth == 3
    assert queue.read_many(2) == [b"first", b"second"]
    assert queue.depth == 1
    assert queue.read_many(10) == [b"third"]
    assert queue.read_many(10) == []
    assert queue.depth == 0
    queue.close()


def test_a_put_is_in_its_file_when_it_returns(tmp_path):
    queue = DiskQueue("orders", tmp_path)
    queue.put(b"first")
    size = (tmp_path / "orders.diskq.000000.dat").stat().st_size
    assert size == SEGMENT_HEADER_SIZE + 8 + len(b"first")
    queue.put_many([b"x"] * 3)
    assert (tmp_path / "orders.diskq.000000.dat").stat().st_size == size + 3 * 9
    assert queue.read_many(5) == [b"first", b"x", b"x", b"x"]
    queue.close()


def test_positions_are_ordered_and_match_between_put_and_read(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 2 * 108)
    written = queue.put_positioned(records(5))
    assert written == sorted(written) and len(set(written)) == 5
    assert [p >> 32 for p in written] == [0, 0, 1, 1, 2]
    assert [p & 0xFFFFFFFF for p in written] == [16, 124, 16, 124, 16]
    payloads, read = queue.read_positioned(10)
    assert (payloads, read) == (records(5), written)
    queue.close()


def test_held_records_are_never_read_back_and_need_an_empty_queue(tmp_path):
    queue = DiskQueue("q", tmp_path)
    held = queue.put_held([b"a", b"b"])
    assert len(held) == 2 and queue.depth == 0
    assert queue.read_many(5) == []
    queue.put(b"c")
    with pytest.raises(DiskQueueError, match="nothing unread"):
        queue.put_held([b"d"])
    assert queue.read_many(5) == [b"c"]
    queue.close()


def test_zero_or_negative_count_reads_nothing(tmp_path):
    queue = DiskQueue("q", tmp_path)
    queue.put(b"a")
    assert queue.read_many(0) == []
    assert queue.read_many(-3) == []
    assert queue.depth == 1
    queue.close()


def test_rotation_exactly_at_the_boundary(tmp_path):
    record = 8 + 100
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 3 * record)
    queue.put_many(records(3))
    queue.close()
    assert segment_files(tmp_path) == ["q.diskq.000000.dat"]
    assert (tmp_path / "q.diskq.000000.dat").stat().st_size == SEGMENT_HEADER_SIZE + 3 * record

    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 3 * record)
    queue.put(records(1, start=3)[0])
    queue.close()
    assert segment_files(tmp_path) == ["q.diskq.000000.dat", "q.diskq.000001.dat"]
    assert (tmp_path / "q.diskq.000001.dat").stat().st_size == SEGMENT_HEADER_SIZE + record


def test_batch_crossing_several_segments_keeps_order(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 2 * 108)
    batch = records(9)
    queue.put_many(batch)
    queue.close()
    assert len(segment_files(tmp_path)) == 5
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 2 * 108)
    assert queue.depth == 9
    assert drain(queue) == batch
    queue.close()


def test_oversized_record_gets_its_own_segment(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=100, max_msg_size=1000)
    queue.put_many([b"small", b"L" * 500, b"tail"])
    assert len(segment_files(tmp_path)) == 3
    assert queue.read_many(10) == [b"small", b"L" * 500, b"tail"]
    queue.close()
    assert len(segment_files(tmp_path)) == 1  # the two read segments were removed


def test_fully_read_segments_are_deleted(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 2 * 108)
    queue.put_many(records(10))
    queue.close()
    assert len(segment_files(tmp_path)) == 5
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 2 * 108)
    assert len(queue.read_many(7)) == 7
    assert queue.statistics().segments == 2
    queue.close()
    assert segment_files(tmp_path) == ["q.diskq.000003.dat", "q.diskq.000004.dat"]


def test_size_limits_on_put(tmp_path):
    queue = DiskQueue("q", tmp_path, min_msg_size=2, max_msg_size=10)
    with pytest.raises(MessageSizeError, match="1 bytes, outside \\[2, 10\\]"):
        queue.put(b"x")
    with pytest.raises(MessageSizeError, match="11 bytes"):
        queue.put(b"x" * 11)
    queue.put(b"xx")
    queue.put(b"x" * 10)
    assert queue.depth == 2
    queue.close()


def test_put_many_validates_the_whole_batch_first(tmp_path):
    queue = DiskQueue("q", tmp_path, max_msg_size=10)
    with pytest.raises(MessageSizeError, match="payload 2 is 11 bytes"):
        queue.put_many([b"ok", b"fine", b"x" * 11, b"late"])
    assert queue.depth == 0
    assert queue.read_many(10) == []
    queue.put_many([])
    assert queue.depth == 0
    queue.close()


def test_depth_survives_reopen(tmp_path):
    queue = DiskQueue("q", tmp_path)
    queue.put_many(records(50))
    queue.read_many(20)
    queue.close()
    queue = DiskQueue("q", tmp_path)
    assert queue.depth == 30
    assert drain(queue) == records(50)[20:]
    queue.close()
    queue = DiskQueue("q", tmp_path)
    assert queue.depth == 0
    assert queue.read_many(1) == []
    queue.close()


def test_writes_continue_after_reopen(tmp_path):
    for round_number in range(3):
        queue = DiskQueue("q", tmp_path, max_bytes_per_file=1000)
        queue.put_many(records(7, start=7 * round_number))
        queue.close()
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=1000)
    assert drain(queue) == records(21)
    queue.close()


def test_empty_drops_everything_and_keeps_working(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=500)
    queue.put_many(records(20))
    queue.read_many(3)
    queue.empty()
    assert queue.depth == 0
    assert queue.read_many(10) == []
    assert segment_files(tmp_path) == []
    queue.put(b"after")
    queue.close()
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=500)
    assert queue.depth == 1
    assert queue.read_many(10) == [b"after"]
    queue.close()


def test_delete_removes_every_file(tmp_path):
    (tmp_path / "other.diskq.000000.dat").write_bytes(b"keep")
    queue = DiskQueue("t:c", tmp_path, max_bytes_per_file=500)
    queue.put_many(records(20))
    queue.close()
    queue = DiskQueue("t:c", tmp_path, max_bytes_per_file=500)
    queue.put(b"more")
    queue.delete()
    assert sorted(os.listdir(tmp_path)) == ["other.diskq.000000.dat"]
    with pytest.raises(DiskQueueError, match="closed"):
        queue.put(b"x")


def test_delete_after_close(tmp_path):
    queue = DiskQueue("q", tmp_path)
    queue.put(b"x")
    queue.close()
    queue.delete()
    assert os.listdir(tmp_path) == []


def test_closed_queue_refuses_work_and_close_is_idempotent(tmp_path):
    queue = DiskQueue("q", tmp_path)
    queue.close()
    queue.close()
    for operation in (lambda: queue.put(b"x"), lambda: queue.put_many([b"x"]), lambda: queue.read_many(1),
                      queue.empty):
        with pytest.raises(DiskQueueError, match="'q' is closed"):
            operation()


def test_missing_data_directory_is_a_clear_error(tmp_path):
    with pytest.raises(DiskQueueError, match="cannot open in .*missing.*No such file"):
        DiskQueue("q", tmp_path / "missing")


def test_a_queue_cannot_be_opened_twice(tmp_path):
    queue = DiskQueue("q", tmp_path)
    with pytest.raises(DiskQueueError, match="already open"):
        DiskQueue("q", tmp_path)
    queue.close()
    DiskQueue("q", tmp_path).close()


def test_queues_with_similar_names_do_not_share_files(tmp_path):
    first = DiskQueue("t:c", tmp_path)
    second = DiskQueue("t%3Ac", tmp_path)
    first.put(b"one")
    second.put(b"two")
    first.close()
    second.close()
    first = DiskQueue("t:c", tmp_path)
    second = DiskQueue("t%3Ac", tmp_path)
    assert (first.read_many(5), second.read_many(5)) == ([b"one"], [b"two"])
    first.close()
    second.close()


def test_statistics(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 2 * 108)
    queue.put_many(records(5))
    queue.read_many(1)
    stats = queue.statistics()
    assert stats.depth == 4
    assert stats.bytes_written == 5 * 108
    assert stats.bytes_read == 108
    assert stats.segments == 3
    assert (stats.corrupt_records_skipped, stats.bytes_skipped, stats.last_error) == (0, 0, None)
    with pytest.raises(AttributeError):
        stats.depth = 1
    queue.close()


def test_invalid_settings_are_refused(tmp_path):
    for kwargs in ({"min_msg_size": 10, "max_msg_size": 5}, {"max_msg_size": 1 << 32},
                   {"max_bytes_per_file": 20}, {"sync_every": 0}, {"sync_timeout": 0}):
        with pytest.raises(ValueError):
            DiskQueue("q", tmp_path, **kwargs)


@pytest.mark.parametrize("count", [0, 10])
def test_an_open_after_an_orderly_close_writes_no_metadata(tmp_path, monkeypatch, count):
    """The metadata file already says what the files say: an open that saved it again (two fsyncs)
    made restarts of a daemon with thousands of queues take a minute."""
    queue = DiskQueue("q", tmp_path)
    queue.put_many(records(count))
    queue.read_many(3)
    queue.close()
    saves = []
    monkeypatch.setattr(queue_module, "save_metadata", lambda path, meta: saves.append(meta))
    queue = DiskQueue("q", tmp_path)
    assert saves == []
    queue.put_many(records(2, start=100))
    assert drain(queue) == records(count)[3:] + records(2, start=100)
    queue.close()
    monkeypatch.undo()
    queue = DiskQueue("q", tmp_path)  # the close saved what the reads and puts changed
    assert queue.depth == 0 and drain(queue) == []
    queue.close()


def test_an_open_after_a_crash_saves_the_metadata_and_drops_the_checkpoint_file(tmp_path, monkeypatch):
    queue = DiskQueue("q", tmp_path, sync_every=1)
    queue.put_many(records(10))
    queue.read_many(4)
    queue._checkpoint_file.save(queue._snapshot())  # what a checkpoint leaves, then a crash
    queue._shut()
    saves = []
    real = queue_module.save_metadata
    monkeypatch.setattr(queue_module, "save_metadata", lambda path, meta: (saves.append(meta), real(path, meta)))
    queue = DiskQueue("q", tmp_path)
    assert len(saves) == 1 and saves[0].depth == 6
    assert not any(".diskq.checkpoint" in path.name for path in tmp_path.iterdir())
    assert drain(queue) == records(10)[4:]
    queue.close()


def test_a_close_with_nothing_changed_since_the_open_writes_no_metadata(tmp_path, monkeypatch):
    queue = DiskQueue("q", tmp_path)
    queue.put_many(records(5))
    queue.close()
    saves = []
    monkeypatch.setattr(sync_module, "save_metadata", lambda path, meta: saves.append(meta))
    DiskQueue("q", tmp_path).close()
    assert saves == []
    queue = DiskQueue("q", tmp_path)
    queue.read_many(1)
    queue.close()
    assert [meta.depth for meta in saves] == [4]  # a read is a change


def test_reserved_records_that_outnumber_the_queued_ones_leave_those_readable_after_a_reopen(tmp_path):
    """Records a channel writes and keeps itself (its leases, at shutdown) are not read back;
    the queued records before them must be. Their count was taken off the depth twice (at the
    reserve and again at the open), so 2 queued behind 8 reserved came back as a depth of 0."""
    queue = DiskQueue("q", tmp_path)
    queue.put_many(records(2))
    queue.reserve(queue.put_positioned(records(8, start=2)))
    assert queue.depth == 2
    queue.close()
    queue = DiskQueue("q", tmp_path)
    assert queue.depth == 2
    assert queue.read_many(100) == records(2)
    assert queue.depth == 0
    queue.close()
