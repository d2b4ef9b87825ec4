"""What a long-running daemon must not keep: state of clients, links, topics and channels that went.

Found by the soak (``bench/soak.py``); each test fails on the code before its fix.
"""

from __future__ import annotations

import gc
import os

import trio

from amqp_gateway import performatives as p
from amqp_gateway.gateway import GatewayConnection
from amqp_gateway.publisher import POLL_INTERVAL
from nsqd import stats
from nsqd.client_v2 import PUB_COUNTS_PRUNE
from nsqd.statsd import StatsdReporter

from .conftest import HTTPClient
from .support import Daemon, NSQConnection, free_port, running_nsqd
from .test_amqp_raw import Client, eventually, gateway


async def test_a_long_lived_publisher_does_not_keep_the_names_of_the_topics_that_went(tmp_path):
    """Request and reply: each requester's ``#ephemeral`` topic goes with it, and the
    replying connection's publish counts forget it (they kept every name: ~100 B a reply)."""
    http_port = free_port()
    daemon = Daemon(tmp_path, f"--http-address=127.0.0.1:{http_port}")
    try:
        await daemon.wait_ready()
        server = await NSQConnection.open(daemon.port)
        await server.identify(client_id="server")
        replies = 3 * PUB_COUNTS_PRUNE
        for i in range(replies):
            requester = await NSQConnection.open(daemon.port)
            await requester.identify()
            await requester.sub(f"reply{i}#ephemeral", "c#ephemeral")
            await requester.command("RDY 1")
            await server.pub(f"reply{i}#ephemeral", b"answer")
            assert (await requester.read_message()).body == b"answer"
            await requester.close()
        doc = (await HTTPClient(http_port).request("GET", "/stats?format=json")).json()
        (producer,) = [c for c in doc["producers"] if c["client_id"] == "server"]
        names = [count["topic"] for count in producer["pub_counts"]]
        assert 0 < len(names) <= PUB_COUNTS_PRUNE
        assert "reply0#ephemeral" not in names and f"reply{replies - 1}#ephemeral" in names
    finally:
        daemon.proc.kill()
        await trio.to_thread.run_sync(daemon.proc.wait)


async def test_a_full_topic_keeps_neither_gone_publishers_nor_one_waiter_per_wake_up(tmp_path):
    """AMQP senders attached to a topic at its limit wait for room; a client that gives up
    and goes was kept alive by the topic (about 6.5 KiB each) until room was made, and a
    sender that waits added a waiter each time its connection woke (for heartbeats)."""
    async with gateway(tmp_path) as nsqd:
        nsqd.declare("full")
        topic = nsqd.topics["full"]
        nsqd.set_topic_policy(topic, {"max_messages": 1, "overflow": "reject"})
        nsqd.publish("full", [b"fills it"])
        for _ in range(10):
            client = await Client.connect(nsqd.amqp_port)
            sender = await client.attach(p.SENDER, "/topics/full")
            assert sender.credit == 0
            await client.aclose()
        await eventually(lambda: not any(isinstance(c, GatewayConnection) for c in nsqd.clients.values()))
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, GatewayConnection)]

        client = await Client.connect(nsqd.amqp_port, idle_timeout=1.0)  # our heartbeats: every 0.5 s
        waiting = await client.attach(p.SENDER, "/topics/full")
        await client.for_a_while(2.5)
        assert len(topic._room_waiters) == 1
        topic.empty()  # room: the sender that waited is woken and gets credit
        await client.until(lambda: waiting.credit > 0, timeout=POLL_INTERVAL / 2)  # woken, not polled


async def test_statsd_keeps_the_counters_of_the_last_snapshot_only(tmp_path):
    """Counters are sent as differences: the totals of channels that went (an nsq_tail
    session's ``#ephemeral`` channel) were kept for good, about 0.7 KiB each."""
    async with running_nsqd(tmp_path / "nsqd") as nsqd:
        reporter = StatsdReporter("nsq.", exclude_ephemeral=False, mem_stats=False)
        nsqd.declare("t")
        for i in range(50):
            nsqd.declare("t", f"tail{i}#ephemeral")
            nsqd.publish("t", [b"m"])
            lines = reporter.lines(stats.snapshot(nsqd, include_clients=False))
            assert f"nsq.topic.t.channel.tail{i}#ephemeral.message_count:1|c" in lines
            nsqd.delete_channel(nsqd.topics["t"], f"tail{i}#ephemeral")
        nsqd.publish("t", [b"m"])
        assert "nsq.topic.t.message_count:1|c" in reporter.lines(stats.snapshot(nsqd, include_clients=False))
        assert all(".channel." not in name for name in reporter._last)


def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_idle_topics_and_channels_hold_no_descriptors(tmp_path):
    """Each topic kept a lock file open, and each queue its checkpoint file, segments and io_uring
    once used: one client making topics ran the daemon out of descriptors, after which it accepted
    no connection at all. Idle queues now give theirs back (Go nsqd's hold none either)."""
    http_port = free_port()
    daemon = Daemon(tmp_path, f"--http-address=127.0.0.1:{http_port}", "--sync-timeout=200ms")
    try:
        await daemon.wait_ready()
        conn = await NSQConnection.open(daemon.port)
        await conn.pub("warm-up", b"x")
        await trio.sleep(1)
        before = _open_descriptors(daemon.proc.pid)
        http = HTTPClient(http_port)
        for i in range(300):
            await conn.pub(f"topic{i}", b"message")  # in memory: nothing of it is on disk
            assert (await http.post(f"/channel/create?topic=topic{i}&channel=c")).status == 200
        durable = await NSQConnection.open(daemon.port)
        for i in range(50):  # written and fsynced: segments, checkpoints and a ring each, while busy
            assert (await http.post(f"/topic/limits?topic=durable{i}&durable=true")).status in (200, 404)
            await durable.pub(f"durable{i}", b"message")
        await trio.sleep(1.5)  # every queue is checkpointed and goes idle
        after = _open_descriptors(daemon.proc.pid)
        assert after - before < 20, (before, after)
        stats = (await http.get("/stats?format=json")).json()
        assert len(stats["topics"]) == 351
        await conn.pub("topic7", b"again")  # an idle queue opens what it needs again
        await durable.pub("durable7", b"again")
        topic = next(t for t in (await http.get("/stats?format=json&topic=topic7")).json()["topics"])
        assert topic["message_count"] == 2
    finally:
        await daemon.stop()
    restarted = Daemon(tmp_path, f"--http-address=127.0.0.1:{http_port}")
    try:
        await restarted.wait_ready()
        http = HTTPClient(http_port)
        topics = {t["topic_name"]: t for t in (await http.get("/stats?format=json")).json()["topics"]}
        assert len(topics) == 351
        assert topics["topic7"]["channels"][0]["depth"] == 2  # both kept over the restart
    finally:
        await restarted.stop()


async def test_a_second_daemon_on_the_same_data_path_refuses_to_start(tmp_path):
    """One daemon per data path, as Go nsqd's dirlock (which takes the same lock, so the two
    exclude each other too); the queues need no lock files of their own."""
    first = Daemon(tmp_path)
    second = None
    try:
        await first.wait_ready()
        second = Daemon(tmp_path)
        code = await trio.to_thread.run_sync(second.proc.wait, 20)
        assert code == 1
        assert f"--data-path={tmp_path} in use (possibly by another instance of nsqd)" in \
            second.proc.stderr.read().decode()
    finally:
        if second is not None and second.proc.poll() is None:  # it started after all: a failure
            second.proc.kill()
            second.proc.wait()
        assert await first.stop() == 0
    assert not list(tmp_path.glob("*.lock"))
