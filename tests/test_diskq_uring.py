"""Commit rounds synced through io_uring, and the fall back to worker threads."""

import errno
import os
import select

import pytest
import trio

from nsqd.diskq import DiskQueue, DiskQueueWriteError
from nsqd.diskq import queue as queue_module
from nsqd.diskq import uring


def _available() -> bool:
    probe = uring.open_ring()
    if probe is None:
        return False
    probe.close()
    return True


#: where the kernel offers no io_uring (not x86-64, disabled, filtered), queues sync in worker
#: threads, which test_diskq_durability.py covers; these tests need the ring itself
pytestmark = pytest.mark.skipif(not _available(), reason="io_uring is not available on this machine")


@pytest.fixture
def ring():
    opened = uring.open_ring()
    yield opened
    opened.close()


def wait_completed(ring, timeout=5.0):
    poller = select.poll()
    poller.register(ring.fileno, select.POLLIN)
    completed = []
    while ring.in_flight:
        assert poller.poll(timeout * 1000), "no completion"
        completed += ring.reap()
    return completed


def test_a_submitted_sync_completes_with_its_tag(ring, tmp_path):
    fds = [os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT) for name in ("a", "b")]
    for fd in fds:
        os.write(fd, b"x" * 4096)
    ring.submit(fds, tag=7)
    assert ring.in_flight == 2
    assert wait_completed(ring) == [(7, 0), (7, 0)]
    for round_number in range(200):  # the ring's indexes wrap around many times
        ring.submit(fds[:1], tag=round_number)
        assert wait_completed(ring) == [(round_number, 0)]
    for fd in fds:
        os.close(fd)


def test_a_bad_descriptor_completes_with_ebadf(ring, tmp_path):
    fd = os.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    ring.submit([fd], tag=1)
    assert wait_completed(ring) == [(1, -errno.EBADF)]


def test_too_many_syncs_at_once_are_refused_before_submission(ring, tmp_path):
    with pytest.raises(OSError):
        ring.submit([0] * (uring.ENTRIES + 1), tag=1)
    assert ring.in_flight == 0


def test_rings_beyond_the_limit_are_not_opened(monkeypatch):
    monkeypatch.setattr(uring, "MAX_RINGS", uring._open_rings + 2)
    rings = [uring.open_ring(), uring.open_ring()]
    assert None not in rings
    assert uring.open_ring() is None  # the next queue syncs in worker threads
    rings.pop().close()
    again = uring.open_ring()
    assert again is not None
    for ring in (*rings, again):
        ring.close()


def counting_submissions(monkeypatch):
    submitted = []
    real_submit = uring.SyncRing.submit

    def submit(self, fds, tag):
        submitted.append(list(fds))
        real_submit(self, fds, tag)

    monkeypatch.setattr(uring.SyncRing, "submit", submit)
    return submitted


async def test_wait_durable_is_served_by_io_uring(tmp_path, monkeypatch):
    submitted = counting_submissions(monkeypatch)
    queue = DiskQueue("q", tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put(b"first")  # creates the segment: its directory entry is synced in a thread
        await queue.wait_durable()
        syncs = queue.statistics().syncs
        for body in (b"second", b"third"):
            queue.put(body)
            await queue.wait_durable()
        assert len(submitted) == 2 and all(len(fds) == 1 for fds in submitted)
        assert queue.statistics().syncs == syncs + 2
        nursery.cancel_scope.cancel()
    queue.close()
    reopened = DiskQueue("q", tmp_path)
    assert reopened.read_many(5) == [b"first", b"second", b"third"]
    reopened.close()


async def test_a_refused_submission_falls_back_to_worker_threads(tmp_path, monkeypatch):
    threaded = []
    real_execute = queue_module.sync.execute

    def execute(plan, files, gate):
        threaded.append(plan)
        real_execute(plan, files, gate)

    def refuse(self, fds, tag):
        raise OSError(errno.ENOMEM, "io_uring_enter: Cannot allocate memory")

    monkeypatch.setattr(queue_module.sync, "execute", execute)
    monkeypatch.setattr(uring.SyncRing, "submit", refuse)
    queue = DiskQueue("q", tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        for body in (b"a", b"b", b"c"):
            queue.put(body)
            await queue.wait_durable()
        assert len(threaded) == 3  # every round, the refused one included, synced in a thread
        nursery.cancel_scope.cancel()
    queue.close()


async def test_a_failed_sync_fails_its_waiters_and_the_next_round_recovers(tmp_path, monkeypatch):
    real_reap = uring.SyncRing.reap
    failures = [True]

    def reap(self):
        completed = real_reap(self)
        if completed and failures:
            failures.pop()
            return [(tag, -errno.EIO) for tag, _ in completed]
        return completed

    monkeypatch.setattr(uring.SyncRing, "reap", reap)
    queue = DiskQueue("q", tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put(b"a")
        await queue.wait_durable()  # the segment's first round: in a thread, for its directory entry
        queue.put(b"b")
        with pytest.raises(DiskQueueWriteError) as raised:
            await queue.wait_durable()
        assert raised.value.errno == errno.EIO
        assert queue.failing is not None
        queue.put(b"c")
        await queue.wait_durable()
        assert queue.failing is None
        nursery.cancel_scope.cancel()
    queue.close()


async def test_closing_the_queue_while_a_round_is_in_flight(tmp_path, monkeypatch):
    """close() syncs everything itself; the round's own result (here EBADF, as when the
    kernel's worker finds the descriptor closed) no longer counts."""
    real_reap = uring.SyncRing.reap
    held = []
    holding = [True]

    def reap(self):
        completed = real_reap(self)
        if holding[0]:
            self.in_flight += len(completed)
            held.extend((tag, -errno.EBADF) for tag, _ in completed)
            return []
        self.in_flight -= len(held)
        return completed + held

    monkeypatch.setattr(uring.SyncRing, "reap", reap)
    queue = DiskQueue("q", tmp_path)
    outcomes = []

    async def producer(body):
        queue.put(body)
        try:
            await queue.wait_durable()
            outcomes.append(body)
        except DiskQueueWriteError as exc:
            outcomes.append(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        holding[0] = False
        await producer(b"a")  # the segment's first round
        holding[0] = True
        nursery.start_soon(producer, b"b")
        with trio.fail_after(5):
            while not held:
                await trio.sleep(0.001)
        ring = queue._ring
        queue.close()
        holding[0] = False
        os.eventfd_write(ring.fileno, 1)  # wake the run task to reap what was held
    assert outcomes == [b"a", b"b"]
    reopened = DiskQueue("q", tmp_path)
    assert reopened.read_many(5) == [b"a", b"b"]
    reopened.close()


async def test_the_next_round_is_submitted_before_the_last_ones_waiters_are_answered(tmp_path, monkeypatch):
    """Answering a round's waiters (an ``OK`` written to each of dozens of connections) takes
    about as long as a sync: the disk must be syncing the next round meanwhile, not idle."""
    submitted = counting_submissions(monkeypatch)
    real_reap = uring.SyncRing.reap
    rings, held, holding = [], [], [False]

    def reap(self):
        completed = real_reap(self)
        rings.append(self)
        if holding[0]:
            self.in_flight += len(completed)
            held.extend(completed)
            return []
        self.in_flight -= len(held)
        completed, held[:] = completed + held, []
        return completed

    monkeypatch.setattr(uring.SyncRing, "reap", reap)
    queue = DiskQueue("q", tmp_path)
    answered = []
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put(b"a")
        await queue.wait_durable()  # the segment's first round: in a thread, for its directory entry
        before = len(submitted)
        holding[0] = True
        queue.put(b"b")
        queue.on_durable(lambda error: answered.append(("b", error, len(submitted))))
        with trio.fail_after(5):
            while not held:  # b's round synced; its completion is held back
                await trio.sleep(0.001)
        queue.put(b"c")  # joins the next round
        queue.on_durable(lambda error: answered.append(("c", error, len(submitted))))
        holding[0] = False
        os.eventfd_write(rings[-1].fileno, 1)
        with trio.fail_after(5):
            while len(answered) < 2:
                await trio.sleep(0.001)
        # b's waiter was answered with c's round already submitted
        assert answered == [("b", None, before + 2), ("c", None, before + 2)]
        nursery.cancel_scope.cancel()
    queue.close()
    reopened = DiskQueue("q", tmp_path)
    assert reopened.read_many(5) == [b"a", b"b", b"c"]
    reopened.close()
