"""The readiness hub: one edge-triggered epoll for the plain TCP connections (real sockets)."""

from __future__ import annotations

import os
import socket
from contextlib import asynccontextmanager

import trio
import trio.testing

from nsqd.readiness import ReadinessHub


async def _hub(nursery: trio.Nursery) -> ReadinessHub:
    hub = ReadinessHub()
    await nursery.start(hub.run)
    return hub


def _pair() -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    return ours, theirs


async def _parked_reader(nursery: trio.Nursery, watch) -> trio.Event:
    """A reader parked in ``watch.wait()``; the event is set once it wakes."""
    woke = trio.Event()

    async def reader():
        await watch.wait()
        woke.set()

    nursery.start_soon(reader)
    await trio.testing.wait_all_tasks_blocked()
    return woke


@asynccontextmanager
async def _watched():
    """A running hub and a socket pair whose first end it watches; the hub stops on exit."""
    async with trio.open_nursery() as nursery:
        hub = await _hub(nursery)
        ours, theirs = _pair()
        yield hub, ours, theirs, hub.watch(ours.fileno())
        nursery.cancel_scope.cancel()


async def test_a_parked_reader_wakes_when_data_arrives():
    async with trio.open_nursery() as nursery:
        hub = await _hub(nursery)
        ours, theirs = _pair()
        watch = hub.watch(ours.fileno())
        woke = await _parked_reader(nursery, watch)
        assert not woke.is_set()
        theirs.send(b"PUB t\n")
        with trio.fail_after(2):
            await woke.wait()
        assert ours.recv(100) == b"PUB t\n"
        hub.forget(watch)
        nursery.cancel_scope.cancel()


async def test_data_that_came_before_the_wait_is_not_missed():
    async with trio.open_nursery() as nursery:
        hub = await _hub(nursery)
        ours, theirs = _pair()
        theirs.send(b"early")  # before the socket is registered: the registration reports it
        watch = hub.watch(ours.fileno())
        with trio.fail_after(2):
            await watch.wait()
        assert ours.recv(100) == b"early"
        theirs.send(b"while not parked")
        await trio.testing.wait_all_tasks_blocked()  # the hub marks the watch
        with trio.fail_after(2):
            await watch.wait()
        assert ours.recv(100) == b"while not parked"
        nursery.cancel_scope.cancel()


async def test_a_hang_up_behind_data_is_seen_after_the_read_that_returns_the_data():
    """One edge for data and end of stream: a read returns the data, the next wait must still return."""
    async with _watched() as (_, ours, theirs, watch):
        theirs.send(b"last words")
        theirs.close()
        with trio.fail_after(2):
            await watch.wait()
            assert os.readv(ours.fileno(), [bytearray(100)]) == len(b"last words")
            await watch.wait()
        assert ours.recv(100) == b""


async def test_a_cancelled_wait_leaves_the_watch_usable():
    async with _watched() as (_, _ours, theirs, watch):
        with trio.move_on_after(0.05) as scope:
            await watch.wait()
        assert scope.cancelled_caught and watch.task is None
        theirs.send(b"x")
        with trio.fail_after(2):
            await watch.wait()


async def test_a_forgotten_descriptor_number_can_be_watched_again():
    async with trio.open_nursery() as nursery:
        hub = await _hub(nursery)
        ours, theirs = _pair()
        number = ours.fileno()
        hub.forget(hub.watch(number))
        ours.close()
        theirs.close()
        again, peer = _pair()  # the lowest free descriptor: usually the same number
        watch = hub.watch(again.fileno())
        peer.send(b"y")
        with trio.fail_after(2):
            await watch.wait()
        assert again.recv(10) == b"y"
        hub.forget(watch)
        hub.forget(watch)  # twice is harmless
        nursery.cancel_scope.cancel()


async def test_a_socket_the_epoll_refuses_waits_with_trio_instead():
    async with _watched() as (hub, ours, theirs, first):
        second = hub.watch(ours.fileno())  # EEXIST, as ENOSPC past fs.epoll.max_user_watches
        assert type(second) is not type(first)
        theirs.send(b"z")
        with trio.fail_after(2):
            await second.wait()
        assert ours.recv(10) == b"z"
        hub.forget(second)  # not the hub's: leaves the first registered
        assert hub._watches[ours.fileno()] is first


async def test_an_inline_callback_serves_edges_and_leaves_the_reader_parked():
    async with trio.open_nursery() as nursery:
        hub = await _hub(nursery)
        ours, theirs = _pair()
        served = []

        def inline() -> bool:
            data = ours.recv(100)
            served.append(data)
            return data != b"wake"

        watch = hub.watch(ours.fileno(), inline)
        woke = await _parked_reader(nursery, watch)
        for data in (b"PUB a\n", b"PUB b\n"):
            theirs.send(data)
            with trio.fail_after(2):
                while data not in served:
                    await trio.sleep(0.001)
        await trio.testing.wait_all_tasks_blocked()
        assert not woke.is_set()  # served in the hub: the reader never ran
        theirs.send(b"wake")  # the callback hands this one to the reader
        with trio.fail_after(2):
            await woke.wait()
        hub.forget(watch)
        nursery.cancel_scope.cancel()


async def test_an_inline_callback_that_raises_fails_its_reader_and_the_hub_goes_on():
    async with trio.open_nursery() as nursery:
        hub = await _hub(nursery)
        ours, theirs = _pair()
        other, other_peer = _pair()

        def broken() -> bool:
            raise RuntimeError("a bug in one connection")

        watch = hub.watch(ours.fileno(), broken)
        other_watch = hub.watch(other.fileno())
        woke = []

        async def reader(w, name):
            try:
                await w.wait()
            except RuntimeError as exc:
                woke.append(f"{name}: {exc}")
            else:
                woke.append(name)

        nursery.start_soon(reader, watch, "broken")
        nursery.start_soon(reader, other_watch, "other")
        await trio.testing.wait_all_tasks_blocked()
        theirs.send(b"x")
        other_peer.send(b"y")
        with trio.fail_after(2):
            while len(woke) < 2:
                await trio.sleep(0.001)
        assert sorted(woke) == ["broken: a bug in one connection", "other"]
        hub.forget(watch)
        hub.forget(other_watch)
        nursery.cancel_scope.cancel()


async def test_a_hang_up_wakes_the_reader_without_the_inline_callback():
    async with trio.open_nursery() as nursery:
        hub = await _hub(nursery)
        ours, theirs = _pair()
        calls = []
        watch = hub.watch(ours.fileno(), lambda: calls.append(1) or True)
        woke = await _parked_reader(nursery, watch)
        theirs.close()
        with trio.fail_after(2):
            await woke.wait()
        assert calls == [] and watch.ended
        hub.forget(watch)
        nursery.cancel_scope.cancel()
