"""Protocol V2 over real TCP sockets against the daemon running in-process."""

import json
import socket
import struct

import pytest
import trio

from nsqd.protocol_v2 import HEARTBEAT  # noqa: F401  (the frame the daemon sends)

from .support import FRAME_ERROR, NSQConnection, mpub_body, running_nsqd, tcp_port


def pub_command(topic: str, body: bytes) -> bytes:
    return f"PUB {topic}\n".encode() + struct.pack(">i", len(body)) + body


async def subscriber(nsqd, topic, channel, rdy=None, **identify):
    conn = await NSQConnection.open(tcp_port(nsqd))
    if identify:
        await conn.identify(**identify)
    await conn.sub(topic, channel)
    if rdy is not None:
        await conn.command(f"RDY {rdy}")
    return conn


async def test_bad_magic_gets_e_bad_protocol(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd), magic=b"  V1")
        assert await conn.read_frame() == (FRAME_ERROR, b"E_BAD_PROTOCOL")
        await conn.expect_closed()


async def test_identify_negotiates_features(tmp_path):
    async with running_nsqd(tmp_path, max_rdy_count=500) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        resp = await conn.identify(feature_negotiation=True, msg_timeout=5000, heartbeat_interval=2000,
                                   client_id="c1", hostname="h1", user_agent="test/1.0")
        assert resp["max_rdy_count"] == 500
        assert resp["msg_timeout"] == 5000
        assert resp["max_msg_timeout"] == 900000
        assert resp["tls_v1"] is False and resp["snappy"] is False and resp["deflate"] is False
        assert resp["auth_required"] is False
        assert resp["version"] == "1.3.0"
        client = next(iter(nsqd.clients.values()))
        assert (client.client_id, client.hostname, client.user_agent) == ("c1", "h1", "test/1.0")
        assert client.heartbeat_interval_ns == 2_000_000_000
        plain = await NSQConnection.open(tcp_port(nsqd))
        assert await plain.identify(client_id="x") == b"OK"


@pytest.mark.parametrize("fields,text", [
    ({"heartbeat_interval": 10}, b"E_BAD_BODY IDENTIFY heartbeat interval (10) is invalid"),
    ({"msg_timeout": 999}, b"E_BAD_BODY IDENTIFY msg timeout (999) is invalid"),
    ({"sample_rate": 100}, b"E_BAD_BODY IDENTIFY sample rate (100) is invalid"),
    ({"output_buffer_size": 10}, b"E_BAD_BODY IDENTIFY output buffer size (10) is invalid"),
])
async def test_identify_rejects_out_of_range_fields(tmp_path, fields, text):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("IDENTIFY", json.dumps(fields).encode())
        kind, data = await conn.read_frame()
        assert (kind, data) == (FRAME_ERROR, text)
        await conn.expect_closed()


async def test_identify_bad_json_is_fatal(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("IDENTIFY", b"{nope")
        await conn.expect_error("E_BAD_BODY IDENTIFY failed to decode JSON body")
        await conn.expect_closed()


async def test_pub_sub_fin_round_trip(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.pub("orders", b"hello")
        sub = await subscriber(nsqd, "orders", "audit", rdy=1)
        msg = await sub.read_message()
        assert (msg.body, msg.attempts) == (b"hello", 1)
        assert len(msg.id) == 16 and int(msg.id, 16) > 0
        channel = nsqd.topics["orders"].channels["audit"]
        assert channel.in_flight_count == 1
        await sub.command(b"FIN " + msg.id)
        await sub.command("NOP")
        with trio.fail_after(2):
            while channel.in_flight_count:
                await trio.sleep(0.01)
        client = next(c for c in nsqd.clients.values() if c.sub is not None and c.sub.channel is channel)
        assert (client.message_count, client.finish_count) == (1, 1)
        assert nsqd.topics["orders"].message_count == 1
        assert nsqd.clients[1].pub_counts == {"orders": 1}


async def test_mpub_delivers_in_order_under_rdy(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        bodies = [b"m%03d" % i for i in range(100)]
        sub = await subscriber(nsqd, "t", "c", rdy=10)
        await pub.mpub("t", bodies)
        got = []
        for _ in range(10):
            got.append(await sub.read_message())
        with trio.move_on_after(0.3):
            await sub.read_message()
            raise AssertionError("more messages than RDY allows")
        for msg in got:
            await sub.command(b"FIN " + msg.id)
        while len(got) < 100:
            msg = await sub.read_message()
            got.append(msg)
            await sub.command(b"FIN " + msg.id)
        assert [m.body for m in got] == bodies
        assert len({m.id for m in got}) == 100


async def test_consumers_of_one_channel_share_and_channels_each_get_all(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        a = await subscriber(nsqd, "t", "shared", rdy=100)
        b = await subscriber(nsqd, "t", "shared", rdy=100)
        other = await subscriber(nsqd, "t", "other", rdy=200)
        pub = await NSQConnection.open(tcp_port(nsqd))
        for i in range(10):
            await pub.mpub("t", [b"%d-%d" % (i, j) for j in range(10)])
        seen_other = {(await other.read_message()).body for _ in range(100)}
        assert len(seen_other) == 100
        shared = []
        for conn in (a, b):
            with trio.move_on_after(0.5):
                while True:
                    shared.append(((await conn.read_message()).body, conn))
        assert len(shared) == 100 and len({body for body, _ in shared}) == 100
        assert {id(c) for _, c in shared} == {id(a), id(b)}


async def test_req_redelivers_with_attempts_and_deferred_req_waits(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.pub("t", b"x")
        sub = await subscriber(nsqd, "t", "c", rdy=1)
        msg = await sub.read_message()
        await sub.command(b"REQ " + msg.id + b" 0")
        again = await sub.read_message()
        assert (again.id, again.attempts) == (msg.id, 2)
        channel = nsqd.topics["t"].channels["c"]
        start = trio.current_time()
        await sub.command(b"REQ " + msg.id + b" 300")
        await sub.command("NOP")
        with trio.fail_after(1):
            while not channel.deferred_count:
                await trio.sleep(0.01)
        third = await sub.read_message()
        assert third.attempts == 3 and trio.current_time() - start >= 0.29
        assert channel.requeue_count == 2


async def test_req_0_and_timed_out_messages_go_behind_the_waiting_ones(tmp_path):
    """nsqd puts a REQ'd (no delay) or timed-out message at the back of the channel's queue,
    so a consumer with RDY 1 gets what was waiting first (ansq's test_timeout_messages relies on it)."""
    async with running_nsqd(tmp_path, queue_scan_interval=0.02) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.mpub("t", [b"a", b"b", b"c"])
        sub = await subscriber(nsqd, "t", "c", rdy=1, msg_timeout=1000)
        a = await sub.read_message()
        await sub.command(b"REQ " + a.id + b" 0")
        b = await sub.read_message()
        assert (b.body, b.attempts) == (b"b", 1)
        await trio.sleep(1.1)  # b times out
        got = [await sub.read_message(timeout=2)]
        await sub.command(b"FIN " + got[0].id)
        got.append(await sub.read_message(timeout=2))
        await sub.command(b"FIN " + got[1].id)
        got.append(await sub.read_message(timeout=2))
        assert [(m.body, m.attempts) for m in got] == [(b"c", 1), (b"a", 2), (b"b", 2)]


async def test_req_timeouts_are_clamped_as_nsqds_durations(tmp_path):
    """nsqd makes the milliseconds a Duration, which wraps past int64, and clamps
    the result to [0, --max-req-timeout]: a wrapped negative timeout is 0, not the maximum."""
    async with running_nsqd(tmp_path, max_req_timeout=10.0) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.pub("t", b"x")
        sub = await subscriber(nsqd, "t", "c", rdy=1)
        msg = await sub.read_message()
        await sub.command(b"REQ " + msg.id + b" 9223372036855")  # * 1ms is past 2^63 ns: negative
        again = await sub.read_message(timeout=2)
        assert (again.id, again.attempts) == (msg.id, 2)
        await sub.command(b"REQ " + msg.id + b" 10001")  # past the maximum: deferred for the maximum
        await sub.command("NOP")
        channel = nsqd.topics["t"].channels["c"]
        with trio.fail_after(1):
            while not channel.deferred_count:
                await trio.sleep(0.01)


async def test_msg_timeout_redelivers_and_touch_extends(tmp_path):
    async with running_nsqd(tmp_path, queue_scan_interval=0.02) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.mpub("t", [b"a", b"b"])
        sub = await subscriber(nsqd, "t", "c", rdy=2, msg_timeout=1000)
        first, second = await sub.read_message(), await sub.read_message()
        await trio.sleep(0.6)
        await sub.command(b"TOUCH " + first.id)
        redelivered = await sub.read_message(timeout=3)
        assert (redelivered.id, redelivered.attempts) == (second.id, 2)
        touched = await sub.read_message(timeout=3)
        assert touched.id == first.id
        assert nsqd.topics["t"].channels["c"].timeout_count == 2


async def test_dpub_defers_delivery(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        sub = await subscriber(nsqd, "t", "c", rdy=5)
        start = trio.current_time()
        await pub.dpub("t", 400, b"later")
        await pub.pub("t", b"now")
        assert (await sub.read_message()).body == b"now"
        assert nsqd.topics["t"].channels["c"].deferred_count == 1
        msg = await sub.read_message()
        assert msg.body == b"later" and trio.current_time() - start >= 0.39


async def test_non_fatal_errors_keep_the_connection(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        sub = await subscriber(nsqd, "t", "c", rdy=1)
        await sub.command("FIN 0000000000000000")
        await sub.expect_error("E_FIN_FAILED FIN 0000000000000000 failed ID not in flight")
        await sub.command("REQ 0000000000000000 0")
        await sub.expect_error("E_REQ_FAILED REQ 0000000000000000 failed ID not in flight")
        await sub.command("TOUCH 0000000000000000")
        await sub.expect_error("E_TOUCH_FAILED TOUCH 0000000000000000 failed ID not in flight")
        await sub.command("PUB t", b"still alive")
        await sub.expect_response()
        assert (await sub.read_message()).body == b"still alive"


async def test_fin_of_another_clients_message(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        a = await subscriber(nsqd, "t", "c", rdy=1)
        b = await subscriber(nsqd, "t", "c")
        await a.pub("t", b"x")
        msg = await a.read_message()
        await b.command(b"FIN " + msg.id)
        await b.expect_error("E_FIN_FAILED FIN %s failed client does not own message" % msg.id.decode())


@pytest.mark.parametrize("commands,error", [
    ([b"BOGUS\n"], "E_INVALID invalid command BOGUS"),
    ([b"RDY 1\n"], "E_INVALID cannot RDY in current state"),
    ([b"FIN 0123456789abcdef\n"], "E_INVALID cannot FIN in current state"),
    ([b"CLS\n"], "E_INVALID cannot CLS in current state"),
    ([b"SUB bad!topic c\n"], 'E_BAD_TOPIC SUB topic name "bad!topic" is not valid'),
    ([b"SUB t " + b"c" * 65 + b"\n"], "E_BAD_CHANNEL SUB channel name"),
    ([b"SUB t\n"], "E_INVALID SUB insufficient number of parameters"),
    ([b"SUB t c\n", b"RDY 2501\n"], "E_INVALID RDY count 2501 out of range 0-2500"),
    ([b"SUB t c\n", b"RDY x\n"], "E_INVALID RDY could not parse count x"),
    ([b"SUB t c\n", b"FIN 123\n"], "E_INVALID invalid message ID"),
    # 16 bytes after "FIN ", but nsqd splits at the space or strips the \r: not a 16-byte id
    ([b"SUB t c\n", b"FIN 01234567 9abcdef\n"], "E_INVALID invalid message ID"),
    ([b"SUB t c\n", b"FIN  0123456789abcde\n"], "E_INVALID invalid message ID"),
    ([b"SUB t c\n", b"FIN 0123456789abcde\r\n"], "E_INVALID invalid message ID"),
    ([b"SUB t c\n", b"REQ 0123456789abcdef x\n"], "E_INVALID REQ could not parse timeout x"),
    ([b"PUB t\n" + struct.pack(">i", 0)], "E_BAD_MESSAGE PUB invalid message body size 0"),
    ([b"PUB t\n" + struct.pack(">i", 1024 * 1024 + 1)], "E_BAD_MESSAGE PUB message too big"),
    ([b"PUB\n" + struct.pack(">i", 1) + b"x"], "E_INVALID PUB insufficient number of parameters"),
    ([b"DPUB t 3600001\n" + struct.pack(">i", 1) + b"x"], "E_INVALID DPUB timeout 3600001 out of range 0-3600000"),
    ([b"MPUB t\n" + struct.pack(">i", 4) + struct.pack(">i", 0)], "E_BAD_BODY MPUB invalid message count 0"),
    ([b"MPUB t\n" + struct.pack(">i", 8) + struct.pack(">ii", 1, 5)], "E_BAD_MESSAGE MPUB failed to read message body"),
    ([b"MPUB t\n" + struct.pack(">i", 12) + struct.pack(">ii", 1, 0) + b"xxxx"],
     "E_BAD_MESSAGE MPUB invalid message(0) body size 0"),
    ([b"AUTH\n" + struct.pack(">i", 1) + b"x"], "E_AUTH_DISABLED AUTH disabled"),
    # nsqd's MPUB repeats the code in its text (protocol_v2.go, MPUB)
    ([b"MPUB bad!topic\n"], 'E_BAD_TOPIC E_BAD_TOPIC MPUB topic name "bad!topic" is not valid'),
])
async def test_fatal_errors_close_the_connection(tmp_path, commands, error):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        for data in commands:
            await conn.send(data)
            if data == b"SUB t c\n":
                await conn.expect_response()
        await conn.expect_error(error)
        await conn.expect_closed()


async def test_bad_mpub_publishes_nothing(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        body = mpub_body([b"good", b"x" * (1024 * 1024 + 1)])
        await conn.command("MPUB t", body)
        await conn.expect_error("E_BAD_MESSAGE MPUB message too big")
        topic = nsqd.get_existing_topic("t")
        assert topic is None or topic.message_count == 0


async def test_a_bad_client_does_not_disturb_others(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        good = await subscriber(nsqd, "t", "c", rdy=10)
        bad = await NSQConnection.open(tcp_port(nsqd))
        await bad.send(b"\x00\xff garbage \n" * 10 + b"MPUB t\n" + struct.pack(">i", -1))
        await bad.expect_closed()
        await good.pub("t", b"fine")
        assert (await good.read_message()).body == b"fine"


async def test_heartbeats_and_missed_heartbeats_disconnect(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.identify(heartbeat_interval=1000)
        kind, data = await conn.read_frame(timeout=2)
        assert data == b"_heartbeat_"
        # answer nothing: after two intervals without input the daemon hangs up
        await conn.expect_closed(timeout=4)
        assert not nsqd.clients


async def test_sub_with_heartbeats_disabled_is_refused(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.identify(heartbeat_interval=-1)
        await conn.command("SUB t c")
        await conn.expect_error("E_INVALID cannot SUB with heartbeats disabled")


async def test_cls_stops_delivery(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        sub = await subscriber(nsqd, "t", "c")
        await sub.command("CLS")
        await sub.expect_response(b"CLOSE_WAIT")
        await sub.command("RDY 5")  # ignored after CLS
        await sub.pub("t", b"x")
        with trio.move_on_after(0.3):
            await sub.read_message()
            raise AssertionError("delivered after CLS")


async def test_disconnect_requeues_in_flight_at_once(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        first = await subscriber(nsqd, "t", "c", rdy=5)
        await first.mpub("t", [b"1", b"2", b"3"])
        got = [await first.read_message() for _ in range(3)]
        await first.close()
        second = await subscriber(nsqd, "t", "c", rdy=5)
        again = [await second.read_message(timeout=2) for _ in range(3)]
        assert [m.id for m in again] == [m.id for m in got]
        assert [m.attempts for m in again] == [2, 2, 2]


@pytest.mark.parametrize("topic", ["t", "e#ephemeral"])
async def test_ephemeral_channels_deliver_to_ready_consumers_with_memory_queues_off(tmp_path, topic):
    """With --mem-queue-size=0 every message to an #ephemeral channel was dropped, ready consumer
    or not (0 of 200); what ready consumers take at once is kept, what they cannot is dropped."""
    async with running_nsqd(tmp_path, mem_queue_size=0) as nsqd:
        publisher = await NSQConnection.open(tcp_port(nsqd))
        sub = await subscriber(nsqd, topic, "c#ephemeral", rdy=5)
        for i in range(20):
            await publisher.pub(topic, b"%d" % i)
            msg = await sub.read_message(timeout=3)
            assert msg.body == b"%d" % i
            await sub.command(b"FIN " + msg.id)
        await publisher.mpub(topic, [b"x"] * 8)  # room for RDY's 5, the other 3 dropped and counted
        got = [await sub.read_message(timeout=3) for _ in range(5)]
        channel = nsqd.topics[topic].channels["c#ephemeral"]
        assert len(got) == 5 and channel.dropped_count == 3


async def test_ephemeral_channel_and_topic_vanish_with_last_client(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        sub = await subscriber(nsqd, "e#ephemeral", "c#ephemeral", rdy=1)
        assert "e#ephemeral" in nsqd.topics
        await sub.close()
        with trio.fail_after(2):
            while "e#ephemeral" in nsqd.topics:
                await trio.sleep(0.01)


async def test_topic_without_channels_keeps_messages_for_the_first_channel(tmp_path):
    async with running_nsqd(tmp_path, mem_queue_size=5) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.mpub("t", [b"%d" % i for i in range(20)])
        topic = nsqd.topics["t"]
        assert topic.depth == 20 and topic.backend_depth == 15
        sub = await subscriber(nsqd, "t", "c", rdy=100)
        bodies = {(await sub.read_message()).body for _ in range(20)}
        assert bodies == {b"%d" % i for i in range(20)}
        assert topic.depth == 0


async def test_channel_overflow_spills_to_disk_and_all_arrive(tmp_path):
    async with running_nsqd(tmp_path, mem_queue_size=10) as nsqd:
        sub = await subscriber(nsqd, "t", "c")
        await sub.mpub("t", [b"%d" % i for i in range(100)])
        channel = nsqd.topics["t"].channels["c"]
        assert channel.depth == 100 and channel.backend_depth == 90
        await sub.command("RDY 30")
        got = []
        while len(got) < 100:
            msg = await sub.read_message()
            got.append(msg.body)
            await sub.command(b"FIN " + msg.id)
        assert sorted(got) == sorted(b"%d" % i for i in range(100))
        assert channel.depth == 0


async def test_full_topic_refuses_publishes_while_others_accept(tmp_path):
    async with running_nsqd(tmp_path, channel_max_messages=5) as nsqd:
        conn = await subscriber(nsqd, "small", "c")
        await conn.mpub("small", [b"1", b"2", b"3"])
        await conn.command("MPUB small", mpub_body([b"4", b"5", b"6"]))
        await conn.expect_error("E_MPUB_FAILED MPUB failed topic small is full")
        await conn.pub("small", b"4")  # the connection lives on; what fits is taken
        await conn.pub("other", b"x")
        assert nsqd.topics["small"].channels["c"].depth == 4
        assert not nsqd.topics["small"].accepting is False
        await conn.pub("small", b"5")
        assert nsqd.topics["small"].accepting is False
        await conn.command("RDY 1")
        msg = await conn.read_message()
        await conn.command(b"FIN " + msg.id)
        await conn.command("RDY 0")
        with trio.fail_after(2):
            while not nsqd.topics["small"].accepting:
                await trio.sleep(0.01)


async def test_output_buffer_settings_batch_messages_as_nsqd_does(tmp_path):
    """Messages wait in the output buffer until it fills, the client is not ready, or the timeout."""
    async with running_nsqd(tmp_path) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        buffered = await NSQConnection.open(tcp_port(nsqd))
        await buffered.identify(output_buffer_timeout=1000, output_buffer_size=64 * 1024)
        await buffered.sub("t", "buffered")
        await buffered.command("RDY 100")
        direct = await NSQConnection.open(tcp_port(nsqd))
        await direct.identify(output_buffer_size=-1)  # no buffering
        await direct.sub("t", "direct")
        await direct.command("RDY 100")
        start = trio.current_time()
        await pub.pub("t", b"one")
        assert (await direct.read_message(timeout=0.5)).body == b"one"
        assert trio.current_time() - start < 0.5
        msg = await buffered.read_message(timeout=3)  # held until the 1 s timeout
        assert msg.body == b"one" and trio.current_time() - start >= 0.9
        await pub.mpub("t", [b"x" * 1000] * 80)  # 80 KB: the buffer fills and is written at once
        start = trio.current_time()
        got = [await buffered.read_message(timeout=3) for _ in range(64)]
        assert trio.current_time() - start < 0.5 and len(got) == 64


async def test_a_message_after_an_idle_tick_is_sent_at_once_as_nsqd_does(tmp_path):
    """Go's pump flushes on a ticker whose channel keeps one tick: a message that comes after the
    consumer was idle for a tick goes out at once, and only messages right behind a flush wait for
    the next tick. Each such message had waited a whole output_buffer_timeout (250 ms by default)."""
    async with running_nsqd(tmp_path) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        consumer = await NSQConnection.open(tcp_port(nsqd))
        await consumer.identify(output_buffer_timeout=1000)
        await consumer.sub("t", "c")
        await consumer.command("RDY 100")
        await trio.sleep(1.1)  # a tick came and was kept
        for body in (b"one", b"two"):  # each after an idle tick
            start = trio.current_time()
            await pub.pub("t", body)
            assert (await consumer.read_message(timeout=3)).body == body
            assert trio.current_time() - start < 0.5
            await trio.sleep(1.1)
        await pub.pub("t", b"three")  # its tick is taken now
        assert (await consumer.read_message(timeout=3)).body == b"three"
        start = trio.current_time()
        await pub.pub("t", b"four")  # right behind: the next tick, within the second
        assert (await consumer.read_message(timeout=3)).body == b"four"
        assert 0.05 < trio.current_time() - start < 1.1


async def test_a_consumer_that_set_rdy_0_does_not_keep_a_message_from_an_idle_one(tmp_path):
    """Both consumers waited for messages; the first then sent RDY 0. The next message is
    the second's at once, not at its next heartbeat (30 s)."""
    async with running_nsqd(tmp_path) as nsqd:
        paused = await subscriber(nsqd, "t", "c", rdy=1)
        idle = await subscriber(nsqd, "t", "c", rdy=1)
        await paused.send(b"RDY 0\n" + pub_command("elsewhere", b"-"))
        await paused.expect_response()  # answered after RDY 0 ran
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.pub("t", b"x")
        assert (await idle.read_message(timeout=3)).body == b"x"


async def test_a_sampling_consumer_is_not_stalled_by_a_batch_it_sampled_away(tmp_path):
    """sample_rate drops messages for this consumer; when all it took were dropped it takes
    again at once (nsqd's pump reads on), not at its next heartbeat (30 s)."""
    async with running_nsqd(tmp_path) as nsqd:
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.mpub("t", [b"%d" % i for i in range(400)])
        sub = await subscriber(nsqd, "t", "c", rdy=1, sample_rate=50)
        for _ in range(20):  # each take of one message is dropped half the time
            msg = await sub.read_message(timeout=3)
            await sub.command(b"FIN " + msg.id)



async def test_a_sampling_consumer_goes_through_a_big_backlog_in_steps_to_its_end(tmp_path):
    """A rate of 1 keeps 2%: the takes drop most of the backlog, a bounded step each, and come
    back for the next step; the consumer gets its share and the channel empties."""
    from nsqd.channel import EXAMINE_STEP

    backlog = 4 * EXAMINE_STEP
    async with running_nsqd(tmp_path, mem_queue_size=0) as nsqd:
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.sub("t", "c")
        for start in range(0, backlog, 1000):
            await publisher.mpub("t", [b"%d" % i for i in range(start, min(start + 1000, backlog))])
        sub = await subscriber(nsqd, "t", "c", rdy=2500, sample_rate=1)
        channel = nsqd.topics["t"].channels["c"]
        got = 0
        with trio.fail_after(20):  # the last messages may all be dropped: wait for the channel to empty
            while channel.depth or channel.in_flight_count:
                msg = None
                with trio.move_on_after(0.2):
                    msg = await sub.read_message(timeout=1)
                if msg is not None:
                    await sub.command(b"FIN " + msg.id)
                    got += 1
        assert 0 < got < backlog // 10

async def test_sample_rate_keeps_a_message_unless_a_draw_of_0_to_99_exceeds_it_as_nsqd(tmp_path):
    """Go skips a message when ``rand.Int31n(100) > sampleRate``: a rate of 99 delivers every
    message. 25 of 2,000 had been dropped for the channel."""
    async with running_nsqd(tmp_path) as nsqd:
        publisher = await NSQConnection.open(tcp_port(nsqd))
        sub = await subscriber(nsqd, "t", "c", rdy=2500, sample_rate=99)
        await publisher.mpub("t", [b"%d" % i for i in range(2000)])
        got = [await sub.read_message(timeout=3) for _ in range(2000)]
        assert sorted(int(msg.body) for msg in got) == list(range(2000))


async def test_deferred_messages_on_disk_do_not_hide_a_ready_one_behind_them(tmp_path):
    """With --mem-queue-size=0 deferred messages wait on disk, in the queue's order: a
    consumer's take reads on past those not yet due to the message that is."""
    async with running_nsqd(tmp_path, mem_queue_size=0) as nsqd:
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.sub("t", "c")  # the channel exists; this connection never sends RDY
        for _ in range(3):
            await publisher.dpub("t", 60_000, b"later")
        await publisher.pub("t", b"now")
        sub = await subscriber(nsqd, "t", "c", rdy=1)
        assert (await sub.read_message(timeout=3)).body == b"now"


async def test_a_deferred_message_on_disk_is_delivered_when_due(tmp_path):
    """A deferred message that waits on disk (past the memory bound) wakes an idle consumer when due."""
    async with running_nsqd(tmp_path, mem_queue_size=0) as nsqd:
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.sub("t", "c")
        await publisher.dpub("t", 60_000, b"later")  # the one deferred message kept in memory
        await publisher.dpub("t", 200, b"soon")  # on disk
        sub = await subscriber(nsqd, "t", "c", rdy=1)
        start = trio.current_time()
        assert (await sub.read_message(timeout=3)).body == b"soon"
        assert trio.current_time() - start < 1


async def test_a_consumer_holding_messages_gets_one_more_while_in_flight_is_below_rdy(tmp_path):
    """RDY 10 and 9 held: the tenth is sent (messages are pushed while in flight < RDY),
    within output_buffer_timeout (250 ms), though the consumer frees no eighth of its RDY."""
    async with running_nsqd(tmp_path) as nsqd:
        sub = await subscriber(nsqd, "t", "c", rdy=10)
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.mpub("t", [b"%d" % i for i in range(9)])
        held = [await sub.read_message(timeout=3) for _ in range(9)]
        start = trio.current_time()
        await publisher.pub("t", b"tenth")
        assert (await sub.read_message(timeout=3)).body == b"tenth"
        assert trio.current_time() - start < 1
        assert len({m.id for m in held}) == 9


async def test_a_consumer_that_frees_one_message_of_its_rdy_is_refilled_at_once(tmp_path):
    """RDY 16, all 16 held, one FIN: the next message comes at once, as nsqd's pump sends while
    in flight < RDY (a refill of one used to wait for an eighth of RDY, or output_buffer_timeout)."""
    async with running_nsqd(tmp_path) as nsqd:
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.mpub("t", [b"%d" % i for i in range(40)])
        sub = await subscriber(nsqd, "t", "c", rdy=16, output_buffer_timeout=5000)
        held = [await sub.read_message(timeout=3) for _ in range(16)]
        start = trio.current_time()
        await sub.command(b"FIN " + held[0].id)
        assert (await sub.read_message(timeout=3)).body == b"16"
        assert trio.current_time() - start < 2


async def test_a_consumer_that_leaves_nagle_on_and_fins_one_by_one_is_not_held_up(tmp_path):
    """A client with Nagle's algorithm on (plain sockets, pynsq) holds its next FIN until the last
    is acknowledged: when nothing went back after a FIN, every FIN waited for a delayed ACK
    (about 40 ms) for each RDY's worth: 1,500 messages at RDY 10 took 6-7 s. nsqd (and now this
    daemon) answers each FIN with the next message: about 0.3 s."""
    async with running_nsqd(tmp_path) as nsqd:
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.mpub("t", [b"m%d" % i for i in range(1500)])
        sub = await subscriber(nsqd, "t", "c")
        sub.stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        await sub.command("RDY 10")
        start = trio.current_time()
        for _ in range(1500):
            message = await sub.read_message(timeout=5)
            await sub.command(b"FIN " + message.id)
        assert trio.current_time() - start < 3
        assert nsqd.topics["t"].channels["c"].depth == 0


async def test_deferred_messages_on_disk_are_written_once_not_again_at_every_take(tmp_path):
    """With --mem-queue-size=0 a REQ'd message goes to disk; a hungry consumer's every take read all
    of them back and wrote them again (49 REQs wrote 1,883 records; a crash then replayed up to 5
    copies of each)."""
    async with running_nsqd(tmp_path, mem_queue_size=0) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.mpub("t", [b"m%d" % i for i in range(50)])
        con = await NSQConnection.open(tcp_port(nsqd))
        await con.sub("t", "c")
        await con.command("RDY 50")
        ids = [(await con.read_message()).id for _ in range(50)]
        backend = nsqd.topics["t"].channels["c"].backend
        written = backend.statistics().bytes_written
        for msg_id in ids:
            await con.command(b"REQ " + msg_id + b" 60000")
            await con.command("NOP")
        await pub.pub("t", b"fresh")  # a deliverable message behind the deferred ones
        assert (await con.read_message()).body == b"fresh"
        # one record each (about 120 bytes with its due time) for the 49 the deferred heap (one
        # message) could not hold, and the fresh one; at twice that, some were written again
        assert backend.statistics().bytes_written - written < 2 * 50 * 120
        assert nsqd.topics["t"].channels["c"].deferred_count == 50
