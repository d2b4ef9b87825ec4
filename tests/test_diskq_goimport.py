"""Import of queues written by Go nsqd (go-diskqueue layout), from generated fixtures."""

import os
import random
import struct

import pytest

from nsqd.diskq import DiskQueue
from nsqd.diskq.goimport import go_queue_exists, iter_go_queue, read_go_metadata, remove_go_queue


def go_message(number: int) -> bytes:
    """Go nsqd's encoding: timestamp int64, attempts uint16, 16-byte id, body."""
    body = b"body-%d-" % number + random.Random(number).randbytes(number % 90)
    return struct.pack(">qH", 1_700_000_000_000_000_000 + number, 1) + b"%016x" % number + body


class GoQueueFixture:
    """Writes files the way go-diskqueue does: rotate before a record that would pass the limit."""

    def __init__(self, directory, name, max_bytes_per_file=1024):
        self.directory = directory
        self.name = name
        self.max_bytes = max_bytes_per_file
        self.positions = []  # (file number, offset) of every record

    def segment(self, number):
        return self.directory / f"{self.name}.diskqueue.{number:06d}.dat"

    def write(self, messages, read_index=0, meta_write_index=None):
        file_number, position = 0, 0
        for message in messages:
            total = 4 + len(message)
            if position > 0 and position + total > self.max_bytes:
                file_number, position = file_number + 1, 0
            with open(self.segment(file_number), "ab") as stream:
                stream.write(struct.pack(">I", len(message)) + message)
            self.positions.append((file_number, position))
            position += total
        end = (file_number, position)
        write_file, write_pos = end if meta_write_index is None else self.positions[meta_write_index]
        read_file, read_pos = self.positions[read_index] if read_index < len(messages) else end
        depth = len(messages) - read_index
        (self.directory / f"{self.name}.diskqueue.meta.dat").write_text(
            f"{depth}\n{read_file},{read_pos}\n{write_file},{write_pos}\n"
        )


@pytest.fixture
def messages():
    return [go_message(number) for number in range(60)]


def test_reads_every_record_in_order(tmp_path, messages):
    GoQueueFixture(tmp_path, "orders").write(messages)
    records = iter_go_queue("orders", tmp_path)
    assert list(records) == messages
    assert (records.records, records.skipped_records, records.skipped_bytes) == (60, 0, 0)


def test_starts_at_the_saved_read_position_in_the_middle_of_a_file(tmp_path, messages):
    fixture = GoQueueFixture(tmp_path, "orders")
    fixture.write(messages, read_index=23)
    file_number, position = fixture.positions[23]
    assert file_number > 0 and position > 0  # mid-file, after the first file
    assert fixture.segment(0).exists()  # an older file present must not be replayed
    assert read_go_metadata("orders", tmp_path).read_position == position
    assert list(iter_go_queue("orders", tmp_path)) == messages[23:]


def test_torn_tail_stops_cleanly(tmp_path, messages):
    fixture = GoQueueFixture(tmp_path, "orders")
    fixture.write(messages)
    last_file, last_position = fixture.positions[-1]
    with open(fixture.segment(last_file), "r+b") as stream:
        stream.truncate(last_position + 7)
    records = iter_go_queue("orders", tmp_path)
    assert list(records) == messages[:-1]
    assert (records.skipped_records, records.skipped_bytes) == (1, 7)


def test_torn_length_prefix_stops_cleanly(tmp_path, messages):
    fixture = GoQueueFixture(tmp_path, "orders")
    fixture.write(messages)
    last_file, last_position = fixture.positions[-1]
    with open(fixture.segment(last_file), "r+b") as stream:
        stream.truncate(last_position + 2)
    assert list(iter_go_queue("orders", tmp_path)) == messages[:-1]


def test_bad_length_skips_the_rest_of_that_file_only(tmp_path, messages):
    fixture = GoQueueFixture(tmp_path, "orders")
    fixture.write(messages)
    file_number, position = fixture.positions[5]
    with open(fixture.segment(file_number), "r+b") as stream:
        stream.seek(position)
        stream.write(struct.pack(">I", 0x7FFFFFFF))
    lost = [i for i, (f, p) in enumerate(fixture.positions) if f == file_number and p >= position]
    records = iter_go_queue("orders", tmp_path)
    assert list(records) == [m for i, m in enumerate(messages) if i not in lost]
    assert records.skipped_records == 1
    assert records.skipped_bytes == fixture.segment(file_number).stat().st_size - position


def test_too_short_messages_count_as_bad_lengths(tmp_path):
    GoQueueFixture(tmp_path, "orders").write([go_message(1), b"short", go_message(2)])
    records = iter_go_queue("orders", tmp_path)
    assert list(records) == [go_message(1)]
    assert records.skipped_records == 1


def test_records_past_the_saved_write_position_are_kept(tmp_path, messages):
    GoQueueFixture(tmp_path, "orders").write(messages, meta_write_index=40)  # metadata not synced at exit
    assert list(iter_go_queue("orders", tmp_path)) == messages


def test_missing_metadata_reads_from_the_first_file(tmp_path, messages):
    fixture = GoQueueFixture(tmp_path, "orders")
    fixture.write(messages)
    (tmp_path / "orders.diskqueue.meta.dat").unlink()
    fixture.segment(0).unlink()
    first_kept = next(i for i, (f, _) in enumerate(fixture.positions) if f == 1)
    assert list(iter_go_queue("orders", tmp_path)) == messages[first_kept:]


def test_channel_queue_names_and_existence(tmp_path, messages):
    assert not go_queue_exists("orders:archive", tmp_path)
    GoQueueFixture(tmp_path, "orders:archive").write(messages[:3])
    assert go_queue_exists("orders:archive", tmp_path)
    assert not go_queue_exists("orders", tmp_path)
    assert (tmp_path / "orders:archive.diskqueue.000000.dat").exists()
    assert list(iter_go_queue("orders:archive", tmp_path)) == messages[:3]


def test_remove_deletes_only_that_queue(tmp_path, messages):
    GoQueueFixture(tmp_path, "orders").write(messages)
    GoQueueFixture(tmp_path, "orders:archive").write(messages[:2])
    (tmp_path / "orders.diskqueue.000009.dat.bad").write_bytes(b"bad")
    (tmp_path / "orders.diskqueue.meta.dat.12345.tmp").write_bytes(b"tmp")
    remove_go_queue("orders", tmp_path)
    assert not go_queue_exists("orders", tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["orders:archive.diskqueue.000000.dat", "orders:archive.diskqueue.meta.dat"]


def test_import_into_a_disk_queue(tmp_path, messages):
    GoQueueFixture(tmp_path, "orders").write(messages, read_index=10)
    queue = DiskQueue("orders", tmp_path)
    queue.put_many(list(iter_go_queue("orders", tmp_path)))
    remove_go_queue("orders", tmp_path)
    queue.close()
    queue = DiskQueue("orders", tmp_path)
    assert queue.depth == 50
    assert queue.read_many(100) == messages[10:]
    queue.close()
