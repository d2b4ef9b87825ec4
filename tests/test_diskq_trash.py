"""Emptied and deleted segments go to a trash bin and are unlinked off the event loop."""

import trio

from nsqd.diskq import DiskQueue
from nsqd.diskq.trash import TrashBin

from .support import NSQConnection, running_nsqd, tcp_port


def _fill(queue: DiskQueue, path, segments: int) -> None:
    while len(_names(path, ".dat")) < segments:
        queue.put_many([b"x" * 1000] * 50)


def _names(path, suffix):
    return sorted(p.name for p in path.iterdir() if ".diskq." in p.name and p.name.endswith(suffix))


async def test_emptied_segments_are_renamed_at_once_and_unlinked_by_the_bin(tmp_path):
    bin = TrashBin()
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=64 * 1024, trash=bin)
    _fill(queue, tmp_path, 4)
    segments = _names(tmp_path, ".dat")
    queue.empty()
    assert _names(tmp_path, ".dat") == []  # out of the queue's way at once
    assert _names(tmp_path, ".trash") == [name + ".trash" for name in segments] and len(bin) == len(segments)
    assert queue.depth == 0 and queue.read_many(10) == []
    queue.put(b"after")  # the queue goes on in a fresh segment
    assert queue.read_many(10) == [b"after"]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bin.run)
        with trio.fail_after(5):
            while _names(tmp_path, ".trash"):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    queue.delete()
    assert _names(tmp_path, ".trash") and not _names(tmp_path, ".dat")  # the bin is not running now
    assert not (tmp_path / "q.diskq.meta.json").exists()


def test_without_a_bin_segments_are_unlinked_at_once(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=64 * 1024)
    _fill(queue, tmp_path, 3)
    queue.empty()
    assert not _names(tmp_path, ".dat") and not _names(tmp_path, ".trash")


async def test_a_daemon_empties_and_deletes_through_its_bin_and_sweeps_what_a_stop_left(tmp_path):
    async with running_nsqd(tmp_path, max_bytes_per_file=64 * 1024, mem_queue_size=0) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.mpub("t", [b"y" * 1000] * 200)
        await conn.mpub("gone", [b"z" * 1000] * 200)
        assert len(_names(tmp_path, ".dat")) > 4
        nsqd.topics["t"].empty()
        nsqd.delete_topic("gone")
        await conn.mpub("t", [b"kept"])
        with trio.fail_after(5):  # unlinked by the bin's task
            while _names(tmp_path, ".trash"):
                await trio.sleep(0.01)
        assert len(_names(tmp_path, ".dat")) == 1  # t's fresh segment, "kept" in it
        segment = tmp_path / _names(tmp_path, ".dat")[0]
    # a stop (or a crash) before the bin got to them leaves trash that looks like segments inside
    for number in (1, 99):
        (tmp_path / f"t.diskq.{number:06d}.dat.trash").write_bytes(segment.read_bytes())
    async with running_nsqd(tmp_path, max_bytes_per_file=64 * 1024, mem_queue_size=0) as nsqd:
        assert nsqd.topics["t"].depth == 1 and "gone" not in nsqd.topics  # never read as segments
        with trio.fail_after(5):
            while _names(tmp_path, ".trash"):
                await trio.sleep(0.01)
