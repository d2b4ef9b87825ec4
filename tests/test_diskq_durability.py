"""Group commit, checkpoints and the run() task."""

import contextlib
import errno
import json
import os
import time

import pytest
import trio
import trio.testing

from nsqd.diskq import DiskQueue, DiskQueueError, DiskQueueWriteError
from nsqd.diskq import queue as queue_module
from nsqd.diskq import writer as writer_module


def metadata(path, name="q"):
    """The newest save: the metadata file or, while the queue runs, its checkpoint file (a new
    queue has neither until its first checkpoint: no file says what an empty one would)."""
    files = (path / f"{name}.diskq.meta.json", path / f"{name}.diskq.checkpoint.json",
             path / f"{name}.diskq.checkpoint.b.json")
    saved = [json.loads(file.read_text()) for file in files if file.exists()]
    return max(saved, key=lambda document: document.get("sequence", 0), default={"depth": 0})


@pytest.fixture(params=["uring", "thread"])
def counted_syncs(request, monkeypatch):
    """Counts commits that sync: through io_uring, or (``thread``) with it turned off; the real work still runs."""
    if request.param == "thread":
        monkeypatch.setattr(queue_module.uring, "open_ring", lambda: None)
    calls = []
    real_sync = queue_module.DiskQueue._sync

    async def counted(self, plan, commit, target):
        calls.append(plan)
        await real_sync(self, plan, commit, target)

    monkeypatch.setattr(queue_module.DiskQueue, "_sync", counted)
    return calls


@pytest.fixture
def in_threads(monkeypatch):
    """Commits sync in worker threads (``sync.execute``), as where io_uring is not available."""
    monkeypatch.setattr(queue_module.uring, "open_ring", lambda: None)


async def start_cancellable_run(nursery, queue) -> trio.CancelScope:
    """Start ``queue.run()`` in the nursery; cancelling the returned scope stops only it."""
    run_scope = trio.CancelScope()

    async def run_until_cancelled(task_status=trio.TASK_STATUS_IGNORED):
        with run_scope:
            await queue.run(task_status=task_status)

    await nursery.start(run_until_cancelled)
    return run_scope


async def wait_until(predicate, timeout=5.0):
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


async def test_wait_durable_needs_run(tmp_path):
    queue = DiskQueue("q", tmp_path)
    queue.put(b"x")
    with pytest.raises(DiskQueueError, match="needs run"):
        await queue.wait_durable()
    queue.close()


async def test_wait_durable_waits_for_a_run_that_is_scheduled(tmp_path, counted_syncs):
    queue = DiskQueue("q", tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)  # begins at the next checkpoint, after the put
        queue.run_scheduled()
        queue.put(b"x")
        await queue.wait_durable()
        assert len(counted_syncs) == 1
        nursery.cancel_scope.cancel()
    queue.close()


async def test_wait_durable_with_nothing_put_returns_at_once(tmp_path, counted_syncs):
    queue = DiskQueue("q", tmp_path)
    await queue.wait_durable()
    assert counted_syncs == []
    queue.close()


async def test_wait_durable_writes_and_syncs(tmp_path, counted_syncs):
    queue = DiskQueue("q", tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put_many([b"a" * 10, b"b" * 10])
        await queue.wait_durable()
        assert len(counted_syncs) == 1
        assert counted_syncs[0].fds  # the segment descriptor was fsynced
        assert (tmp_path / "q.diskq.000000.dat").stat().st_size == 16 + 2 * 18
        await queue.wait_durable()  # nothing new: no second fsync
        assert len(counted_syncs) == 1
        nursery.cancel_scope.cancel()
    queue.close()


async def test_concurrent_waiters_share_one_fsync(tmp_path, counted_syncs):
    queue = DiskQueue("q", tmp_path)
    confirmed = []

    async def producer(number):
        queue.put(b"%d" % number)
        await queue.wait_durable()
        confirmed.append(number)

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        async with trio.open_nursery() as producers:
            for number in range(50):
                producers.start_soon(producer, number)
        nursery.cancel_scope.cancel()
    assert sorted(confirmed) == list(range(50))
    assert 1 <= len(counted_syncs) <= 3
    queue.close()


async def test_waiter_after_a_commit_started_gets_a_later_commit(tmp_path, counted_syncs):
    queue = DiskQueue("q", tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        for round_number in range(5):
            queue.put(b"r%d" % round_number)
            await queue.wait_durable()
        nursery.cancel_scope.cancel()
    assert len(counted_syncs) == 5
    queue.close()


async def test_the_next_round_starts_before_the_waiters_of_the_last_one_run_again(tmp_path, monkeypatch):
    """Rounds back to back: a waiter that joined while a round was in flight is being synced by the
    next round before anything else runs (no scheduler pass between rounds, however busy the loop)."""
    if queue_module.uring.open_ring() is None:
        pytest.skip("io_uring is not available here: commits sync in worker threads")
    calls = []
    gate = trio.Event()
    real_sync = queue_module.DiskQueue._sync

    async def gated(self, plan, commit, target):
        calls.append(plan)
        await gate.wait()  # the round is in flight until the test has its next waiter join
        await real_sync(self, plan, commit, target)

    monkeypatch.setattr(queue_module.DiskQueue, "_sync", gated)
    queue = DiskQueue("q", tmp_path)
    rounds_started_when_released = []

    async def first_waiter():
        await queue.wait_durable()
        rounds_started_when_released.append(len(calls))

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        gate.set()
        queue.put(b"warm-up")  # its round also syncs the new segment's directory entry, in a worker thread
        await queue.wait_durable()
        done_before = len(calls)
        for attempt in range(8):  # the order within one scheduler pass is random: one pass would pass by luck
            gate = trio.Event()
            queue.put(b"first")
            nursery.start_soon(first_waiter)
            await trio.testing.wait_all_tasks_blocked()  # the round for "first" is in flight
            queue.put(b"next")
            second = []
            queue.on_durable(second.append)
            gate.set()
            await wait_until(lambda: second)
            assert rounds_started_when_released[attempt] == done_before + 2 * attempt + 2  # "next"'s had started
        nursery.cancel_scope.cancel()
    queue.close()


async def test_cancelling_run_under_a_steady_stream_of_waiters_ends_it(tmp_path, counted_syncs):
    """Every round settles with a waiter for the next one already joined, so rounds run back to back;
    cancelling run() still ends it after the round in flight."""
    queue = DiskQueue("q", tmp_path)
    outcome = []

    def again(error):
        if error is not None or len(counted_syncs) >= 500:
            outcome.append(error)
            return
        queue.put(b"x")
        queue.on_durable(again)  # joins the next round while this one settles

    async with trio.open_nursery() as nursery:
        run_scope = await start_cancellable_run(nursery, queue)
        again(None)
        await wait_until(lambda: len(counted_syncs) >= 20)
        cancelled_at = len(counted_syncs)
        run_scope.cancel()
    assert len(counted_syncs) <= cancelled_at + 1
    assert [str(error) for error in outcome] == ["disk queue 'q': run() stopped"]
    queue.close()


async def test_on_durable_calls_back_from_the_round_or_at_once(tmp_path, counted_syncs):
    queue = DiskQueue("q", tmp_path)
    calls = []
    queue.on_durable(calls.append)  # nothing put: at once
    assert calls == [None]
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put(b"a")
        queue.on_durable(lambda error: calls.append(("first", error, len(counted_syncs))))
        queue.on_durable(lambda error: calls.append(("second", error, len(counted_syncs))))
        assert len(calls) == 1  # not before the round
        await wait_until(lambda: len(calls) == 3)
        assert calls[1:] == [("first", None, 1), ("second", None, 1)]  # one fsync served both
        nursery.cancel_scope.cancel()
    queue.close()


async def test_on_durable_needs_run(tmp_path):
    queue = DiskQueue("q", tmp_path)
    queue.put(b"x")
    with pytest.raises(DiskQueueError, match="needs run"):
        queue.on_durable(lambda error: None)
    queue.close()


async def test_a_callback_that_raises_does_not_stop_the_commits(tmp_path, counted_syncs):
    queue = DiskQueue("q", tmp_path)
    calls = []

    def broken(error):
        raise RuntimeError("a waiter's bug")

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put(b"a")
        queue.on_durable(broken)
        queue.on_durable(calls.append)
        await wait_until(lambda: calls)
        queue.put(b"b")
        await queue.wait_durable()  # the run task goes on committing
        assert calls == [None] and len(counted_syncs) == 2
        nursery.cancel_scope.cancel()
    queue.close()


async def test_a_failed_fsync_reaches_the_callbacks(tmp_path, monkeypatch, in_threads):
    queue = DiskQueue("q", tmp_path)
    calls = []

    def failing_fdatasync(fd):
        raise OSError(errno.EIO, "Input/output error")

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put(b"x")
        monkeypatch.setattr(os, "fdatasync", failing_fdatasync)
        queue.on_durable(calls.append)
        await wait_until(lambda: calls)
        assert isinstance(calls[0], DiskQueueWriteError) and calls[0].errno == errno.EIO
        monkeypatch.undo()
        queue.on_durable(calls.append)  # the next round syncs again
        await wait_until(lambda: len(calls) == 2)
        assert calls[1] is None
        nursery.cancel_scope.cancel()
    queue.close()


def test_a_new_queue_writes_nothing_until_it_holds_something(tmp_path, monkeypatch):
    """A new topic or channel opens its queues on the event loop: with no file present, no
    metadata file is written (its two fsyncs took 33-57 ms there with a busy disk)."""
    fsyncs = []
    monkeypatch.setattr(os, "fsync", lambda fd: fsyncs.append(fd))
    queue = DiskQueue("q", tmp_path, lock_file=False)
    assert fsyncs == [] and list(tmp_path.iterdir()) == []
    queue.close()   # closed untouched: still nothing to say
    assert fsyncs == [] and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    queue = DiskQueue("q", tmp_path, lock_file=False)
    queue.put_many([b"a", b"b"])   # written to the OS, never checkpointed: then the process dies
    crashed = queue
    reopened = DiskQueue("q", tmp_path, lock_file=False)
    assert reopened.depth == 2 and reopened.read_many(5) == [b"a", b"b"]
    reopened.close()
    assert metadata(tmp_path)["depth"] == 0
    del crashed


def test_queues_closed_together_share_two_syncs_and_lose_nothing(tmp_path, monkeypatch):
    """Shutdown closes thousands of queues: one syncfs and one directory fsync for all of them,
    not three fsyncs each, and each reopens with its records and released segments gone."""
    from nsqd.diskq import close_many, sync

    queues = [DiskQueue(f"q{n}", tmp_path, lock_file=False, max_bytes_per_file=16 + 2 * 9) for n in range(20)]
    for queue in queues:
        queue.put_many([b"%d" % (n % 10) for n in range(6)])   # three segments
        assert len(queue.read_many(3)) == 3                      # the first one released
    calls = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync"))
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append("fdatasync"))
    real_sync_filesystem = sync.sync_filesystem
    monkeypatch.setattr(sync, "sync_filesystem", lambda d: calls.append("syncfs") or real_sync_filesystem(d))
    assert close_many(queues) == [None] * 20
    # one syncfs, then each file's own error asked for (clean pages by then), one directory fsync
    assert calls[0] == "syncfs" and calls[-1] == "fsync" and set(calls[1:-1]) == {"fdatasync"}
    assert "fsync" not in calls[:-1]
    monkeypatch.undo()
    for queue in queues:
        queue.closed_files(None)
        assert queue.closed
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*checkpoint*"))
    for n in range(20):
        assert not (tmp_path / f"q{n}.diskq.000000.dat").exists()
        reopened = DiskQueue(f"q{n}", tmp_path, lock_file=False, max_bytes_per_file=16 + 2 * 9)
        assert reopened.read_many(10) == [b"3", b"4", b"5"]
        reopened.close()


def test_a_write_back_error_syncfs_does_not_report_fails_that_queue_only(tmp_path, monkeypatch):
    from nsqd.diskq import close_many

    queues = [DiskQueue(f"q{n}", tmp_path, lock_file=False) for n in range(3)]
    for queue in queues:
        queue.put_many([b"x"])
    bad = set(queues[1]._writer.unsynced_fds())
    real_fdatasync = os.fdatasync

    def fdatasync(fd):
        if fd in bad:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    errors = close_many(queues)
    monkeypatch.undo()
    assert errors[0] is None and errors[2] is None and errors[1].errno == errno.EIO
    assert not (tmp_path / "q1.diskq.meta.json").exists()   # nothing says its record is safe
    assert (tmp_path / "q0.diskq.meta.json").exists() and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(DiskQueueWriteError, match="Input/output error"):
        queues[1].closed_files(errors[1])


def test_a_queue_that_cannot_be_staged_is_closed_on_its_own_and_a_failed_sync_closes_each_alone(
        tmp_path, monkeypatch):
    from nsqd.diskq import close_many, sync

    queues = [DiskQueue(f"q{n}", tmp_path, lock_file=False) for n in range(3)]
    for queue in queues:
        queue.put_many([b"x", b"y"])
    (tmp_path / "q1.diskq.meta.json.tmp").mkdir()   # its staging fails; so will its own save
    errors = close_many(queues)
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], DiskQueueWriteError)
    for queue, error in zip(queues, errors):
        with pytest.raises(DiskQueueWriteError) if error else contextlib.nullcontext():
            queue.closed_files(error)
    (tmp_path / "q1.diskq.meta.json.tmp").rmdir()
    for n in (0, 2):
        reopened = DiskQueue(f"q{n}", tmp_path, lock_file=False)
        assert reopened.read_many(5) == [b"x", b"y"]
        reopened.put(b"z")
        queues[n] = reopened
    queues = [queues[0], queues[2]]

    def failing(directory):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(sync, "sync_filesystem", failing)
    assert close_many(queues) == [None, None]   # each closed alone, with its own fsyncs, instead
    for queue in queues:
        queue.closed_files(None)
    monkeypatch.undo()
    for n in (0, 2):
        reopened = DiskQueue(f"q{n}", tmp_path, lock_file=False)
        assert reopened.read_many(5) == [b"z"]
        reopened.close()


async def test_sync_every_triggers_a_checkpoint(tmp_path):
    queue = DiskQueue("q", tmp_path, sync_every=10, sync_timeout=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put_many([b"x"] * 9)
        await trio.sleep(0.05)
        assert metadata(tmp_path)["depth"] == 0
        queue.put(b"x")
        await wait_until(lambda: metadata(tmp_path)["depth"] == 10)
        assert metadata(tmp_path)["write_position"] == 16 + 10 * 9
        nursery.cancel_scope.cancel()
    queue.close()


async def test_sync_timeout_checkpoints_unsynced_writes_and_reads(tmp_path):
    queue = DiskQueue("q", tmp_path, sync_timeout=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put_many([b"a", b"b", b"c"])
        await wait_until(lambda: metadata(tmp_path)["depth"] == 3)
        queue.read_many(2)
        await wait_until(lambda: metadata(tmp_path)["depth"] == 1)
        assert metadata(tmp_path)["read_position"] == 16 + 2 * 9
        nursery.cancel_scope.cancel()
    queue.close()


class TaskSteps(trio.abc.Instrument):
    """Counts the scheduler steps of tasks whose name ends with ``suffix``."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.steps = 0

    def before_task_step(self, task) -> None:
        if task.name.endswith(self.suffix):
            self.steps += 1


async def test_a_clean_queue_sleeps_until_something_changes(tmp_path):
    """Thousands of idle topics and channels must cost no CPU: a clean queue's run() never wakes by itself."""
    queue = DiskQueue("q", tmp_path, sync_timeout=0.02)
    steps = TaskSteps("DiskQueue.run")
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put_many([b"a", b"b"])
        await wait_until(lambda: metadata(tmp_path)["depth"] == 2)
        await wait_until(lambda: queue._checkpoint_file.unsynced_fd() is None)  # its round synced it
        trio.lowlevel.add_instrument(steps)
        await trio.sleep(0.3)  # 15 sync timeouts with nothing to save
        assert steps.steps == 0
        queue.read_many(1)  # the first change after the idle spell is checkpointed as before
        await wait_until(lambda: metadata(tmp_path)["depth"] == 1)
        assert steps.steps >= 1
        queue.put_many([b"c"])
        await wait_until(lambda: metadata(tmp_path)["depth"] == 2)
        trio.lowlevel.remove_instrument(steps)
        nursery.cancel_scope.cancel()
    queue.close()


async def test_read_segments_are_deleted_by_the_background_checkpoint(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=16 + 2 * 9, sync_timeout=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put_many([b"%d" % (n % 10) for n in range(6)])
        await queue.wait_durable()
        assert len(list(tmp_path.glob("*.dat"))) == 3
        assert len(queue.read_many(5)) == 5
        await wait_until(lambda: len(list(tmp_path.glob("*.dat"))) == 1)
        assert metadata(tmp_path)["read_segment"] == 2
        nursery.cancel_scope.cancel()
    queue.close()


async def test_cancelling_run_finishes_the_commit_in_flight_and_fails_later_waiters(tmp_path, monkeypatch, in_threads):
    queue = DiskQueue("q", tmp_path)
    real_execute = queue_module.sync.execute
    in_thread = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def slow_execute(plan, files, gate):
        token.run_sync_soon(in_thread.set)
        time.sleep(0.2)  # keep the commit in flight while the test cancels run()
        real_execute(plan, files, gate)

    monkeypatch.setattr(queue_module.sync, "execute", slow_execute)
    outcomes = {}

    async def producer(name):
        queue.put(name.encode())
        try:
            await queue.wait_durable()
            outcomes[name] = "durable"
        except DiskQueueError as exc:
            outcomes[name] = str(exc)

    async with trio.open_nursery() as nursery:
        run_scope = await start_cancellable_run(nursery, queue)
        nursery.start_soon(producer, "first")
        await in_thread.wait()
        nursery.start_soon(producer, "second")
        await trio.testing.wait_all_tasks_blocked()
        run_scope.cancel()
    assert outcomes == {"first": "durable", "second": "disk queue 'q': run() stopped"}
    queue.close()


async def test_run_twice_is_refused(tmp_path):
    queue = DiskQueue("q", tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        with pytest.raises(DiskQueueError, match="already running"):
            await queue.run()
        nursery.cancel_scope.cancel()
    queue.close()


async def test_close_while_running_stops_run_and_releases_waiters(tmp_path):
    queue = DiskQueue("q", tmp_path, sync_timeout=60)
    results = []

    async def waiter():
        await queue.wait_durable()
        results.append("durable")

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put(b"x")
        nursery.start_soon(waiter)
        await trio.sleep(0)
        queue.close()
    assert results == ["durable"]
    reopened = DiskQueue("q", tmp_path)
    assert reopened.read_many(2) == [b"x"]
    reopened.close()


async def test_failed_write_refuses_the_put_and_the_queue_recovers(tmp_path, monkeypatch):
    queue = DiskQueue("q", tmp_path)
    real_pwrite = writer_module.pwrite
    failing = True

    def pwrite(fd, data, offset):
        if failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(writer_module, "pwrite", pwrite)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        with pytest.raises(DiskQueueWriteError) as caught:
            queue.put(b"refused")
        assert caught.value.errno == errno.EIO
        assert "Input/output error" in str(caught.value)
        assert queue.failing is not None
        failing = False
        queue.put(b"x")
        await queue.wait_durable()
        assert queue.failing is None
        nursery.cancel_scope.cancel()
    queue.close()
    reopened = DiskQueue("q", tmp_path)
    assert reopened.read_many(5) == [b"x"]
    reopened.close()


async def test_failed_fsync_reports_to_its_waiters(tmp_path, monkeypatch, in_threads):
    queue = DiskQueue("q", tmp_path)

    def fdatasync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put(b"x")
        monkeypatch.setattr(queue_module.sync.os, "fdatasync", fdatasync)
        with pytest.raises(DiskQueueWriteError, match="Input/output error") as caught:
            await queue.wait_durable()
        assert caught.value.errno == errno.EIO
        assert "Errno 5" in queue.statistics().last_error
        monkeypatch.undo()
        await queue.wait_durable()
        nursery.cancel_scope.cancel()
    queue.close()


async def test_failing_background_checkpoints_retry_at_the_timeout_pace(tmp_path, monkeypatch, in_threads):
    attempts = []

    def fdatasync(fd):
        attempts.append(time.monotonic())  # called in the worker thread
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    queue = DiskQueue("q", tmp_path, sync_timeout=0.05, sync_every=1)
    monkeypatch.setattr(queue_module.sync.os, "fdatasync", fdatasync)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put(b"x")  # requests a checkpoint at once (sync_every=1); it keeps failing
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    assert 3 <= len(attempts) <= 14  # about one per sync_timeout, not a busy loop
    assert "Input/output error" in queue.statistics().last_error
    monkeypatch.undo()
    queue.close()
    reopened = DiskQueue("q", tmp_path)
    assert reopened.read_many(5) == [b"x"]
    reopened.close()


async def test_a_bug_in_the_sync_thread_fails_the_waiters_and_surfaces_from_run(tmp_path, monkeypatch, in_threads):
    queue = DiskQueue("q", tmp_path)

    def broken(plan, files, gate):
        raise RuntimeError("not an I/O error")

    monkeypatch.setattr(queue_module.sync, "execute", broken)
    outcomes = []

    async def producer():
        queue.put(b"x")
        try:
            await queue.wait_durable()
        except DiskQueueError as exc:
            outcomes.append(str(exc))

    with pytest.raises(BaseExceptionGroup) as raised:
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            nursery.start_soon(producer)
    assert raised.value.subgroup(lambda e: isinstance(e, RuntimeError) and "not an I/O error" in str(e)) is not None
    assert len(outcomes) == 1 and "sync failed" in outcomes[0]
    monkeypatch.undo()
    queue.close()


async def test_a_commit_waits_for_a_free_worker_thread(tmp_path):
    queue = DiskQueue("q", tmp_path)
    limiter = trio.to_thread.current_default_thread_limiter()
    holders = [object() for _ in range(int(limiter.total_tokens))]
    for holder in holders:  # every worker thread busy elsewhere
        await limiter.acquire_on_behalf_of(holder)
    done = trio.Event()

    async def producer():
        queue.put(b"x")
        await queue.wait_durable()
        done.set()

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            nursery.start_soon(producer)
            await trio.sleep(0.1)
            assert not done.is_set()
            limiter.release_on_behalf_of(holders.pop())
            with trio.fail_after(5):
                await done.wait()
            nursery.cancel_scope.cancel()
    finally:
        for holder in holders:
            limiter.release_on_behalf_of(holder)
    queue.close()


async def test_the_checkpoint_saved_last_is_fsynced_by_the_next_round(tmp_path, counted_syncs):
    """A checkpoint was a pwrite left to write-back: after a power loss its file held zeros (blocks
    reserved, not yet written) and every record finished since the queue opened came back. The
    checkpoint saved last is now synced by the next round (one of its own before the queue
    rests), and the next save goes to the other file; a save that only moved the write position
    needs no sync (lost, it would deliver nothing again)."""
    queue = DiskQueue("q", tmp_path, sync_every=1)
    first, second = tmp_path / "q.diskq.checkpoint.json", tmp_path / "q.diskq.checkpoint.b.json"
    synced = []  # the checkpoint files' inodes, as each sync covering one completed
    real_synced = queue._checkpoint_file.synced
    queue._checkpoint_file.synced = lambda fd: (synced.append(os.fstat(fd).st_ino), real_synced(fd))

    def sequence(path):
        return json.loads(path.read_text())["sequence"]

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put_many([b"a", b"b"])
        await queue.wait_durable()
        await wait_until(lambda: synced)  # the data's round, then one for the checkpoint
        assert len(counted_syncs) == 2 and counted_syncs[1].fds == [counted_syncs[1].checkpoint_fd]
        assert synced == [first.stat().st_ino]
        queue.put(b"c")  # only the write position moves
        await queue.wait_durable()
        await wait_until(second.exists)  # the synced one is kept
        assert sequence(second) > sequence(first)
        await trio.sleep(0.05)
        assert len(counted_syncs) == 3 and synced == [first.stat().st_ino]  # no round for it
        assert queue.read_many(1)  # where reading stands moves: that save is synced
        await wait_until(lambda: len(synced) == 2)
        assert synced == [first.stat().st_ino, second.stat().st_ino]
        await trio.sleep(0.05)
        assert len(counted_syncs) == 4  # its checkpoint round had nothing to sync; then it rests
        nursery.cancel_scope.cancel()
    queue.close()
    assert not first.exists() and not second.exists()  # the metadata file holds the newest save
