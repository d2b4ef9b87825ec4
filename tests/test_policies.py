"""Beyond nsqd: bounded queues, dead letters, TTL, limits over HTTP, all over real sockets."""

import json

import trio

from .conftest import HTTPClient
from .support import NSQConnection, running_nsqd, tcp_port


async def stats_channel(http, topic, channel):
    doc = (await http.request("GET", f"/stats?format=json&topic={topic}&channel={channel}")).json()
    return doc["topics"][0]["channels"][0]


async def test_drop_oldest_keeps_the_newest(tmp_path):
    async with running_nsqd(tmp_path, channel_max_messages=5, overflow_policy="drop-oldest") as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.mpub("t", [b"%d" % i for i in range(6)])
        await conn.pub("t", b"6")
        await conn.pub("t", b"7")
        channel = nsqd.topics["t"].channels["c"]
        assert (channel.depth, channel.dropped_count) == (5, 3)
        await conn.command("RDY 10")
        got = [(await conn.read_message()).body for _ in range(5)]
        assert sorted(got) == [b"3", b"4", b"5", b"6", b"7"]


async def test_poison_message_is_dead_lettered_and_can_be_redriven(tmp_path):
    async with running_nsqd(tmp_path, http_address="127.0.0.1:0", max_attempts=3) as nsqd:
        http = HTTPClient(nsqd.http_addresses[0][1])
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("orders", "billing")
        await conn.pub("orders", b"poison")
        await conn.command("RDY 1")
        seen = []
        for _ in range(3):
            msg = await conn.read_message()
            seen.append(msg.attempts)
            await conn.command(b"REQ " + msg.id + b" 0")
        assert seen == [1, 2, 3]
        with trio.move_on_after(0.3):
            await conn.read_message()
            raise AssertionError("delivered past max_attempts")
        dead = nsqd.topics["orders.dead"]
        assert dead.depth == 1
        stats = await stats_channel(http, "orders", "billing")
        assert (stats["dead_letter_count"], stats["max_attempts"]) == (1, 3)
        # the dead letter keeps its id, body and attempts
        inspect = await NSQConnection.open(tcp_port(nsqd))
        await http.request("POST", "/topic/create?topic=orders.dead")
        resp = await http.request("POST", "/topic/redrive?topic=orders.dead&to=orders")
        assert resp.json() == {"moved": 1, "left": 0}
        again = await conn.read_message()
        assert (again.id, again.body, again.attempts) == (msg.id, b"poison", 1)
        await conn.command(b"FIN " + again.id)
        await inspect.close()


async def test_dead_letter_topic_keeps_original_attempts(tmp_path):
    async with running_nsqd(tmp_path, max_attempts=2) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.pub("t", b"x")
        await conn.command("RDY 1")
        for _ in range(2):
            msg = await conn.read_message()
            await conn.command(b"REQ " + msg.id + b" 0")
        reader = await NSQConnection.open(tcp_port(nsqd))
        await reader.sub("t.dead", "inspect")
        await reader.command("RDY 1")
        dead = await reader.read_message()
        assert (dead.id, dead.body, dead.attempts) == (msg.id, b"x", 2)


async def test_expired_messages_are_never_delivered(tmp_path):
    async with running_nsqd(tmp_path, message_ttl=0.3) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.mpub("t", [b"old-1", b"old-2"])
        await trio.sleep(0.4)
        await conn.pub("t", b"fresh")
        await conn.command("RDY 5")
        assert (await conn.read_message()).body == b"fresh"
        assert nsqd.topics["t"].channels["c"].expired_count == 2



async def test_a_big_expired_backlog_on_disk_is_dropped_in_steps_and_the_fresh_message_still_comes(tmp_path):
    """Each take goes through a bounded step of expired messages and comes back for the next
    (it is not counted hungry): the consumer must still get the fresh message behind them."""
    from nsqd.channel import EXAMINE_STEP

    old = 3 * EXAMINE_STEP
    async with running_nsqd(tmp_path, message_ttl=0.3, mem_queue_size=0) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        for start in range(0, old, 1000):
            await conn.mpub("t", [b"old-%d" % i for i in range(start, min(start + 1000, old))])
        await trio.sleep(0.4)
        await conn.pub("t", b"fresh")
        await conn.command("RDY 5")
        assert (await conn.read_message(timeout=10)).body == b"fresh"
        channel = nsqd.topics["t"].channels["c"]
        with trio.fail_after(5):  # every expired one is dropped, none delivered
            while channel.expired_count != old:
                await trio.sleep(0.01)

async def test_limits_over_http_persist_and_only_bind_their_topic(tmp_path):
    async with running_nsqd(tmp_path, http_address="127.0.0.1:0") as nsqd:
        http = HTTPClient(nsqd.http_addresses[0][1])
        await http.request("POST", "/topic/create?topic=small")
        await http.request("POST", "/channel/create?topic=small&channel=c")
        resp = await http.request("POST", "/topic/limits?topic=small&channel_max_messages=2&max_attempts=4")
        assert resp.json()["channel_max_messages"] == 2
        assert (await http.request("POST", "/mpub?topic=small", b"1\n2")).status == 200
        assert (await http.request("POST", "/pub?topic=small", b"3")).status == 503
        assert (await http.request("POST", "/pub?topic=big", b"x")).status == 200
        resp = await http.request("POST", "/channel/limits?topic=small&channel=c&max_messages=x")
        assert (resp.status, resp.json()) == (400, {"message": "INVALID_ARG_MAX_MESSAGES"})
        assert (await http.request("POST", "/topic/limits?topic=small&overflow=maybe")).status == 400
        # only ASCII digits within int64 ("²" and "١" pass str.isdigit; the first broke int())
        for value in ("%C2%B2", "%D9%A1", "9223372036854775808", "99999999999999999999999999"):
            resp = await http.request("POST", f"/channel/limits?topic=small&channel=c&max_messages={value}")
            assert (resp.status, resp.json()) == (400, {"message": "INVALID_ARG_MAX_MESSAGES"})
        resp = await http.request("POST", "/topic/redrive?topic=small&count=%C2%B2")
        assert resp.status == 400
        await http.request("POST", "/topic/create?topic=huge")
        resp = await http.request("POST", "/topic/limits?topic=huge&max_messages=9223372036854775807")
        assert resp.json()["max_messages"] == 2 ** 63 - 1
        with trio.fail_after(2):
            while b"policy" not in (tmp_path / "nsqd.dat").read_bytes():
                await trio.sleep(0.02)
    saved = json.loads((tmp_path / "nsqd.dat").read_bytes())
    small = next(t for t in saved["topics"] if t["name"] == "small")
    assert small["policy"] == {"channel_max_messages": 2, "max_attempts": 4}
    assert "policy" not in next(t for t in saved["topics"] if t["name"] == "big")
    async with running_nsqd(tmp_path) as nsqd:
        channel = nsqd.topics["small"].channels["c"]
        assert (channel.policy.max_messages, channel.policy.max_attempts) == (2, 4)
        assert not nsqd.topics["small"].accepting


async def test_declared_channels_get_messages_published_before_any_consumer(tmp_path):
    config = tmp_path / "nsqd.toml"
    config.write_text('declare = ["orders:billing", "orders:audit", "events"]\n')
    from nsqd.cli import parse_args

    options = parse_args([f"--config={config}", "--tcp-address=127.0.0.1:0", "--http-address=",
                          "--amqp-address=", f"--data-path={tmp_path / 'data'}"])
    async with running_nsqd(tmp_path / "data", declare=options.declare) as nsqd:
        assert set(nsqd.topics) == {"orders", "events"}
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.pub("orders", b"first")
        for channel in ("billing", "audit"):
            conn = await NSQConnection.open(tcp_port(nsqd))
            await conn.sub("orders", channel)
            await conn.command("RDY 1")
            assert (await conn.read_message()).body == b"first"


async def test_channel_byte_limit_refuses_past_it(tmp_path):
    frame = 34 + 100  # a 100-byte body as a frame
    async with running_nsqd(tmp_path, channel_max_bytes=3 * frame) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.mpub("t", [b"x" * 100] * 3)
        await conn.command("PUB t", b"x" * 100)
        await conn.expect_error("E_PUB_FAILED PUB failed topic t is full")
        channel = nsqd.topics["t"].channels["c"]
        assert (channel.depth, channel.depth_bytes) == (3, 3 * frame)
        assert not nsqd.topics["t"].accepting


async def test_byte_limit_with_drop_oldest_counts_disk_too(tmp_path):
    async with running_nsqd(tmp_path, channel_max_bytes=20 * 134, overflow_policy="drop-oldest",
                            mem_queue_size=5) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        for i in range(6):
            await conn.mpub("t", [b"%099d" % (i * 10 + j) for j in range(10)])
        channel = nsqd.topics["t"].channels["c"]
        assert channel.depth_bytes <= 20 * 134 + 134 * 10  # disk records carry an 8-byte header
        assert channel.dropped_count >= 40 - 10 and channel.depth + channel.dropped_count == 60
        kept = channel.depth
        await conn.command("RDY 100")
        got = [int((await conn.read_message()).body) for _ in range(kept)]
        assert max(got) == 59 and len(set(got)) == kept  # the newest is kept, nothing twice


async def test_disk_budget_refuses_publishes_once_used_up(tmp_path):
    async with running_nsqd(tmp_path, max_disk_bytes=2000, mem_queue_size=0) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.mpub("t", [b"x" * 100] * 20)  # about 2.8 kB on disk
        await trio.sleep(0.15)  # the budget is sampled every 100 ms
        await conn.command("PUB other", b"y")
        await conn.expect_error("E_PUB_FAILED PUB failed topic other: the daemon's disk budget")
        await conn.command("RDY 20")
        for _ in range(20):
            msg = await conn.read_message()
            await conn.command(b"FIN " + msg.id)
        await trio.sleep(0.15)
        await conn.pub("other", b"y")  # space freed: accepted again
