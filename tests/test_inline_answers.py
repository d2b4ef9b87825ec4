"""Answers written without waking the reader task: from the readiness hub, and from the commit task.

Real sockets against the daemon: the order of answers behind durable
publishes, hand-overs to the reader task (a fatal error, a socket that does
not take the answers whole, a client that hangs up), and confirmations that
settle after their connection is gone.
"""

import socket
import struct
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from nsqd.client_v2 import ClientV2
from nsqd.diskq import queue as queue_module
from nsqd.readiness import ReadinessHub
from nsqd.staging import PublishBatch
from nsqd.tcp import Connection

from .support import FRAME_ERROR, FRAME_RESPONSE, NSQConnection, running_nsqd, tcp_port


def pub(topic: str, body: bytes) -> bytes:
    return f"PUB {topic}\n".encode() + struct.pack(">i", len(body)) + body


@pytest.mark.parametrize("durable", [True, False])
async def test_pipelined_commands_are_answered_in_order_around_a_non_fatal_error(tmp_path, durable):
    async with running_nsqd(tmp_path, durable=durable) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")  # subscribed without RDY: FIN of an unknown id is a non-fatal error
        await conn.send(pub("t", b"one") + b"FIN " + b"0" * 16 + b"\n" + pub("t", b"two")
                        + b"NOP\n" + pub("u", b"three"))
        await conn.expect_response()
        await conn.expect_error("E_FIN_FAILED")
        await conn.expect_response()
        await conn.expect_response()
        await conn.send(pub("t", b"four"))
        await conn.expect_response()
        assert nsqd.topics["t"].message_count == 3
        assert nsqd.topics["u"].message_count == 1


@pytest.mark.parametrize("durable", [True, False])
async def test_a_fatal_error_comes_after_the_answers_before_it(tmp_path, durable):
    async with running_nsqd(tmp_path, durable=durable) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.send(pub("t", b"kept") + b"BOGUS\n" + pub("t", b"never run"))
        await conn.expect_response()
        await conn.expect_error("E_INVALID")
        await conn.expect_closed()
        assert nsqd.topics["t"].message_count == 1


@pytest.mark.parametrize("durable", [True, False])
async def test_answers_a_socket_does_not_take_whole_reach_the_client_in_order(tmp_path, durable):
    """A client that sends thousands of PUBs before it reads: the answers fill its small receive buffer."""
    count = 4000
    async with running_nsqd(tmp_path, durable=durable) as nsqd:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await trio.to_thread.run_sync(sock.connect, ("127.0.0.1", tcp_port(nsqd)))
        conn = NSQConnection(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
        await conn.send(b"  V2")
        await conn.send(b"".join(pub("t", b"%d" % i) for i in range(count)))
        await trio.sleep(0.2)  # the daemon answers into a full socket meanwhile
        for _ in range(count):
            assert await conn.read_frame() == (FRAME_RESPONSE, b"OK")
        assert nsqd.topics["t"].message_count == count
        await conn.send(b"NOP\n" + pub("t", b"last"))
        assert await conn.read_frame() == (FRAME_RESPONSE, b"OK")


@asynccontextmanager
async def connection_on_socketpair(nsqd, nursery, hub):
    """A daemon connection served on one end of a socketpair whose buffers are small; yields (connection,
    its socket, the peer as a test client, the scope that ends the connection)."""
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ours.setblocking(False)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    client = ClientV2(nsqd.new_client_id(), "socketpair", nsqd.options, nsqd.now_ns(), nsqd.topics)
    connection = Connection(nsqd, stream, client, hub)
    peer = NSQConnection(trio.SocketStream(trio.socket.from_stdlib_socket(theirs)))
    scope = trio.CancelScope()

    async def serve():
        with scope:
            await connection.run(b"")

    nursery.start_soon(serve)
    await trio.testing.wait_all_tasks_blocked()  # the reader is parked: the hub serves what comes
    try:
        yield connection, ours, peer, scope
    finally:
        scope.cancel()


@pytest.mark.parametrize("staged,durable", [(False, False), (True, False), (True, True)])
async def test_an_answer_the_socket_takes_in_part_is_finished_by_the_reader(tmp_path, staged, durable):
    """PUBs one at a time, each answered by the hub (or the commit), to a peer that reads only later: once
    the socket's buffer is full the rest of a write goes to the reader task, and every answer arrives.

    Staged, each PUB is taken whole by ``stage_single_pub`` and answered by ``_write_answer``."""
    count = 2000
    async with running_nsqd(tmp_path, durable=durable) as nsqd, trio.open_nursery() as nursery:
        hub = ReadinessHub(PublishBatch(nsqd) if staged else None)
        await nursery.start(hub.run)
        async with connection_on_socketpair(nsqd, nursery, hub) as (_, _, peer, _):
            many_sent = trio.Event()
            answers = []

            async def publish():
                for i in range(count):
                    await peer.send(pub("t", b"%d" % i))
                    await trio.testing.wait_all_tasks_blocked()
                    if i == 100:  # the socket's buffer took a few answers at most
                        many_sent.set()

            async def read():
                await many_sent.wait()
                for _ in range(count):
                    answers.append(await peer.read_frame())

            async with trio.open_nursery() as client:
                client.start_soon(publish)
                client.start_soon(read)
            assert answers == [(FRAME_RESPONSE, b"OK")] * count
            assert nsqd.topics["t"].message_count == count
        nursery.cancel_scope.cancel()


async def test_a_confirmation_after_its_connection_ended_touches_no_socket(tmp_path, monkeypatch):
    """A durable PUB whose connection is cancelled while the commit syncs: when the commit settles,
    nothing is written to the descriptor number, which a new socket holds by then."""
    syncing, release = trio.Event(), trio.Event()
    real_sync = queue_module.DiskQueue._sync

    async def held_sync(self, plan, commit, target):
        syncing.set()
        await release.wait()
        await real_sync(self, plan, commit, target)

    monkeypatch.setattr(queue_module.DiskQueue, "_sync", held_sync)
    async with running_nsqd(tmp_path, durable=True) as nsqd, trio.open_nursery() as nursery:
        nsqd.declare("t")
        hub = ReadinessHub()
        await nursery.start(hub.run)
        async with connection_on_socketpair(nsqd, nursery, hub) as (connection, ours, peer, scope):
            await peer.send(pub("t", b"unconfirmed"))
            try:
                with trio.fail_after(5):
                    await syncing.wait()
                assert connection.protocol.held  # served in the hub: the answer waits for the commit
            except BaseException:
                release.set()  # the commit is shielded: let it finish, or the daemon never stops
                raise
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            number = ours.fileno()
            ours.close()
        sockets = []
        try:
            with trio.fail_after(5):  # a worker thread (a metadata save) may hold the number a moment
                while number not in [sock.fileno() for sock in sockets]:
                    sockets += socket.socketpair()
                    await trio.sleep(0.001)
            release.set()
            with trio.fail_after(5):  # the round that confirms the PUB has settled, its callbacks run
                await nsqd.topics["t"].backend.wait_durable()
            await trio.testing.wait_all_tasks_blocked()
            assert nsqd.topics["t"].message_count == 1
            for sock in sockets:
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(100)
        finally:
            release.set()
            for sock in sockets:
                sock.close()
        nursery.cancel_scope.cancel()


async def test_publishers_that_hang_up_before_their_answer_disturb_no_one(tmp_path):
    """Publishers that hang up before their durable OK; new connections (reusing the descriptor numbers)
    see only their own answers, and every publish was stored."""
    async with running_nsqd(tmp_path, durable=True) as nsqd:
        port = tcp_port(nsqd)
        for round_number in range(20):
            quitters = [await NSQConnection.open(port) for _ in range(5)]
            for conn in quitters:
                await conn.send(pub("t", b"r%d" % round_number))
            for conn in quitters:
                await conn.close()
            fresh = [await NSQConnection.open(port) for _ in range(5)]
            for conn in fresh:
                assert await conn.identify(feature_negotiation=True, client_id="fresh")  # JSON, no stray OK first
                await conn.pub("t", b"fresh")
                await conn.command("NOP")
                with trio.move_on_after(0.01):
                    frame = await conn.read_frame()
                    pytest.fail(f"a stray frame reached a new connection: {frame}")
            for conn in fresh:
                await conn.close()
        with trio.fail_after(5):
            while nsqd.topics["t"].message_count < 200:
                await trio.sleep(0.01)
        assert nsqd.topics["t"].message_count == 200


async def test_many_publishers_each_get_their_own_answers(tmp_path):
    async with running_nsqd(tmp_path, durable=True) as nsqd:
        port = tcp_port(nsqd)
        frames: dict[int, list] = {}

        async def publisher(number: int) -> None:
            conn = await NSQConnection.open(port)
            got = frames[number] = []
            for i in range(30):
                await conn.send(pub(f"t{number % 3}", b"%d-%d" % (number, i)))
                got.append(await conn.read_frame())
            await conn.send(pub("bad!topic", b"x"))
            got.append(await conn.read_frame())
            await conn.expect_closed()

        async with trio.open_nursery() as nursery:
            for number in range(40):
                nursery.start_soon(publisher, number)
        for got in frames.values():
            assert got[:30] == [(FRAME_RESPONSE, b"OK")] * 30
            assert got[30][0] == FRAME_ERROR and got[30][1].startswith(b"E_BAD_TOPIC")
        assert sum(nsqd.topics[f"t{n}"].message_count for n in range(3)) == 40 * 30


async def test_a_durable_publish_whose_fsync_fails_is_refused_and_the_next_is_confirmed(tmp_path, monkeypatch):
    async with running_nsqd(tmp_path, durable=True) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.pub("t", b"first")

        def fdatasync(fd):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(queue_module.uring, "open_ring", lambda: None)  # new queues sync in threads
        monkeypatch.setattr(queue_module.sync.os, "fdatasync", fdatasync)
        await conn.send(pub("fresh", b"second"))
        error = await conn.expect_error("E_PUB_FAILED")
        assert b"not durable" in error and b"Input/output error" in error
        monkeypatch.undo()
        await conn.pub("fresh", b"third")  # the connection stays usable, the disk works again
