"""Careless and hostile clients against ``python -m nsqd`` as a subprocess, its memory read
from /proc: what they make the daemon hold stays bounded (docs/limits.md)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from contextlib import asynccontextmanager

import pytest
import trio

from amqp_gateway import performatives as p
from nsqd import body_budget

from .conftest import HTTPClient, http_port
from .support import (FRAME_MESSAGE, SPAWNED, NSQConnection, free_port, mpub_body, running_nsqd, tcp_port,
                      wait_for_ports)
from .test_amqp_raw import Client

MIB = 1024 * 1024


class Subprocess:
    """The daemon with all three ports, logging to a file, and its memory figures."""

    def __init__(self, tmp_path, *args: str) -> None:
        self.tcp, self.http, self.amqp = free_port(), free_port(), free_port()
        self.log = open(tmp_path / "nsqd.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{self.tcp}",
             f"--http-address=127.0.0.1:{self.http}", f"--amqp-address=127.0.0.1:{self.amqp}",
             "--shutdown-grace=0", f"--data-path={tmp_path / 'data'}", "--log-level=error", *args],
            stdout=subprocess.DEVNULL, stderr=self.log)
        SPAWNED.append(self.proc)
        wait_for_ports(self.proc, (self.tcp, self.http, self.amqp), (tmp_path / "nsqd.log").read_text)

    def memory_mb(self) -> dict[str, float]:
        """VmRSS (now) and VmHWM (the peak so far), in MiB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


async def _publish_large(port: int, topic: str, count: int, size: int) -> None:
    conn = await NSQConnection.open(port)
    for _ in range(count):
        await conn.pub(topic, b"x" * size)
    await conn.close()


@asynccontextmanager
async def _big_topic(tmp_path):
    """The daemon with 60 MiB of 1 MiB messages in topic "big" (most on disk), and its memory then."""
    daemon = Subprocess(tmp_path, "--mem-queue-size=10")
    try:
        await _publish_large(daemon.tcp, "big", 60, MIB - 64)
        await trio.sleep(0.3)
        yield daemon, daemon.memory_mb()
    finally:
        daemon.stop()


async def _channel_stats(http_port: int, topic: str) -> dict:
    stats = (await HTTPClient(http_port).get(f"/stats?format=json&topic={topic}")).json()
    return stats["topics"][0]["channels"][0]


async def _greedy_nsq_consumer(daemon: Subprocess):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", daemon.tcp))
    consumer = NSQConnection(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
    await consumer.send(b"  V2")
    await consumer.sub("big", "c")
    await consumer.command("RDY 2500")  # and never read again
    return consumer.stream


async def _greedy_amqp_receiver(daemon: Subprocess):
    client = await Client.connect(daemon.amqp)
    link = client.session.attach("greedy", p.RECEIVER)
    link.attach(p.Source("/topics/big/channels/c"), p.Target())
    await client.until(lambda: link.attach_received)
    link.flow(1_000_000)  # and never read again
    await client.flush()
    return client


@pytest.mark.parametrize("greedy", [_greedy_nsq_consumer, _greedy_amqp_receiver], ids=["nsq", "amqp"])
async def test_a_consumer_that_does_not_read_holds_a_bounded_share_of_a_big_topic(tmp_path, greedy):
    async with _big_topic(tmp_path) as (daemon, before):
        consumer = await greedy(daemon)
        await trio.sleep(1.5)
        channel = await _channel_stats(daemon.http, "big")
        after = daemon.memory_mb()
        # the socket buffers and one fill, not the topic: NSQ held all 60, AMQP 256 (FILL_BATCH)
        assert channel["in_flight_count"] <= 16, channel
        assert channel["depth"] + channel["in_flight_count"] == 60
        assert after["VmHWM"] - before["VmRSS"] < 40, (before, after)
        await consumer.aclose()


async def test_a_deep_disk_backlog_moves_to_a_new_channel_in_small_steps(tmp_path):
    async with _big_topic(tmp_path) as (daemon, before):  # the topic keeps 50 on its disk
        consumer = await NSQConnection.open(daemon.tcp)
        await consumer.sub("big", "c")  # the backlog moves to the channel: it read 2,000 a step
        with trio.fail_after(10):
            while (await _channel_stats(daemon.http, "big"))["depth"] < 60:
                await trio.sleep(0.05)
        after = daemon.memory_mb()
        assert after["VmHWM"] - before["VmRSS"] < 30, (before, after)
        await consumer.command("RDY 1")
        kind, data = await consumer.read_non_heartbeat()
        assert kind == FRAME_MESSAGE and len(data) == 26 + MIB - 64
        await consumer.close()


async def test_a_reading_consumer_still_gets_every_large_message(tmp_path):
    daemon = Subprocess(tmp_path, "--mem-queue-size=5")
    try:
        conn = await NSQConnection.open(daemon.tcp)
        await conn.sub("t", "c")
        pub = await NSQConnection.open(daemon.tcp)
        for i in range(30):  # 30 messages of 512 KiB: many fills of FILL_BYTES each
            await pub.pub("t", b"%04d" % i + b"y" * (512 * 1024))
        await conn.command("RDY 2500")
        seen = []
        for _ in range(30):
            msg = await conn.read_message()
            seen.append(int(msg.body[:4]))
            await conn.command(b"FIN " + msg.id)
        # all of them (memory and disk take turns: not in order), none stuck behind a fill cut short
        assert sorted(seen) == list(range(30))
    finally:
        daemon.stop()


@pytest.mark.parametrize("greedy", [_greedy_nsq_consumer, _greedy_amqp_receiver], ids=["nsq", "amqp"])
async def test_a_consumer_whose_writes_are_blocked_never_keeps_messages_from_an_idle_one(tmp_path, greedy):
    """The channel woke its hungry consumers first come first: one whose write was blocked (its
    client does not read) was woken for every new message, counted as taking it, and took it only
    once its write went through (an idle NSQ consumer waited until its heartbeat, 30 s; an AMQP one
    until the blocked client was dropped, 60 s). A consumer that cannot write now is passed over."""
    daemon = Subprocess(tmp_path)
    try:
        stuck = await greedy(daemon)  # first in line, with room for 1,000,000 or 2,500
        pub = await NSQConnection.open(daemon.tcp)
        await pub.pub("big", b"x" * 900_000)  # it takes it, its write blocks, it waits for more
        await trio.sleep(0.5)
        idle = await NSQConnection.open(daemon.tcp)
        await idle.sub("big", "c")
        await idle.command("RDY 100")
        await trio.sleep(0.3)  # the idle consumer took what was queued, if anything, and waits
        await pub.pub("big", b"small")
        with trio.fail_after(3):
            while (msg := await idle.read_message()).body != b"small":
                await idle.command(b"FIN " + msg.id)
        await stuck.aclose()
    finally:
        daemon.stop()


def _stall_in_a_big_body(port: int, size: int, sent: int) -> socket.socket:
    """A client that starts an MPUB of ``size`` bytes, sends ``sent`` of them and stalls."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(0.05)
    data = b"  V2MPUB t\n" + struct.pack(">i", size) + b"\x00" * sent
    try:
        sock.sendall(data)
    except TimeoutError:  # the daemon stopped reading: the kernel's buffers are full
        pass
    return sock


async def test_clients_that_stall_in_big_bodies_hold_at_most_max_body_memory(tmp_path):
    """40 clients each send 4.9 MB of a 5 MB MPUB body and stall: without the shared budget the
    daemon held all of it (about 200 MB) until their deadlines; with it, 16 MiB of bodies."""
    daemon = Subprocess(tmp_path, "--max-body-memory=16777216")
    try:
        before = daemon.memory_mb()
        size = 5 * MIB - 100
        stalled = await trio.to_thread.run_sync(
            lambda: [_stall_in_a_big_body(daemon.tcp, size, size - 100_000) for _ in range(40)])
        await trio.sleep(0.5)
        after = daemon.memory_mb()
        assert after["VmHWM"] - before["VmRSS"] < 60, (before, after)
        held = await _metric(daemon.http, "nsqd_body_memory_bytes")
        assert 0 < held <= 16 * MIB and held % (len(b"MPUB t\n") + 4 + size) == 0  # whole commands that fit
        assert await _metric(daemon.http, "nsqd_body_memory_waits_total") >= 1
        # publishes with small bodies are not held up
        conn = await NSQConnection.open(daemon.tcp)
        await conn.mpub("small", [b"x" * 1000] * 100)
        # a big one waits for room, and gets it once the stalled clients go away
        big = await NSQConnection.open(daemon.tcp)
        body = struct.pack(">i", 4) + (struct.pack(">i", 1000 * 1000) + b"y" * 1000 * 1000) * 4
        await big.send(b"MPUB big\n" + struct.pack(">i", len(body)) + body[:1000])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(big.send, body[1000:])
            await trio.sleep(0.3)
            for sock in stalled:
                sock.close()
        await big.expect_response()
        with trio.fail_after(5):  # every reservation is given back as the stalled connections end
            while await _metric(daemon.http, "nsqd_body_memory_bytes"):
                await trio.sleep(0.05)
    finally:
        daemon.stop()


async def test_clients_that_stall_in_bodies_under_a_mebibyte_hold_at_most_max_body_memory(tmp_path):
    """Bodies up to 1 MiB took nothing from the budget: 2,000 clients that each sent all but one
    byte of a 1,040,000-byte PUB held 2.6 GB. Every body that one read cannot bring whole counts."""
    daemon = Subprocess(tmp_path, "--max-body-memory=4194304")
    try:
        before = daemon.memory_mb()
        size = 1_040_000
        stalled = await trio.to_thread.run_sync(
            lambda: [_stall_in_a_pub_body(daemon.tcp, size) for _ in range(60)])
        await trio.sleep(0.5)
        after = daemon.memory_mb()
        held = await _metric(daemon.http, "nsqd_body_memory_bytes")
        assert 0 < held <= 4 * MIB and held % (len(b"PUB t\n") + 4 + size) == 0  # whole commands that fit
        assert await _metric(daemon.http, "nsqd_body_memory_waits_total") >= 1
        assert after["VmHWM"] - before["VmRSS"] < 40, (before, after)  # 60 MB held before
        for sock in stalled:
            sock.close()
        with trio.fail_after(5):
            while await _metric(daemon.http, "nsqd_body_memory_bytes"):
                await trio.sleep(0.05)
    finally:
        daemon.stop()


def _stall_in_a_pub_body(port: int, size: int) -> socket.socket:
    """A client that sends all but the last byte of a PUB of ``size`` bytes and stalls."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(0.05)
    try:
        sock.sendall(b"  V2PUB t\n" + struct.pack(">i", size) + b"z" * (size - 1))
    except TimeoutError:  # the daemon stopped reading: the kernel's buffers are full
        pass
    return sock


async def _metric(http_port: int, name: str) -> float:
    text = (await HTTPClient(http_port).get("/metrics")).body.decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


async def test_an_http_mpub_waits_for_room_in_the_body_budget_and_then_completes(tmp_path):
    daemon = Subprocess(tmp_path, "--max-body-memory=6291456")  # 6 MiB: one stalled 5 MB body fills it
    try:
        size = 5 * MIB - 100
        stalled = await trio.to_thread.run_sync(_stall_in_a_big_body, daemon.tcp, size, size - 100_000)
        lines = b"y" * 999 + b"\n"
        done = trio.Event()

        async def publish():
            resp = await HTTPClient(daemon.http).post("/mpub?topic=http", lines * 3000)  # 3 MB
            assert (resp.status, resp.body) == (200, b"OK")
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish)
            await trio.sleep(0.5)
            assert not done.is_set()  # held: the stalled body has the budget
            assert await _metric(daemon.http, "nsqd_body_memory_waits_total") == 1
            stalled.close()
            with trio.fail_after(5):
                await done.wait()
        stats = (await HTTPClient(daemon.http).get("/stats?format=json&topic=http")).json()
        assert stats["topics"][0]["depth"] == 3000
    finally:
        daemon.stop()


async def test_a_chunked_body_with_a_content_length_is_held_to_the_body_budget_and_not_refused_by_it(tmp_path):
    """Transfer-Encoding frames the body; its Content-Length means nothing (Go drops it). Read
    as the size, a chunked /mpub declaring 10 bytes reserved nothing of --max-body-memory
    (60 stalled 4.9 MB bodies: +140-230 MiB of RSS), and one declaring 2 MB was refused 413."""
    async with running_nsqd(tmp_path, max_body_memory=8 * MIB, http_address="127.0.0.1:0") as nsqd:
        port = http_port(nsqd)
        stalled = await trio.open_tcp_stream("127.0.0.1", port)
        await stalled.send_all(b"POST /mpub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
                               b"Transfer-Encoding: chunked\r\n\r\n100000\r\n" + b"y\n" * 1000)
        with trio.fail_after(5):
            while nsqd.body_budget.used < 5 * MIB:  # the endpoint's limit, as for any chunked body
                await trio.sleep(0.01)
        await stalled.aclose()
        for path, body in (("/pub?topic=t", b"hi"), ("/mpub?topic=t", b"a\nb\n")):
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                                  % (path.encode(), len(body), body))
            answer = b""
            with trio.fail_after(5):
                while b"\r\n\r\n" not in answer:
                    answer += await client.receive_some(4096)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            await client.aclose()
        assert nsqd.topics["t"].depth == 3


async def test_a_big_body_that_finds_no_room_in_time_is_dropped_and_refused(tmp_path, monkeypatch):
    """A client that declares a big body and sends nothing holds the budget for nothing; its
    victims waited for as long as it cared to reconnect. Past ROOM_WAIT without room a body is
    read and dropped as it arrives (nothing held) and its command refused, with "try again":
    TCP's MPUB with a non-fatal E_MPUB_FAILED (the connection goes on), HTTP's /mpub with 503."""
    monkeypatch.setattr(body_budget, "ROOM_WAIT", 0.3)
    async with running_nsqd(tmp_path, max_body_memory=3 * MIB, http_address="127.0.0.1:0") as nsqd:
        budget = nsqd.body_budget
        squatter = await NSQConnection.open(tcp_port(nsqd))
        await squatter.send(b"MPUB t\n" + struct.pack(">i", 3 * MIB - 100))  # and nothing more
        with trio.fail_after(5):
            while not budget.used:
                await trio.sleep(0.01)
        victim = await NSQConnection.open(tcp_port(nsqd))
        body = mpub_body([b"y" * 1000] * 2000)  # 2 MB
        await victim.send(b"MPUB big\n" + struct.pack(">i", len(body)) + body + b"NOP\n")
        await victim.expect_error(f"E_MPUB_FAILED MPUB failed {body_budget.NO_ROOM}")
        await victim.pub("small", b"x")  # the connection goes on, the NOP behind the body was read
        lines = b"z" * 999 + b"\n"
        response = await HTTPClient(http_port(nsqd)).post("/mpub?topic=http", lines * 2000)
        assert (response.status, response.json()) == (503, {"message": f"MPUB_FAILED: {body_budget.NO_ROOM}"})
        assert budget.refusals == 2 and "big" not in nsqd.topics and "http" not in nsqd.topics
        metrics = (await HTTPClient(http_port(nsqd)).get("/metrics")).body.decode()
        assert "nsqd_body_memory_refusals_total 2\n" in metrics

        await squatter.close()  # room again: the same publishes go through
        with trio.fail_after(5):
            while budget.used:
                await trio.sleep(0.01)
        await victim.mpub("big", [b"y" * 1000] * 2000)
        response = await HTTPClient(http_port(nsqd)).post("/mpub?topic=http", lines * 2000)
        assert (response.status, response.body) == (200, b"OK")
        assert (nsqd.topics["big"].message_count, nsqd.topics["http"].message_count) == (2000, 2000)
