"""Disk full and other write/read failures: clear errors, a refused put leaves no trace, nothing accepted is lost."""

import errno
import os
import resource
import subprocess

import pytest
import trio

from nsqd.diskq import DiskQueue, DiskQueueReadError, DiskQueueWriteError
from nsqd.diskq import writer as writer_module
from nsqd.diskq.metadata import CheckpointFile, Metadata, encode_metadata, load_metadata

RECORD = 200


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs, so ENOSPC is real."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill_until_refused(queue):
    """Put records until a put fails; returns the accepted ones and the error."""
    accepted = []
    while True:
        record = b"%08d" % len(accepted) + b"r" * (RECORD - 8)
        try:
            queue.put(record)
        except DiskQueueWriteError as exc:
            return accepted, exc
        accepted.append(record)
        assert len(accepted) < 200_000, "the disk never filled up"


def drain(queue):
    out = []
    while chunk := queue.read_many(1000):
        out.extend(chunk)
    return out


def test_disk_full_refuses_puts_keeps_data_and_recovers(small_fs):
    ballast = small_fs / "ballast"
    ballast.write_bytes(b"\0" * (5 << 20))
    queue = DiskQueue("q", small_fs, max_bytes_per_file=1 << 20)
    accepted, error = fill_until_refused(queue)

    assert error.errno == errno.ENOSPC
    assert "No space left on device" in str(error)
    assert "'q'" in str(error)
    assert queue.failing is not None
    with pytest.raises(DiskQueueWriteError):  # still full: still refused
        queue.put(b"x" * RECORD)
    assert queue.depth == len(accepted)

    ballast.unlink()
    queue.put(b"after space came back")
    queue.close()
    queue = DiskQueue("q", small_fs, max_bytes_per_file=1 << 20)
    assert drain(queue) == accepted + [b"after space came back"]
    assert queue.statistics().corrupt_records_skipped == 0
    queue.close()


def test_a_refused_batch_leaves_no_trace_even_across_segments(small_fs):
    ballast = small_fs / "ballast"
    ballast.write_bytes(b"\0" * (7 << 20))
    queue = DiskQueue("q", small_fs, max_bytes_per_file=64 << 10)
    accepted = []
    while True:
        batch = [b"%08d" % (len(accepted) + i) + b"r" * (RECORD - 8) for i in range(400)]  # ~83 KB: rotates
        try:
            queue.put_many(batch)
        except DiskQueueWriteError:
            break
        accepted += batch
    depth = queue.depth
    assert depth == len(accepted)
    ballast.unlink()
    queue.put(b"after")
    queue.close()
    queue = DiskQueue("q", small_fs, max_bytes_per_file=64 << 10)
    assert drain(queue) == accepted + [b"after"]
    assert queue.statistics().corrupt_records_skipped == 0
    queue.close()


async def test_disk_full_fails_puts_not_durability_of_what_was_accepted(small_fs):
    ballast = small_fs / "ballast"
    ballast.write_bytes(b"\0" * (5 << 20))
    queue = DiskQueue("q", small_fs, max_bytes_per_file=1 << 20)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        accepted, _ = fill_until_refused(queue)
        await queue.wait_durable()  # what was accepted is in its file: it can be synced
        ballast.unlink()
        queue.put(b"more")
        await queue.wait_durable()
        assert queue.failing is None
        nursery.cancel_scope.cancel()
    queue.close()
    queue = DiskQueue("q", small_fs, max_bytes_per_file=1 << 20)
    assert drain(queue) == accepted + [b"more"]
    queue.close()


def test_short_write_then_error_rolls_the_batch_back(tmp_path, monkeypatch):
    real_pwrite = writer_module.pwrite
    calls = []

    def half_then_full_disk(fd, data, offset):
        calls.append(len(data))
        if len(calls) == 1:
            return real_pwrite(fd, bytes(data[: len(data) // 2 + 3]), offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    queue = DiskQueue("q", tmp_path)
    queue.put(b"before")
    items = [b"%06d" % n + b"p" * 300 for n in range(1000)]
    monkeypatch.setattr(writer_module, "pwrite", half_then_full_disk)
    with pytest.raises(DiskQueueWriteError, match="No space left"):
        queue.put_many(items)
    assert len(calls) == 2
    assert queue.depth == 1
    assert (tmp_path / "q.diskq.000000.dat").stat().st_size == 16 + 8 + 6  # cut back
    monkeypatch.undo()
    queue.put(b"last")
    queue.close()
    queue = DiskQueue("q", tmp_path)
    assert drain(queue) == [b"before", b"last"]
    queue.close()


@pytest.fixture
def descriptor_limit():
    """Lower the soft descriptor limit so every new open fails with EMFILE, until reset."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def exhaust(keep_free=0):
        """Also refuse the ``keep_free`` highest descriptors in use once they are closed."""
        probe = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor number
        os.close(probe)
        resource.setrlimit(resource.RLIMIT_NOFILE, (probe - keep_free, hard))

    def restore():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    yield exhaust, restore
    restore()


def test_emfile_on_write_is_temporary(tmp_path, descriptor_limit):
    exhaust, restore = descriptor_limit
    queue = DiskQueue("q", tmp_path)
    exhaust()
    accepted, error = fill_until_refused(queue)
    assert error.errno == errno.EMFILE
    assert "Too many open files" in str(error)
    restore()
    queue.put(b"after")
    assert drain(queue) == accepted + [b"after"]
    queue.close()


def test_emfile_on_read_skips_nothing(tmp_path, descriptor_limit):
    exhaust, restore = descriptor_limit
    items = [b"%04d" % n * 20 for n in range(200)]
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=2000)
    queue.put_many(items)
    queue.close()
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=2000)
    delivered = queue.read_many(30)  # now reading the second segment, the newest descriptor
    exhaust(keep_free=1)
    with pytest.raises(DiskQueueReadError) as caught:
        while True:
            delivered += queue.read_many(30)
    assert caught.value.errno == errno.EMFILE
    assert "Too many open files" in str(caught.value)
    restore()
    delivered += drain(queue)
    assert delivered == items
    assert queue.statistics().corrupt_records_skipped == 0
    queue.close()


def test_a_refused_put_does_not_come_back_after_a_crash(tmp_path, monkeypatch):
    queue = DiskQueue("q", tmp_path)
    queue.put(b"written")

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer_module, "pwrite", full_disk)
    with pytest.raises(DiskQueueWriteError, match="No space left") as caught:
        queue.put(b"refused")
    assert caught.value.errno == errno.ENOSPC
    monkeypatch.undo()
    queue._shut()  # descriptors closed, nothing saved: as after a crash
    queue = DiskQueue("q", tmp_path)
    assert drain(queue) == [b"written"]
    queue.close()


def _ballast(directory, chunk=64 * 1024):
    """Fill the filesystem: a file grown until the disk refuses."""
    with open(directory / "ballast", "wb", buffering=0) as f:
        while True:
            try:
                f.write(b"\0" * chunk)
            except OSError:
                return


def test_a_checkpoint_that_grows_on_a_full_disk_is_refused_whole_and_the_last_one_stays(small_fs):
    """Overwritten in place, a longer document cut short by a full disk tore the file: recovery then
    went back to the metadata saved at open, and every FIN since came back."""
    path = small_fs / "q.checkpoint.json"
    first = Metadata(read_segment=3, read_position=16, write_segment=3, write_position=800, depth=2, sequence=7)
    checkpoint = CheckpointFile((path, path.with_name("q.checkpoint.b.json")))
    checkpoint.save(first)
    _ballast(small_fs)
    longer = Metadata(read_segment=3, read_position=16, write_segment=3, write_position=900, depth=2,
                      kept=tuple((i, i, {"a": i}) for i in range(1000)), kept_count=1000, sequence=8)
    assert len(encode_metadata(longer)) > 3 * 4096
    with pytest.raises(OSError) as refused:
        checkpoint.save(longer)
    assert refused.value.errno == errno.ENOSPC
    assert load_metadata(path) == first
    (small_fs / "ballast").unlink()
    checkpoint.save(longer)
    assert load_metadata(path) == longer


def test_a_checkpoint_write_cut_short_puts_the_last_document_back(tmp_path, monkeypatch):
    """Where blocks cannot be reserved ahead, a short write is undone with the document it replaced."""
    path = tmp_path / "q.checkpoint.json"
    first = Metadata(read_segment=1, read_position=16, write_segment=1, write_position=64, depth=1, sequence=2)
    checkpoint = CheckpointFile((path, path.with_name("q.checkpoint.b.json")))
    checkpoint.save(first)
    real_pwrite = os.pwrite
    calls = []

    def half(fd, data, offset):
        calls.append(len(data))
        if len(calls) == 1:  # the longer save: half of it lands, then the disk is full
            return real_pwrite(fd, bytes(data)[:len(data) // 2 + 100], offset)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", half)
    longer = Metadata(read_segment=1, read_position=16, write_segment=1, write_position=64, depth=1,
                      kept=tuple((i, i, {"a": i}) for i in range(100)), kept_count=100, sequence=3)
    with pytest.raises(OSError):
        checkpoint.save(longer)
    assert load_metadata(path) == first


def test_a_batch_written_in_parts_is_still_all_or_nothing(tmp_path, monkeypatch):
    """A batch over WRITE_STEP_BYTES is joined a part at a time; a part refused after others were
    written (here in another segment) takes the whole batch back."""
    real_pwrite = writer_module.pwrite
    sizes = []
    refuse_at = [0]  # refuse the write with this number (0: none)

    def counted(fd, data, offset):
        sizes.append(len(data))
        if len(sizes) == refuse_at[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    queue = DiskQueue("q", tmp_path, max_bytes_per_file=6 << 20)
    queue.put(b"before")
    batch = [b"%04d" % n + b"b" * (100_000 - 4) for n in range(120)]  # 12 MB: 3 parts, 2 segments
    monkeypatch.setattr(writer_module, "pwrite", counted)
    positions = queue.put_positioned(batch)
    assert max(sizes) <= writer_module.WRITE_STEP_BYTES and len(sizes) >= 3
    assert queue.read_at([positions[0], positions[-1]]) == [batch[0], batch[-1]]
    sizes.clear()
    refuse_at[0] = 3  # the next batch's second part, after its first filled a segment and began one
    with pytest.raises(DiskQueueWriteError, match="No space left"):
        queue.put_many([b"%04d" % n + b"r" * (100_000 - 4) for n in range(120)])
    assert queue.depth == 1 + len(batch)
    monkeypatch.undo()
    queue.put(b"after")
    queue.close()
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=6 << 20)
    assert drain(queue) == [b"before", *batch, b"after"]
    assert queue.statistics().corrupt_records_skipped == 0
    queue.close()
