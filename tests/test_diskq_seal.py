"""A queue read to its end starts a new segment, so that the read one can be deleted.

Without this a drained queue kept its last segment (up to
``--max-bytes-per-file``) until that segment filled, space a full disk
never got back however much the consumers read.
"""

import pytest
import trio

from nsqd.diskq import DiskQueue, queue as queue_module

from .test_diskq_release import Keeper, drain, payloads


def segments(path):
    return sorted(p.name for p in path.glob("q.diskq.*.dat"))


async def test_a_drained_queue_gives_its_segment_back_once_its_records_are_released(tmp_path):
    queue = DiskQueue("q", tmp_path, sync_every=1_000_000, sync_timeout=60)
    keeper = queue.keeper = Keeper()
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put_many(payloads(50))
        records, positions = queue.read_positioned(100)
        assert records == payloads(50)
        before = segments(tmp_path)
        assert len(before) == 1
        keeper.held = {positions[49]: None}  # one still in flight
        assert queue.seal_if_drained(0)
        assert not queue.seal_if_drained(0)  # nothing written since: nothing to seal
        queue.request_checkpoint()
        await queue.wait_durable()
        await trio.sleep(0.1)
        assert segments(tmp_path) == before  # the kept record holds it
        keeper.held = {}
        queue.request_checkpoint()
        with trio.fail_after(5):
            while segments(tmp_path):
                await trio.sleep(0.01)
        queue.put_many(payloads(3, start=50))  # writing goes on in a new segment
        assert segments(tmp_path) != before
        assert drain(queue) == payloads(3, start=50)
        nursery.cancel_scope.cancel()
    queue.close()


def test_a_queue_that_is_not_drained_is_not_sealed(tmp_path):
    queue = DiskQueue("q", tmp_path)
    assert not queue.seal_if_drained(0)  # empty
    queue.put_many(payloads(5))
    assert not queue.seal_if_drained(0)  # unread records
    assert queue.read_many(4) == payloads(4)
    assert not queue.seal_if_drained(0)
    assert queue.read_many(4) == payloads(1, start=4)
    assert not queue.seal_if_drained(10 << 20)  # smaller than asked
    assert queue.seal_if_drained(0)
    queue.close()


def test_after_a_seal_a_restart_brings_back_the_kept_records_and_only_them(tmp_path):
    queue = DiskQueue("q", tmp_path)
    keeper = queue.keeper = Keeper()
    queue.put_many(payloads(10))
    _, positions = queue.read_positioned(10)
    assert queue.seal_if_drained(0)
    keeper.held = {positions[3]: {"a": 2}, positions[7]: None}
    queue.close()  # the saved read position is in a segment that was never written

    queue = DiskQueue("q", tmp_path)
    assert queue.depth == 2
    assert queue.recovered_kept == ((positions[3], positions[3], {"a": 2}),)
    records, again = queue.read_positioned(100)
    assert records == [payloads(10)[3], payloads(10)[7]] and again == (positions[3], positions[7])
    queue.put_many(payloads(2, start=10))
    assert drain(queue) == payloads(2, start=10)
    queue.close()

    queue = DiskQueue("q", tmp_path)  # nothing kept any more: the first segment is gone
    assert queue.depth == 0 and drain(queue) == []
    assert len(segments(tmp_path)) == 1
    queue.close()


def test_a_crash_right_after_a_seal_loses_nothing_and_brings_back_nothing_finished(tmp_path):
    queue = DiskQueue("q", tmp_path)
    keeper = queue.keeper = Keeper()
    queue.put_many(payloads(10))
    _, positions = queue.read_positioned(10)
    keeper.held = {positions[5]: None}
    queue.request_checkpoint()
    queue.close()
    queue = DiskQueue("q", tmp_path)
    queue.keeper = keeper = Keeper()
    records, again = queue.read_positioned(10)
    assert records == [payloads(10)[5]]
    keeper.held = {again[0]: None}
    assert queue.seal_if_drained(0)
    queue.put_many(payloads(1, start=10))
    queue._shut()  # as after a SIGKILL: the metadata still has the segment before the seal
    queue = DiskQueue("q", tmp_path)
    assert drain(queue) == [payloads(10)[5], payloads(1, start=10)[0]]
    queue.close()


def test_reading_a_big_segment_to_its_end_seals_it(tmp_path, monkeypatch):
    monkeypatch.setattr(queue_module, "SEAL_DRAINED", 2000)
    queue = DiskQueue("q", tmp_path)
    queue.put_many(payloads(10))  # 1 KB: below the mark
    assert drain(queue) == payloads(10)
    assert len(segments(tmp_path)) == 1
    first = segments(tmp_path)
    queue.put_many(payloads(20, start=10))
    assert drain(queue) == payloads(20, start=10)  # now past it: the next write starts a new segment
    queue.put_many(payloads(1, start=30))
    assert segments(tmp_path) != first and len(segments(tmp_path)) == 2
    assert drain(queue) == payloads(1, start=30)
    queue.close()
    assert len(segments(tmp_path)) == 1  # the read one went at the close's checkpoint



@pytest.mark.parametrize("mark,value", [("SEAL_DRAINED", 2000), ("LOW_SPACE", 1 << 62)])
def test_a_read_that_takes_exactly_the_last_records_seals_too(tmp_path, monkeypatch, mark, value):
    """The read that reaches the end may take a full batch: it is the last one all the same (no
    read follows a drained queue), so it must seal, or a nearly full disk never got its room back.
    (A big segment, or any segment while the file system is "nearly full".)"""
    monkeypatch.setattr(queue_module, mark, value)
    queue = DiskQueue("q", tmp_path)
    queue.put_many(payloads(30))  # 3 KB
    first = segments(tmp_path)
    assert queue.read_many(30) == payloads(30)  # exactly what is there, in one batch
    queue.put_many(payloads(1, start=30))
    assert segments(tmp_path) != first and len(segments(tmp_path)) == 2
    queue.close()
