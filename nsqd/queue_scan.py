"""queueScanLoop: Redis' probabilistic expiration applied to channels.

Every ``queue_scan_interval`` (100 ms) pick ``queue_scan_selection_count``
(20) random channels and hand them to a pool of workers, each of which
requeues the channel's timed-out in-flight messages and releases its due
deferred messages. If more than ``queue_scan_dirty_percent`` (25%) of the
selected channels had work, scan again at once instead of sleeping. Every
``queue_scan_refresh_interval`` (5 s) refresh the channel list and resize the
pool to ``1 <= channels * 0.25 <= queue_scan_worker_pool_max`` (4). Unlike
nsqd, a change to the set of channels also triggers a refresh at the next
scan, so a new channel's timeouts are handled within one interval, not five
seconds.

The work itself is synchronous Python on the event loop thread, so workers
are tasks, not threads: the pool bounds how many channels are in progress
and mirrors nsqd's design so the scan behaves the same under load.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Protocol

import trio

if TYPE_CHECKING:
    from .channel import Channel
    from .options import Options


class ScannedDaemon(Protocol):
    """What the scan loop reads from the daemon (the core passes itself)."""

    options: Options
    channels_version: int
    queue_scan_pool: WorkerPool

    def channels(self) -> list[Channel]: ...

    def now_ns(self) -> int: ...


class WorkerPool:
    """Resizable set of scan workers, each with its own cancel scope."""

    def __init__(self, nursery: trio.Nursery, work: trio.MemoryReceiveChannel,
                 responses: trio.MemorySendChannel, now_ns) -> None:
        self._nursery = nursery
        self._work = work
        self._responses = responses
        self._now_ns = now_ns
        self._scopes: list[trio.CancelScope] = []

    @property
    def size(self) -> int:
        return len(self._scopes)

    def resize(self, size: int) -> None:
        while len(self._scopes) < size:
            scope = trio.CancelScope()
            self._scopes.append(scope)
            self._nursery.start_soon(self._worker, scope)
        while len(self._scopes) > size:
            self._scopes.pop().cancel()

    async def _worker(self, scope: trio.CancelScope) -> None:
        with scope:
            async for channel in self._work:
                now = self._now_ns()
                dirty = channel.process_in_flight(now)
                while channel.timeouts_left:  # a mass timeout, in steps: other tasks run between
                    await trio.lowlevel.checkpoint()
                    channel.process_in_flight(now)
                dirty = channel.process_deferred(now) or dirty
                await self._responses.send(dirty)


def pool_size_for(channel_count: int, pool_max: int) -> int:
    return max(1, min(int(channel_count * 0.25), pool_max))


async def queue_scan_loop(nsqd: ScannedDaemon, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    opts = nsqd.options
    selection = opts.queue_scan_selection_count
    work_send, work_recv = trio.open_memory_channel(selection)
    resp_send, resp_recv = trio.open_memory_channel(selection)
    async with trio.open_nursery() as nursery:
        pool = WorkerPool(nursery, work_recv, resp_send, nsqd.now_ns)
        nsqd.queue_scan_pool = pool
        seen_version = nsqd.channels_version
        channels = nsqd.channels()
        pool.resize(pool_size_for(len(channels), opts.queue_scan_worker_pool_max))
        task_status.started(pool)
        next_refresh = trio.current_time() + opts.queue_scan_refresh_interval
        while True:
            await trio.sleep(opts.queue_scan_interval)
            if trio.current_time() >= next_refresh or seen_version != nsqd.channels_version:
                seen_version = nsqd.channels_version
                channels = nsqd.channels()
                pool.resize(pool_size_for(len(channels), opts.queue_scan_worker_pool_max))
                next_refresh = trio.current_time() + opts.queue_scan_refresh_interval
            while channels:
                count = min(selection, len(channels))
                for channel in random.sample(channels, count):
                    await work_send.send(channel)
                dirty = 0
                for _ in range(count):
                    dirty += await resp_recv.receive()
                if dirty / count <= opts.queue_scan_dirty_percent:
                    break
