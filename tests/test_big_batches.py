"""Batches of more than STEP_MESSAGES messages (``nsqd/mpub.py``): validated whole, stored a
step at a time, every other client served between steps, the answer once all are stored."""

from __future__ import annotations

import signal
import struct

import pytest
import trio

from nsqd.mpub import STEP_MESSAGES

from .conftest import HTTPClient, http_port
from .support import FRAME_RESPONSE, NSQConnection, mpub_body, tcp_port
from .test_bounded_memory import Subprocess

ONE_BYTE_MAX = (5 * 1024 * 1024 - 4) // 5  # the most messages a default --max-body-size MPUB holds


def _one_byte_mpub(count: int) -> bytes:
    return struct.pack(">i", count) + b"\x00\x00\x00\x01x" * count


async def _depth(port: int, topic: str) -> int:
    """Messages the topic holds: its own backlog and its channels' queues."""
    stats = (await HTTPClient(port).get(f"/stats?format=json&topic={topic}")).json()
    return sum(t["depth"] + sum(c["depth"] for c in t["channels"]) for t in stats["topics"])


@pytest.mark.parametrize("channels, count", [(1, ONE_BYTE_MAX), (100, STEP_MESSAGES)],
                         ids=["one-channel", "100-channels"])
async def test_other_clients_are_served_while_a_big_mpub_is_stored(tmp_path, channels, count):
    """With 100 channels a step holds fewer messages (8,192 copies): 8,192 are already stepped."""
    daemon = Subprocess(tmp_path)
    try:
        http = HTTPClient(daemon.http)
        assert (await http.post("/topic/create?topic=big")).status == 200
        for index in range(1, channels):
            assert (await http.post(f"/channel/create?topic=big&channel=c{index}")).status == 200
        consumer = await NSQConnection.open(daemon.tcp)
        await consumer.sub("big", "c")
        await consumer.command("RDY 1")
        probe = await NSQConnection.open(daemon.tcp)
        publisher = await NSQConnection.open(daemon.tcp)
        events: list[str] = []

        async def consume():
            msg = await consumer.read_message(timeout=30)
            assert msg.body == b"x"
            events.append("message")

        async def publish():
            await publisher.command("MPUB big", _one_byte_mpub(count))
            kind, data = await publisher.read_non_heartbeat(timeout=30)
            assert data == b"OK"
            events.append("OK")

        async def probing():
            while "OK" not in events:
                await probe.pub("probe", b"p")
                events.append("probe")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            nursery.start_soon(probing)
            nursery.start_soon(publish)
        # the batch's first messages went out, and other publishers were answered, before its OK
        first, done = events.index("message"), events.index("OK")
        assert first < done, events[-20:]
        assert events[first:done].count("probe") >= 3, events[first:done + 1]
    finally:
        daemon.proc.kill()
        daemon.stop()


async def test_a_maximal_batch_of_one_byte_messages_takes_a_bounded_share_of_memory(tmp_path):
    daemon = Subprocess(tmp_path)
    try:
        before = daemon.memory_mb()
        conn = await NSQConnection.open(daemon.tcp)
        await conn.command("MPUB tcp", _one_byte_mpub(ONE_BYTE_MAX))
        await conn.expect_response()
        lines = b"x\n" * (5 * 1024 * 1024 // 2)
        resp = await HTTPClient(daemon.http).post("/mpub?topic=http", lines)
        assert (resp.status, resp.body) == (200, b"OK")
        after = daemon.memory_mb()
        # the bodies (5 MiB each) and a step at a time; in one go they took about 500 and 700 MiB
        assert after["VmHWM"] - before["VmRSS"] < 100, (before, after)
        assert await _depth(daemon.http, "tcp") == ONE_BYTE_MAX
        assert await _depth(daemon.http, "http") == len(lines) // 2
    finally:
        daemon.stop()


async def test_a_big_mpub_wrong_at_its_end_stores_nothing(nsqd_server, http):
    conn = await NSQConnection.open(tcp_port(nsqd_server))
    body = mpub_body([b"a", b"bb"] * STEP_MESSAGES + [b""])
    await conn.command("MPUB t", body)
    await conn.expect_error(f"E_BAD_MESSAGE MPUB invalid message({2 * STEP_MESSAGES}) body size 0")
    await conn.expect_closed()
    assert await _depth(http_port(nsqd_server), "t") == 0


async def test_a_big_mpub_to_a_topic_without_room_for_all_of_it_is_refused_whole(nsqd_server, http):
    nsqd_server.set_topic_policy(nsqd_server.get_topic("t"), {"max_messages": 2 * STEP_MESSAGES, "overflow": "reject"})
    conn = await NSQConnection.open(tcp_port(nsqd_server))
    await conn.command("MPUB t", mpub_body([b"m"] * (2 * STEP_MESSAGES + 1)))
    await conn.expect_error(f"E_MPUB_FAILED MPUB failed topic t is full: {2 * STEP_MESSAGES + 1} more")
    assert await _depth(http_port(nsqd_server), "t") == 0
    await conn.pub("t", b"still served")  # not fatal
    assert await _depth(http_port(nsqd_server), "t") == 1


async def test_commands_after_a_big_mpub_are_answered_after_it_in_order(nsqd_server, http):
    conn = await NSQConnection.open(tcp_port(nsqd_server))
    count = 3 * STEP_MESSAGES + 5
    await conn.send(b"MPUB t\n" + struct.pack(">i", count * 5 + 4) + _one_byte_mpub(count)
                    + b"PUB after\n\x00\x00\x00\x01y" + b"BOGUS\n")
    await conn.expect_response()
    await conn.expect_response()
    await conn.expect_error("E_INVALID invalid command BOGUS")
    assert await _depth(http_port(nsqd_server), "t") == count
    assert await _depth(http_port(nsqd_server), "after") == 1


async def test_big_http_batches_are_stored_whole_or_refused_whole(nsqd_server, http):
    count = 2 * STEP_MESSAGES + 1
    resp = await http.post("/mpub?topic=lines", b"ab\n\n" * count + b"y" * (nsqd_server.options.max_msg_size + 1))
    assert (resp.status, resp.json()) == (413, {"message": "MSG_TOO_BIG"})
    resp = await http.post("/mpub?topic=binary&binary=true", mpub_body([b"a", b"bb"] * count + [b""]))
    assert (resp.status, resp.json()) == (413, {"message": "BAD_MESSAGE"})
    assert await _depth(http_port(nsqd_server), "lines") == await _depth(http_port(nsqd_server), "binary") == 0
    resp = await http.post("/mpub?topic=lines", b"ab\n\n" * count)
    assert (resp.status, resp.body) == (200, b"OK")
    resp = await http.post("/mpub?topic=binary&binary=true", mpub_body([b"a", b"bb"] * count))
    assert (resp.status, resp.body) == (200, b"OK")
    assert await _depth(http_port(nsqd_server), "lines") == count
    assert await _depth(http_port(nsqd_server), "binary") == 2 * count


@pytest.mark.parametrize("flags", [["--mem-queue-size=0"], ["--durable"]], ids=["mem-queue-size=0", "durable"])
async def test_a_confirmed_big_mpub_survives_a_sigkill(tmp_path, flags):
    count = 5 * STEP_MESSAGES + 3
    daemon = Subprocess(tmp_path, *flags)
    try:
        conn = await NSQConnection.open(daemon.tcp)
        await conn.mpub("t", [b"%d" % i for i in range(count)])
    finally:
        daemon.proc.kill()
        daemon.stop()
    daemon = Subprocess(tmp_path, *flags)
    try:
        assert await _depth(daemon.http, "t") == count
    finally:
        daemon.stop()



@pytest.mark.parametrize("flags,over", [(["--mem-queue-size=0"], "tcp"), ([], "tcp"), ([], "http")],
                         ids=["mem-queue-size=0", "memory", "http"])
async def test_a_big_mpub_under_way_when_the_daemon_is_stopped_is_stored_whole_and_answered(tmp_path, flags, over):
    """SIGTERM while a big MPUB was stored a step at a time stored part of it and closed the
    connection without an answer (24,570 of 60,000 per channel): its publisher, unable to tell
    what was kept, would send it all again. Its body is in: it is stored to its end and answered,
    over HTTP too (the server gives a request being handled time to be answered when it stops)."""
    count, channels = 60_000, 3
    daemon = Subprocess(tmp_path, *flags)
    try:
        http = HTTPClient(daemon.http)
        assert (await http.post("/topic/create?topic=big")).status == 200
        for i in range(channels):
            assert (await http.post(f"/channel/create?topic=big&channel=c{i}")).status == 200
        body = mpub_body([b"%08d" % i + b"x" * 40 for i in range(count)])
        answers = []
        async with trio.open_nursery() as nursery:
            async def publish():
                if over == "tcp":
                    conn = await NSQConnection.open(daemon.tcp)
                    await conn.command("MPUB big", body)
                    answers.append(await conn.read_non_heartbeat())
                else:
                    response = await HTTPClient(daemon.http).post("/mpub?topic=big&binary=true", body)
                    answers.append((FRAME_RESPONSE, response.body) if response.status == 200 else response)

            nursery.start_soon(publish)
            with trio.fail_after(20):
                while not 0 < await _depth(daemon.http, "big") < count * channels:  # stored in part so far
                    await trio.sleep(0.005)
            daemon.proc.send_signal(signal.SIGTERM)
        assert answers == [(FRAME_RESPONSE, b"OK")]
        assert await trio.to_thread.run_sync(daemon.proc.wait, 30) == 0
    finally:
        daemon.stop()
    daemon = Subprocess(tmp_path, *flags)
    try:
        assert await _depth(daemon.http, "big") == count * channels
    finally:
        daemon.stop()

async def test_a_step_stores_about_step_messages_copies_whatever_the_channel_count(nsqd_server):
    from nsqd.broker import MIN_STEP_MESSAGES, PublishInSteps

    topic = nsqd_server.get_topic("t")
    assert PublishInSteps(nsqd_server, "t").per_step == STEP_MESSAGES == PublishInSteps(nsqd_server, "new").per_step
    for name in "abcd":
        topic.get_channel(name)
    assert PublishInSteps(nsqd_server, "t").per_step == STEP_MESSAGES // 4
    for index in range(100):
        topic.get_channel(f"c{index}")
    assert PublishInSteps(nsqd_server, "t").per_step == MIN_STEP_MESSAGES
    conn = await NSQConnection.open(tcp_port(nsqd_server))  # and a batch across them is stored whole
    await conn.command("MPUB t", _one_byte_mpub(STEP_MESSAGES + 1))
    await conn.expect_response()
    assert {c.depth for c in topic.channels.values()} == {STEP_MESSAGES + 1}


async def test_a_redrive_of_a_million_dead_letters_moves_them_in_steps_in_bounded_memory(tmp_path):
    daemon = Subprocess(tmp_path)
    try:
        conn = await NSQConnection.open(daemon.tcp)
        await conn.command("MPUB dead", _one_byte_mpub(ONE_BYTE_MAX))  # a topic without channels keeps them
        await conn.expect_response()
        http = HTTPClient(daemon.http)
        assert (await http.post("/topic/create?topic=live")).status == 200
        assert (await http.post("/channel/create?topic=live&channel=c")).status == 200
        before = daemon.memory_mb()
        resp = await http.post("/topic/redrive?topic=dead&to=live")
        assert resp.json() == {"moved": ONE_BYTE_MAX, "left": 0}
        after = daemon.memory_mb()
        assert after["VmHWM"] - before["VmRSS"] < 60, (before, after)  # all in one go took about 330 MiB
        assert await _depth(daemon.http, "live") == ONE_BYTE_MAX
        resp = await http.post("/topic/redrive?topic=dead&to=live")
        assert resp.json() == {"moved": 0, "left": 0}
    finally:
        daemon.stop()
