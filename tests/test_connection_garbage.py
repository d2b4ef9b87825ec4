"""What the end of a connection, or a deleted topic or channel, leaves: no reference cycle (its
objects are freed at once), and no failure beyond it.

A cycle waits for a full collection, which a quiet daemon may not run for
minutes: 8,000 idle NSQ connections opened and closed left 115 MB behind,
and each round of them more. NSQ and AMQP connections of every kind are
opened, used and closed (cleanly or not); then no object of the daemon's
may be found only by the collector.
"""

from __future__ import annotations

import gc
import json
import struct
from collections import Counter

import trio

from amqp_gateway import events as ev, performatives as p

from .support import NSQConnection, tcp_port
from .test_amqp_raw import Client, body_of, eventually, gateway


def daemon_garbage(older: set[int] = frozenset()) -> Counter:
    """The daemon's objects (and the test client's engines) that only the collector could free,
    but for those in ``older`` (ids of objects alive before: earlier tests may leave some)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return Counter(type(o).__qualname__ for o in gc.garbage
                       if type(o).__module__.startswith(("nsqd.", "amqp_gateway.")) and id(o) not in older)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


async def nsq_connections(port: int) -> None:
    idle = await NSQConnection.open(port)
    await idle.close()

    publisher = await NSQConnection.open(port)
    await publisher.pub("t", b"one")
    await publisher.mpub("t", [b"two", b"three"])
    await publisher.close()

    for compression in ("snappy", "deflate"):
        conn = await NSQConnection.open(port)
        body = json.dumps({compression: True, "feature_negotiation": True}).encode()
        await conn.send(b"IDENTIFY\n" + struct.pack(">l", len(body)) + body)
        await conn.read_frame()
        await conn.close()

    consumer = await NSQConnection.open(port)
    await consumer.sub("t", "c")
    await consumer.command("RDY 2")
    first = await consumer.read_message()
    await consumer.command(b"FIN " + first.id)
    await consumer.read_message()  # left in flight: the connection's end gives it back
    await consumer.close()

    bad = await NSQConnection.open(port)
    await bad.send(b"NOPE\n")
    await bad.expect_closed()


async def amqp_connection(port: int, *, clean: bool) -> None:
    client = await Client.connect(port)
    sender = await client.attach(p.SENDER, "/topics/a")
    await client.until(lambda: sender.credit > 0)
    await client.publish(sender, [b"x", b"y"])
    receiver = await client.attach(p.RECEIVER, "/topics/a/channels/c")
    receiver.flow(2)
    await client.until(lambda: len([e for e in client.events if isinstance(e, ev.Transfers)]) >= 1)
    assert body_of(client.deliveries(receiver)[0]) == b"x"
    if clean:
        client.conn.close()
        await client.until(lambda: client.conn.finished)
    await client.aclose()
    client.conn.forget_sessions()  # the test's own engine: its cycles would be counted too


async def test_a_connection_that_ends_leaves_no_cycle_behind(tmp_path):
    async with gateway(tmp_path) as nsqd:
        nsqd.declare("t", "c")
        nsqd.declare("a", "c")
        daemon_garbage()  # what starting left
        older = {id(o) for o in gc.get_objects()}
        for _ in range(3):
            await nsq_connections(tcp_port(nsqd))
            await amqp_connection(nsqd.amqp_port, clean=True)
            await amqp_connection(nsqd.amqp_port, clean=False)
        await eventually(lambda: not nsqd.clients)
        await trio.sleep(0.1)
        assert daemon_garbage(older) == Counter()


async def test_a_failure_while_an_amqp_connection_ends_stays_with_that_connection(tmp_path, monkeypatch):
    """A bug in tearing a connection down is logged, as one while it ran; before, it ended the daemon."""
    from amqp_gateway.gateway import GatewayConnection

    real = GatewayConnection.connection_lost

    def failing(self):
        real(self)
        raise RuntimeError("a bug in teardown")

    monkeypatch.setattr(GatewayConnection, "connection_lost", failing)
    async with gateway(tmp_path) as nsqd:
        await amqp_connection(nsqd.amqp_port, clean=False)
        await eventually(lambda: not nsqd.clients)
        monkeypatch.undo()
        await amqp_connection(nsqd.amqp_port, clean=True)  # still served
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.pub("t", b"after")
        await publisher.close()


async def test_a_deleted_topic_or_channel_leaves_no_cycle_behind(tmp_path):
    """Each deleted topic kept everything it held (16.5 MB for 8,000 messages of 2 KB) until a full
    collection, which a quiet daemon may not run: its disk queue's keeper pointed back at it."""
    async with gateway(tmp_path) as nsqd:
        port = tcp_port(nsqd)
        daemon_garbage()
        older = {id(o) for o in gc.get_objects()}
        publisher = await NSQConnection.open(port)
        for name in ("gone", "kept"):
            nsqd.declare(name, "c")
            nsqd.declare(name, "d")
            await publisher.mpub(name, [b"x" * 2000] * 50)
            await publisher.command(f"DPUB {name} 60000", b"later")
            await publisher.expect_response(b"OK")
        consumer = await NSQConnection.open(port)
        await consumer.sub("kept", "c")
        await consumer.command("RDY 5")
        await consumer.read_message()  # in flight when its channel goes
        nsqd.delete_topic("gone")
        nsqd.delete_channel(nsqd.topics["kept"], "c")
        await publisher.close()
        await eventually(lambda: len(nsqd.clients) <= 1)
        await trio.sleep(0.1)
        garbage = daemon_garbage(older)
        assert garbage == Counter(), dict(garbage)
        await consumer.close()
