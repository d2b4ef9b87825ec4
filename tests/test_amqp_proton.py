"""The gateway driven by a real AMQP 1.0 client, python-qpid-proton, with NSQ cross-checks.

The daemon runs in-process under Trio; each proton session runs in a worker
thread (``trio.to_thread``) while the daemon keeps serving, and daemon state
is checked from the Trio side between steps.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio
from proton import Delivery, Link, Message, Timeout
from proton.reactor import AtMostOnce, LinkOption
from proton.utils import BlockingConnection, LinkDetached

from nsqd import stats

from .conftest import HTTPClient
from .support import NSQConnection, running_nsqd, tcp_port


@asynccontextmanager
async def daemon(tmp_path, **overrides):
    async with running_nsqd(tmp_path / "nsqd", amqp_address="127.0.0.1:0", **overrides) as nsqd:
        yield nsqd


def connect(nsqd, **kwargs) -> BlockingConnection:
    return BlockingConnection(f"127.0.0.1:{nsqd.amqp_addresses[0][1]}", timeout=5, **kwargs)


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


async def eventually(condition, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


async def nsq_publish(nsqd, topic: str, bodies: list[bytes]) -> None:
    conn = await NSQConnection.open(tcp_port(nsqd))
    await conn.identify()
    await conn.mpub(topic, bodies)
    await conn.close()


async def nsq_consume(nsqd, topic: str, channel: str, count: int):
    conn = await NSQConnection.open(tcp_port(nsqd))
    await conn.identify()
    await conn.sub(topic, channel)
    await conn.command(f"RDY {count}")
    messages = [await conn.read_message() for _ in range(count)]
    for msg in messages:
        await conn.command(b"FIN " + msg.id)
    await conn.close()
    return messages


def wait_messages(conn: BlockingConnection, receiver, count: int, timeout: float = 5) -> list[Message]:
    conn.wait(lambda: receiver.fetcher.has_message >= count, timeout=timeout)
    return [receiver.fetcher.pop() for _ in range(count)]


def pump(conn: BlockingConnection, seconds: float = 0.2) -> None:
    """Let proton do its I/O for a while (settling only queues frames)."""
    try:
        conn.wait(lambda: False, timeout=seconds)
    except Timeout:
        pass


def no_more_messages(conn: BlockingConnection, receiver, wait: float = 0.3) -> bool:
    try:
        conn.wait(lambda: receiver.fetcher.has_message > 0, timeout=wait)
    except Timeout:
        return True
    return False


class SecondSettleMode(LinkOption):
    def apply(self, link: Link) -> None:
        link.rcv_settle_mode = Link.RCV_SECOND


async def test_a_one_second_proton_heartbeat_is_taken_and_kept(tmp_path):
    """Proton announces half its heartbeat as idle-time-out (500 ms for heartbeat=1)."""
    async with daemon(tmp_path) as nsqd:
        def idle_then_publish():
            conn = connect(nsqd, heartbeat=1)
            sender = conn.create_sender("/topics/beat")
            pump(conn, 2.5)   # silent but for heartbeats, both ways
            state = sender.send(Message(body=b"still here", inferred=True)).remote_state
            conn.close()
            return state

        assert await in_thread(idle_then_publish) == Delivery.ACCEPTED
        assert nsqd.topics["beat"].depth == 1


# ------------------------------------------------------------ publishing
async def test_publish_unsettled_is_accepted_and_presettled_arrives(tmp_path):
    async with daemon(tmp_path) as nsqd:
        def publish():
            conn = connect(nsqd)
            sender = conn.create_sender("/topics/orders")
            states = [sender.send(Message(body=b"m%d" % i, inferred=True)).remote_state for i in range(3)]
            at_most_once = conn.create_sender("/topics/orders", name="presettled", options=AtMostOnce())
            at_most_once.send(Message(body="text body"))  # an amqp-value string
            conn.close()
            return states

        states = await in_thread(publish)
        assert states == [Delivery.ACCEPTED] * 3
        await eventually(lambda: nsqd.topics["orders"].message_count == 4)
        messages = await nsq_consume(nsqd, "orders", "ch", 4)
        assert [m.body for m in messages] == [b"m0", b"m1", b"m2", b"text body"]
        assert all(m.attempts == 1 for m in messages)


async def test_large_messages_are_reassembled_and_oversized_rejected(tmp_path):
    async with daemon(tmp_path, max_msg_size=400_000) as nsqd:
        nsqd.get_topic("big").get_channel("c")
        body = bytes(range(256)) * 1200  # 307200 bytes: several 128 KiB frames

        def publish():
            conn = connect(nsqd)
            sender = conn.create_sender("/topics/big")
            ok = sender.send(Message(body=body, inferred=True)).remote_state
            delivery = sender.link.send(Message(body=b"x" * 400_001, inferred=True))
            conn.wait(lambda: delivery.remote_state, timeout=5)
            refused = delivery.remote_state, delivery.remote.condition.name
            receiver = conn.create_receiver("/topics/big/channels/c", credit=1)
            got = wait_messages(conn, receiver, 1)[0]
            receiver.accept()
            conn.close()
            return ok, refused, bytes(got.body)

        ok, refused, got = await in_thread(publish)
        assert ok == Delivery.ACCEPTED
        assert refused == (Delivery.REJECTED, "amqp:link:message-size-exceeded")
        assert got == body
        assert nsqd.topics["big"].message_count == 1


# ------------------------------------------------------------ consuming
async def test_consume_with_credit_and_stats_show_the_consumer(tmp_path):
    async with daemon(tmp_path, http_address="127.0.0.1:0") as nsqd:
        for name in ("audit", "c"):
            nsqd.get_topic("events").get_channel(name)
        await nsq_publish(nsqd, "events", [b"e%d" % i for i in range(10)])
        reference = await nsq_consume(nsqd, "events", "audit", 10)
        conn = await in_thread(connect, nsqd)
        receiver = await in_thread(lambda: conn.create_receiver("/topics/events/channels/c", credit=0))

        def take(n):
            receiver.flow(n)
            got = wait_messages(conn, receiver, n)
            return got, no_more_messages(conn, receiver)

        got, stopped = await in_thread(take, 3)
        assert stopped, "credit 3 must stop delivery after 3 messages"
        assert [bytes(m.body) for m in got] == [b"e0", b"e1", b"e2"]
        assert [m.id for m in got] == [r.id.decode() for r in reference[:3]]
        assert [round(m.creation_time * 1000) for m in got] == [r.timestamp // 1_000_000 for r in reference[:3]]
        channel = nsqd.topics["events"].channels["c"]
        (consumer,) = [sub.consumer for sub in channel.subscriptions.values()]
        assert consumer.in_flight_count == 3 and consumer.ready_count == 0
        snapshot = stats.snapshot(nsqd)
        (client,) = [c for t in snapshot.topics for ch in t.channels if ch.channel_name == "c" for c in ch.clients]
        assert client.user_agent == f"amqp/{conn.conn.container}"
        assert (client.in_flight_count, client.message_count, client.ready_count) == (3, 3, 0)
        response = await HTTPClient(nsqd.http_addresses[0][1]).get("/stats?format=json&topic=events&channel=c")
        (http_client,) = response.json()["topics"][0]["channels"][0]["clients"]
        assert http_client["user_agent"].startswith("amqp/") and http_client["in_flight_count"] == 3

        # the connection publishes too: it is listed among the producers
        sender = await in_thread(lambda: conn.create_sender("/topics/events"))
        await in_thread(lambda: sender.send(Message(body=b"e10", inferred=True)))
        (producer,) = stats.snapshot(nsqd).producers
        assert producer.user_agent.startswith("amqp/")
        assert [(c.topic, c.count) for c in producer.pub_counts] == [("events", 1)]

        got, stopped = await in_thread(take, 2)
        assert [bytes(m.body) for m in got] == [b"e3", b"e4"] and stopped
        await in_thread(conn.close)
        await eventually(lambda: not channel.subscriptions)
        assert channel.depth == 11  # nothing was accepted: all came back


async def test_drain_delivers_what_there_is_then_ends_at_once(tmp_path):
    async with daemon(tmp_path) as nsqd:
        await nsq_publish(nsqd, "jobs", [b"a", b"b"])

        def drain():
            conn = connect(nsqd)
            receiver = conn.create_receiver("/topics/jobs/channels/w", credit=0)
            receiver.link.drain(5)
            conn.wait(lambda: receiver.fetcher.has_message == 2 and not receiver.link.draining(), timeout=2)
            first = receiver.fetcher.has_message, receiver.link.drained()
            receiver.link.drain(5)   # an empty channel answers straight away
            conn.wait(lambda: not receiver.link.draining(), timeout=2)
            second = receiver.fetcher.has_message, receiver.link.drained()
            conn.close()
            return first, second

        with trio.fail_after(3):
            first, second = await in_thread(drain)
        assert first == (2, 3)   # two messages, then the other three credits used up by the drain
        assert second == (2, 5)


async def test_dispositions_map_onto_fin_requeue_and_reject(tmp_path):
    async with daemon(tmp_path) as nsqd:
        channel = nsqd.get_topic("work").get_channel("c")
        await nsq_publish(nsqd, "work", [b"accept", b"release", b"fail", b"reject", b"undeliverable"])
        conn = await in_thread(connect, nsqd)

        def settle_each():
            receiver = conn.create_receiver("/topics/work/channels/c", credit=0)
            receiver.flow(5)
            wait_messages(conn, receiver, 5)
            receiver.accept()
            receiver.release(delivered=False)                      # released
            receiver.fetcher.unsettled[0].local.failed = True
            receiver.settle(Delivery.MODIFIED)                      # modified, delivery-failed
            receiver.reject()                                       # rejected
            receiver.fetcher.unsettled[0].local.undeliverable = True
            receiver.settle(Delivery.MODIFIED)                      # modified, undeliverable-here
            pump(conn)
            return receiver

        receiver = await in_thread(settle_each)
        await eventually(lambda: channel.depth == 2 and channel.in_flight_count == 0)
        assert channel.rejected_count == 2
        (consumer,) = [sub.consumer for sub in channel.subscriptions.values()]
        assert consumer.finish_count == 1 and consumer.requeue_count == 2

        def redeliver():
            receiver.flow(2)
            got = wait_messages(conn, receiver, 2)
            for _ in got:
                receiver.release(delivered=False)
            pump(conn)
            return {bytes(m.body): m.delivery_count for m in got}

        # the AMQP delivery-count counts failed deliveries only
        assert await in_thread(redeliver) == {b"release": 0, b"fail": 1}
        await in_thread(conn.close)
        # NSQ's attempts: releases never count, the failed delivery counted once
        attempts = {m.body: m.attempts for m in await nsq_consume(nsqd, "work", "c", 2)}
        assert attempts == {b"release": 1, b"fail": 2}


async def test_detach_requeues_unsettled_messages_in_order(tmp_path):
    async with daemon(tmp_path) as nsqd:
        await nsq_publish(nsqd, "feed", [b"m%d" % i for i in range(6)])

        def hand_over():
            conn = connect(nsqd)
            first = conn.create_receiver("/topics/feed/channels/c", credit=0)
            first.flow(6)
            before = [m.id for m in wait_messages(conn, first, 6)]
            first.close()
            second = conn.create_receiver("/topics/feed/channels/c", credit=0)
            second.flow(6)
            after = wait_messages(conn, second, 6)
            conn.close()
            return before, [m.id for m in after], [bytes(m.body) for m in after]

        before, after, bodies = await in_thread(hand_over)
        assert after == before
        assert bodies == [b"m%d" % i for i in range(6)]


async def test_presettled_receiver_is_at_most_once(tmp_path):
    async with daemon(tmp_path) as nsqd:
        channel = nsqd.get_topic("ticks").get_channel("c")
        await nsq_publish(nsqd, "ticks", [b"t1", b"t2", b"t3"])

        def receive():
            conn = connect(nsqd)
            receiver = conn.create_receiver("/topics/ticks/channels/c", credit=0, options=AtMostOnce())
            receiver.flow(3)
            got = [bytes(m.body) for m in wait_messages(conn, receiver, 3)]
            conn.close()  # nothing settled, nothing comes back
            return got

        assert await in_thread(receive) == [b"t1", b"t2", b"t3"]
        await eventually(lambda: not channel.subscriptions)
        assert channel.depth == 0 and channel.in_flight_count == 0


async def test_in_flight_timeout_redelivers_with_a_failed_delivery(tmp_path):
    async with daemon(tmp_path, msg_timeout=0.3) as nsqd:
        await nsq_publish(nsqd, "slow", [b"x"])

        def receive_twice():
            conn = connect(nsqd)
            receiver = conn.create_receiver("/topics/slow/channels/c", credit=0)
            receiver.flow(2)
            first, second = wait_messages(conn, receiver, 2, timeout=5)
            conn.close()
            return (first.id, first.delivery_count), (second.id, second.delivery_count)

        first, second = await in_thread(receive_twice)
        assert first[0] == second[0]
        assert (first[1], second[1]) == (0, 1)


async def test_first_acquirer_is_true_on_a_first_delivery_only(tmp_path):
    """AMQP 3.2.1: first-acquirer true means no link acquired the message before."""
    async with daemon(tmp_path, msg_timeout=0.3) as nsqd:
        nsqd.get_topic("fa").get_channel("c")
        await nsq_publish(nsqd, "fa", [b"requeued"])
        nsq = await NSQConnection.open(tcp_port(nsqd))
        await nsq.identify()
        await nsq.sub("fa", "c")
        await nsq.command("RDY 1")
        taken = await nsq.read_message()
        await nsq.command("RDY 0")  # not delivered to it again: it leaves holding nothing
        await nsq.command(b"REQ " + taken.id + b" 0")  # an NSQ consumer had it first
        await nsq.close()
        await eventually(lambda: nsqd.topics["fa"].channels["c"].depth == 1)
        await nsq_publish(nsqd, "fa", [b"fresh"])

        def receive():
            conn = connect(nsqd)
            receiver = conn.create_receiver("/topics/fa/channels/c", credit=0)
            receiver.flow(2)
            got = wait_messages(conn, receiver, 2)
            receiver.accept()                            # settles "requeued"; "fresh" is left to time out
            receiver.flow(1)
            (again,) = wait_messages(conn, receiver, 1)  # "fresh" after its in-flight timeout
            receiver.accept()
            conn.close()
            return [(bytes(m.body), m.first_acquirer, m.delivery_count) for m in [*got, again]]

        assert await in_thread(receive) == [
            (b"requeued", False, 1),
            (b"fresh", True, 0),
            (b"fresh", False, 1),
        ]


async def test_a_released_message_is_no_longer_first_acquired(tmp_path):
    """A release counts no NSQ attempt, but the message was acquired: first-acquirer false after it."""
    async with daemon(tmp_path) as nsqd:
        nsqd.get_topic("rel").get_channel("c")
        await nsq_publish(nsqd, "rel", [b"once"])

        def receive():
            conn = connect(nsqd)
            receiver = conn.create_receiver("/topics/rel/channels/c", credit=0)
            receiver.flow(1)
            (first,) = wait_messages(conn, receiver, 1)
            receiver.release(delivered=False)
            receiver.flow(1)
            (again,) = wait_messages(conn, receiver, 1)
            receiver.accept()
            pump(conn)
            conn.close()
            return [(m.first_acquirer, m.delivery_count) for m in (first, again)]

        assert await in_thread(receive) == [(True, 0), (False, 0)]
        channel = nsqd.topics["rel"].channels["c"]
        await eventually(lambda: channel.in_flight_count == 0 and not channel.released)


# ------------------------------------------------------------ addresses
@pytest.mark.parametrize("role, address, options, condition", [
    ("receiver", "/queues/q", None, "amqp:not-found"),
    ("receiver", "/topics/t", None, "amqp:not-found"),
    ("receiver", "/topics/bad name/channels/c", None, "amqp:invalid-field"),
    ("receiver", "/topics/t/channels/" + "c" * 65, None, "amqp:invalid-field"),
    ("sender", "/topics/t/channels/c", None, "amqp:not-found"),
    ("sender", "/topics/no$good", None, "amqp:invalid-field"),
    ("sender", "amqp://host:5672", None, "amqp:not-found"),
    ("sender", "http://host/topics/t", None, "amqp:not-found"),
    ("receiver", "amqps://host/topics/t", None, "amqp:not-found"),
])
async def test_bad_address_refuses_the_link_and_the_connection_lives(tmp_path, role, address, options, condition):
    async with daemon(tmp_path) as nsqd:
        def attempt():
            conn = connect(nsqd)
            create = conn.create_receiver if role == "receiver" else conn.create_sender
            with pytest.raises(LinkDetached) as refused:
                create(address, options=options)
            state = conn.create_sender("/topics/ok").send(Message(body=b"fine", inferred=True)).remote_state
            conn.close()
            return refused.value.condition, state

        assert await in_thread(attempt) == (condition, Delivery.ACCEPTED)
        assert nsqd.topics["ok"].message_count == 1


async def test_addresses_given_as_amqp_uris_name_the_same_nodes(tmp_path):
    """uamqp and the Azure SDKs send every address as amqp[s]://host[:port]/path; only the path
    names the node (both links were refused with amqp:not-found)."""
    async with daemon(tmp_path) as nsqd:
        port = nsqd.amqp_addresses[0][1]

        def round_trip():
            conn = connect(nsqd)
            receiver = conn.create_receiver("amqps://example.net/topics/uri/channels/c", credit=10)
            sender = conn.create_sender(f"amqp://127.0.0.1:{port}/topics/uri")
            state = sender.send(Message(body=b"by uri", inferred=True)).remote_state
            (got,) = wait_messages(conn, receiver, 1)
            receiver.accept()
            conn.close()
            return state, bytes(got.body)

        assert await in_thread(round_trip) == (Delivery.ACCEPTED, b"by uri")
        assert nsqd.topics["uri"].message_count == 1


async def test_a_receiver_in_rcv_settle_mode_second_is_served(tmp_path):
    """Spec 2.8.3: the receiver's rcv-settle-mode is the link's; second is taken, not refused."""
    async with daemon(tmp_path) as nsqd:
        await nsq_publish(nsqd, "t", [b"one"])

        def consume():
            conn = connect(nsqd)
            receiver = conn.create_receiver("/topics/t/channels/c", credit=1, options=SecondSettleMode())
            (msg,) = wait_messages(conn, receiver, 1)
            receiver.accept()
            pump(conn)
            mode = receiver.link.remote_rcv_settle_mode
            conn.close()
            return bytes(msg.body), mode

        assert await in_thread(consume) == (b"one", Link.RCV_SECOND)
        channel = nsqd.topics["t"].channels["c"]
        assert channel.in_flight_count == 0 and channel.depth == 0


async def test_ephemeral_topics_and_channels_vanish_with_their_consumer(tmp_path):
    async with daemon(tmp_path) as nsqd:
        def use():
            conn = connect(nsqd)
            receiver = conn.create_receiver("/topics/t#ephemeral/channels/c#ephemeral", credit=1)
            conn.create_sender("/topics/t#ephemeral").send(Message(body=b"x", inferred=True))
            got = wait_messages(conn, receiver, 1)
            receiver.accept()
            conn.close()
            return bytes(got[0].body)

        assert await in_thread(use) == b"x"
        await eventually(lambda: "t#ephemeral" not in nsqd.topics)


# ------------------------------------------------------------ with NSQ
async def test_amqp_and_nsq_consumers_share_one_channel(tmp_path):
    async with daemon(tmp_path) as nsqd:
        nsqd.get_topic("shared").get_channel("c")
        nsq = await NSQConnection.open(tcp_port(nsqd))
        await nsq.identify()
        await nsq.sub("shared", "c")
        await nsq.command("RDY 5")
        conn = await in_thread(connect, nsqd)
        receiver = await in_thread(lambda: conn.create_receiver("/topics/shared/channels/c", credit=0))
        await in_thread(receiver.flow, 5)
        await eventually(lambda: len(nsqd.topics["shared"].channels["c"].subscriptions) == 2)
        await nsq_publish(nsqd, "shared", [b"%d" % i for i in range(10)])
        via_nsq = [await nsq.read_message() for _ in range(5)]
        via_amqp = await in_thread(lambda: wait_messages(conn, receiver, 5))
        bodies = sorted([m.body for m in via_nsq] + [bytes(m.body) for m in via_amqp], key=int)
        assert bodies == [b"%d" % i for i in range(10)]
        await in_thread(conn.close)
        await nsq.close()
