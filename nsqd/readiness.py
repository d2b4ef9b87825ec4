"""One edge-triggered epoll that tells every plain TCP connection when it can read.

Trio's own ``wait_readable`` registers the descriptor anew (``epoll_ctl``)
on every wait: one of the four system calls of a single ``PUB`` and its
answer, about a tenth of the daemon's CPU with 100 publishers sending one
message at a time. Here each connection's socket is registered once,
edge-triggered, and one task waits on this epoll for all of them; a wake-up
covers every connection that became readable since the last one.

An edge goes to the connection's parked reader: first to its ``inline``
callback, if it has one, which may serve the socket right here, in the
hub's task, and leave the reader parked (a single PUB and its answer, with
no task switch); else the reader is woken. When no reader is parked the
edge marks the connection ready, so the next :meth:`Watch.wait` returns at
once. The reader reads after every wake-up, and data that arrives after
an edge was handed out raises a new edge, so none is missed; a stale mark
(its data already read) costs one read that finds nothing. A hang-up or an
error is remembered for good: a read that returns data leaves the end of the
stream behind it, and no later edge would announce it. Where
``select.epoll`` does not exist, connections wait with Trio's
``wait_readable``.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
import trio

if TYPE_CHECKING:
    from .staging import PublishBatch

log = structlog.get_logger("nsqd.readiness")

_EVENTS = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLET", 0)
#: the peer hung up or the socket failed: every later wait returns at once
_ENDED = getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLHUP", 0) | getattr(select, "EPOLLERR", 0)
#: edges handed out per pass; the rest wait for the next pass, after other tasks ran
MAX_EDGES = 128


class Watch:
    """A connection's readiness: marked by the hub, waited on by the connection's reader."""

    __slots__ = ("fd", "ready", "ended", "task", "inline", "error")

    def __init__(self, fd: int, inline: Callable[[], bool] | None = None) -> None:
        self.fd = fd
        #: an edge came while no reader was parked
        self.ready = False
        #: the peer hung up or the socket failed
        self.ended = False
        #: the reader parked in :meth:`wait`, if any
        self.task: trio.lowlevel.Task | None = None
        #: serves an edge for the parked reader in the hub's task; True: served, the reader stays parked
        self.inline = inline
        #: what the inline callback raised: the reader's wait raises it (the connection fails, not the hub)
        self.error: Exception | None = None

    def fail(self, error: Exception) -> None:
        """Wake the reader with ``error``, which its wait raises."""
        self.error = error
        self.wake()

    def wake(self) -> None:
        """Wake the parked reader (or have its next wait return at once)."""
        task = self.task
        if task is None:
            self.ready = True
        else:
            self.task = None
            trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        """Until the socket may have something to read (at once if an edge came meanwhile)."""
        if self.ready or self.ended:
            self.ready = False
            await trio.lowlevel.checkpoint()
        else:
            self.task = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self.task = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class _TrioWatch(Watch):
    """The fallback without epoll: Trio's own wait."""

    __slots__ = ()

    async def wait(self) -> None:
        await trio.lowlevel.wait_readable(self.fd)


class ReadinessHub:
    """Owns the epoll and the watches of the connections registered in it.

    A connection calls :meth:`watch` once it reads its socket directly and
    :meth:`forget` before the socket is closed or handed to another layer
    (TLS, compression), so a reused descriptor number never inherits it.
    """

    def __init__(self, batch: PublishBatch | None = None) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._watches: dict[int, Watch] = {}
        #: open while one poll's edges are handed out, flushed after (``nsqd/staging.py``)
        self.batch = batch

    def watch(self, fd: int, inline: Callable[[], bool] | None = None) -> Watch:
        """Register a socket; ``inline`` (never called for a :class:`_TrioWatch`) may serve its edges."""
        if self._epoll is None:
            return _TrioWatch(fd)
        try:
            self._epoll.register(fd, _EVENTS)
        except OSError:  # out of epoll watches (fs.epoll.max_user_watches): Trio's own wait still works
            return _TrioWatch(fd)
        watch = self._watches[fd] = Watch(fd, inline)
        return watch

    def forget(self, watch: Watch) -> None:
        if self._watches.get(watch.fd) is not watch:
            return
        del self._watches[watch.fd]
        try:
            self._epoll.unregister(watch.fd)
        except (OSError, ValueError):  # the socket or the hub is closed already
            pass

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Hand out edges until cancelled; then the epoll is closed."""
        if self._epoll is None:
            task_status.started()
            await trio.sleep_forever()
        epoll, watches, batch = self._epoll, self._watches, self.batch
        reschedule = trio.lowlevel.reschedule
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                if batch is not None:
                    batch.open = True
                try:
                    for fd, events in epoll.poll(0, MAX_EDGES):
                        watch = watches.get(fd)
                        if watch is None:
                            continue
                        if events & _ENDED:
                            watch.ended = True
                        task = watch.task
                        if task is None:
                            watch.ready = True
                            continue
                        if watch.inline is not None and not watch.ended:
                            try:
                                if watch.inline():
                                    continue
                            except Exception as exc:  # a bug in one connection: it fails, the hub goes on
                                watch.error = exc
                            if watch.task is None:  # the callback woke the reader itself
                                continue
                        watch.task = None
                        reschedule(task)
                finally:
                    if batch is not None:
                        batch.flush()
        finally:
            epoll.close()
