"""Blocks reserved ahead of a busy segment's end (real files): the size, the records and recovery unchanged."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from nsqd.diskq import DiskQueue
from nsqd.diskq import reserve as reserve_module
from nsqd.diskq import writer as writer_module

AHEAD = 64 * 1024


@pytest.fixture
def ahead(monkeypatch, tmp_path):
    """A small RESERVE_AHEAD; skips where the filesystem cannot reserve blocks (the writes still work there)."""
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if not reserve_module.reserve(fd, 0, AHEAD):
            pytest.skip("fallocate(FALLOC_FL_KEEP_SIZE) is not supported here")
    finally:
        os.close(fd)
        probe.unlink()
    monkeypatch.setattr(writer_module, "RESERVE_AHEAD", AHEAD)
    return AHEAD


def allocated(path):
    return os.stat(path).st_blocks * 512


def segment(path, number=0, name="q"):
    return path / f"{name}.diskq.{number:06d}.dat"


def payloads(count, size=1000):
    return [bytes([n % 251]) * size for n in range(count)]


def test_a_small_segment_reserves_nothing(tmp_path, ahead):
    queue = DiskQueue("q", tmp_path)
    queue.put_many(payloads(10))
    path = segment(tmp_path)
    assert allocated(path) < ahead
    queue.close()


def test_a_busy_segment_is_reserved_ahead_and_keeps_its_size(tmp_path, ahead):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=10 * ahead)
    batch = payloads(30)
    for _ in range(4):  # about 2 * AHEAD written
        queue.put_many(batch)
    path = segment(tmp_path)
    size = os.stat(path).st_size
    assert size > ahead
    assert allocated(path) >= size + ahead // 2  # blocks past the end, the size unchanged
    assert allocated(path) <= 10 * ahead + 4096  # never past the segment's limit
    queue.close()
    reopened = DiskQueue("q", tmp_path, max_bytes_per_file=10 * ahead)
    assert reopened.depth == 120
    assert reopened.read_many(200) == batch * 4
    assert reopened.statistics().corrupt_records_skipped == 0
    reopened.close()


def test_a_batch_taken_back_frees_its_reservation_and_writing_goes_on(tmp_path, ahead):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=10 * ahead)
    queue.put_many(payloads(30))
    mark = queue.mark()
    queue.put_many(payloads(100))  # reserves ahead
    queue.undo(mark)
    path = segment(tmp_path)
    assert os.stat(path).st_size == 16 + 30 * 1008
    queue.put_many(payloads(100))
    queue.close()
    reopened = DiskQueue("q", tmp_path, max_bytes_per_file=10 * ahead)
    assert reopened.read_many(200) == payloads(30) + payloads(100)
    reopened.close()


def test_a_refused_reservation_leaves_the_writes_alone(tmp_path, ahead, monkeypatch):
    calls = []

    def refused(fd, offset, length):
        calls.append((offset, length))
        return False

    monkeypatch.setattr(writer_module, "reserve", refused)
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=10 * ahead)
    for _ in range(4):
        queue.put_many(payloads(30))
    assert calls  # asked once the segment passed AHEAD ...
    assert len(calls) <= 3  # ... and not again for every write
    queue.close()
    reopened = DiskQueue("q", tmp_path, max_bytes_per_file=10 * ahead)
    assert reopened.read_many(200) == payloads(30) * 4
    reopened.close()


@pytest.fixture
def shm_path():
    """A directory on tmpfs (``/dev/shm``), removed after the test."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    path = tempfile.mkdtemp(dir="/dev/shm")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_tmpfs_is_not_reserved(shm_path, ahead):
    """On tmpfs a reservation allocates and zeroes the pages at once (about 1 ms per 4 MiB), with no
    journal to spare: nothing is reserved there."""
    queue = DiskQueue("q", shm_path, max_bytes_per_file=10 * ahead)
    for _ in range(4):
        queue.put_many(payloads(30))
    path = segment(shm_path)
    size = os.stat(path).st_size
    assert size > ahead
    assert allocated(path) < size + 4096
    queue.close()
