"""The lease extension: deliveries tagged with a name, settled from any connection."""

import json
import signal

import pytest
import trio

from .support import FRAME_RESPONSE, Daemon, NSQConnection, running_nsqd, tcp_port


async def lease_consumer(nsqd, topic="t", channel="c", msg_timeout=60000):
    conn = await NSQConnection.open(tcp_port(nsqd))
    resp = await conn.identify(feature_negotiation=True, leases=True, msg_timeout=msg_timeout)
    assert resp["leases"] is True
    await conn.sub(topic, channel)
    return conn


async def lease_command(conn, line):
    await conn.command(line)
    kind, data = await conn.read_non_heartbeat()
    assert kind == FRAME_RESPONSE, data
    return json.loads(data)


async def test_lease_is_settled_from_another_connection(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        reader = await lease_consumer(nsqd)
        await reader.mpub("t", [b"%d" % i for i in range(10)])
        assert await lease_command(reader, "LEASE run1:0:0") == {"lease": "run1:0:0", "count": 0, "reopened": False}
        await reader.command("RDY 4")
        got = [await reader.read_message() for _ in range(4)]
        assert [m.body for m in got] == [b"0", b"1", b"2", b"3"]
        await reader.command("RDY 0")
        await reader.close()  # the lease outlives the connection: nothing is requeued
        channel = nsqd.topics["t"].channels["c"]
        with trio.fail_after(2):
            while channel.subscriptions:
                await trio.sleep(0.01)
        assert channel.in_flight_count == 4 and channel.depth == 6
        driver = await lease_consumer(nsqd)
        assert await lease_command(driver, "LTOUCH run1:0:0") == {"lease": "run1:0:0", "count": 4}
        assert await lease_command(driver, "LFIN run1:0:0") == {"lease": "run1:0:0", "count": 4}
        assert channel.in_flight_count == 0 and channel.requeue_count == 0
        assert await lease_command(driver, "LFIN run1:0:0") == {"lease": "run1:0:0", "count": 0}


async def test_reopened_lease_replays_exactly_its_messages(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        first = await lease_consumer(nsqd)
        await first.mpub("t", [b"%d" % i for i in range(10)])
        await lease_command(first, "LEASE r:1:0")
        await first.command("RDY 3")
        original = [await first.read_message() for _ in range(3)]
        await first.close()
        again = await lease_consumer(nsqd)
        assert await lease_command(again, "LEASE r:1:0") == {"lease": "r:1:0", "count": 3, "reopened": True}
        replay = [await again.read_message() for _ in range(3)]
        assert [m.id for m in replay] == [m.id for m in original]
        await again.command("RDY 100")  # a sealed lease takes nothing new
        with trio.move_on_after(0.3):
            await again.read_message()
            raise AssertionError("a reopened lease received new messages")


async def test_untouched_lease_expires_and_redelivers(tmp_path):
    async with running_nsqd(tmp_path, queue_scan_interval=0.02) as nsqd:
        reader = await lease_consumer(nsqd, msg_timeout=1000)
        await reader.pub("t", b"x")
        await lease_command(reader, "LEASE gone")
        await reader.command("RDY 1")
        msg = await reader.read_message()
        await reader.close()
        plain = await NSQConnection.open(tcp_port(nsqd))
        await plain.sub("t", "c")
        await plain.command("RDY 1")
        again = await plain.read_message(timeout=3)
        assert (again.id, again.attempts) == (msg.id, 2)
        channel = nsqd.topics["t"].channels["c"]
        assert channel.timeout_count == 1 and "gone" not in channel.leases


async def test_lreq_requeues_the_whole_lease(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await lease_consumer(nsqd)
        await conn.mpub("t", [b"a", b"b", b"c", b"d"])
        await lease_command(conn, "LEASE x")
        await conn.command("RDY 3")
        [await conn.read_message() for _ in range(3)]
        await lease_command(conn, "LEASE")  # stop tagging: the lease is sealed
        assert await lease_command(conn, "LREQ x 0") == {"lease": "x", "count": 3}
        await conn.command("RDY 4")
        again = [await conn.read_message() for _ in range(4)]
        # back at the head of the queue, in the order they were delivered
        assert [m.body for m in again] == [b"a", b"b", b"c", b"d"]
        assert [m.attempts for m in again] == [2, 2, 2, 1]


async def first_of_two_under(nsqd, lease: str, *, msg_timeout: int, bodies: list[bytes]):
    """A lease consumer of t/c that published ``bodies`` and took the first under ``lease`` (RDY 1)."""
    conn = await lease_consumer(nsqd, msg_timeout=msg_timeout)
    await conn.mpub("t", bodies)
    await lease_command(conn, f"LEASE {lease}")
    await conn.command("RDY 1")
    return conn, await conn.read_message()


@pytest.mark.parametrize("end", ["LFIN", "LREQ", "timeout"])
async def test_a_connection_whose_current_lease_ended_receives_nothing_until_its_next_lease(tmp_path, end):
    """docs/leases.md: after LFIN or LREQ (or its messages timing out) the lease is gone, and its
    connection receives nothing more until another LEASE: untagged deliveries would reach a
    reader that files every message under a lease."""
    async with running_nsqd(tmp_path, queue_scan_interval=0.02) as nsqd:
        conn, first = await first_of_two_under(nsqd, "cur", msg_timeout=1000, bodies=[b"a", b"b"])
        if end == "timeout":
            channel = nsqd.topics["t"].channels["c"]
            with trio.fail_after(5):
                while "cur" in channel.leases:
                    await trio.sleep(0.02)
        else:
            assert (await lease_command(conn, f"{end} cur" + (" 0" if end == "LREQ" else "")))["count"] == 1
        await conn.command("RDY 5")
        with trio.move_on_after(0.5):
            await conn.read_message()
            raise AssertionError("an untagged delivery after the current lease ended")
        assert (await lease_command(conn, "LEASE next"))["lease"] == "next"
        got = [await conn.read_message() for _ in range(1 if end == "LFIN" else 2)]
        assert {m.body for m in got} == ({b"b"} if end == "LFIN" else {first.body, b"b"})


async def test_lease_commands_need_the_feature(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.command("LEASE a")
        await conn.expect_error("E_INVALID invalid command LEASE")
        conn = await lease_consumer(nsqd)
        await conn.command("LEASE bad/name")
        await conn.expect_error('E_BAD_LEASE LEASE lease name "bad/name" is not valid')


async def lease_consumer_at(port, topic="t", channel="c"):
    conn = await NSQConnection.open(port)
    resp = await conn.identify(feature_negotiation=True, leases=True, msg_timeout=60000)
    assert resp["leases"] is True
    await conn.sub(topic, channel)
    return conn


async def restart_keeps_the_lease(tmp_path, args, stop_signal, stops: int = 1, leased_count: int = 4):
    daemon = Daemon(tmp_path, *args)
    await daemon.wait_ready()
    reader = await lease_consumer_at(daemon.port)
    await reader.mpub("t", [b"%d" % i for i in range(10)])
    await lease_command(reader, "LEASE run:7:0")
    await reader.command(f"RDY {leased_count}")
    leased = [await reader.read_message() for _ in range(leased_count)]
    await reader.command("RDY 0")
    await reader.close()
    if stop_signal == signal.SIGKILL:
        await trio.sleep(0.5)  # past a checkpoint (--sync-timeout=100ms)
    await daemon.stop(stop_signal)
    for _ in range(stops - 1):  # started again, and stopped before anything changes
        daemon = Daemon(tmp_path, *args)
        await daemon.wait_ready()
        await trio.sleep(0.3)
        await daemon.stop(stop_signal)

    daemon = Daemon(tmp_path, *args)
    await daemon.wait_ready()
    again = await lease_consumer_at(daemon.port)
    assert await lease_command(again, "LEASE run:7:0") == {"lease": "run:7:0", "count": leased_count,
                                                           "reopened": True}
    replay = [await again.read_message() for _ in range(leased_count)]
    assert [(m.id, m.body) for m in replay] == [(m.id, m.body) for m in leased]
    driver = await lease_consumer_at(daemon.port)
    assert await lease_command(driver, "LFIN run:7:0") == {"lease": "run:7:0", "count": leased_count}
    plain = await NSQConnection.open(daemon.port)
    await plain.sub("t", "c")
    await plain.command("RDY 20")
    rest = []
    with trio.move_on_after(1):
        while True:
            msg = await plain.read_message()
            rest.append(msg.body)
            await plain.command(b"FIN " + msg.id)
    assert sorted(rest) == [b"%d" % i for i in range(leased_count, 10)]  # the leased ones are not delivered again
    assert await daemon.stop() == 0


@pytest.mark.parametrize("leased_count", [4, 8])
async def test_a_lease_survives_a_graceful_restart(tmp_path, leased_count):
    """With more messages leased than queued, the queued ones were lost: the shutdown writes the
    leased ones behind them, and their count was taken off the queue's depth twice."""
    await restart_keeps_the_lease(tmp_path, [], signal.SIGTERM, leased_count=leased_count)


async def test_a_lease_survives_a_crash_in_durable_mode(tmp_path):
    await restart_keeps_the_lease(tmp_path, ["--durable", "--sync-timeout=100ms"], signal.SIGKILL)


@pytest.mark.parametrize("flags", [["--mem-queue-size=0"], ["--durable"]])
async def test_a_lease_survives_two_crashes_in_a_row(tmp_path, flags):
    """The metadata saved when a queue opens after a crash kept the lease's records but not the
    lease's name: the next crash lost all its messages (40 of 40 in an adversarial run)."""
    await restart_keeps_the_lease(tmp_path, [*flags, "--sync-timeout=100ms"], signal.SIGKILL, stops=3)


async def test_a_lease_message_that_timed_out_comes_back_to_its_holder_at_once(tmp_path):
    """The holder's lease had two messages taken 1.5 s apart; the first times out. Its budget
    has room again: it gets the message back at the next queue scan, not once the second
    times out too (the lease empties) or something else wakes it."""
    async with running_nsqd(tmp_path, queue_scan_interval=0.02) as nsqd:
        holder, first = await first_of_two_under(nsqd, "L", msg_timeout=2000, bodies=[b"0", b"1"])
        await trio.sleep(1.5)
        await holder.command("RDY 2")
        second = await holder.read_message()
        assert second.body == b"1"
        start = trio.current_time()
        again = await holder.read_message(timeout=1.5)  # due 0.5 s from now; the second expires in 2 s
        assert (again.id, again.attempts) == (first.id, 2)
        assert trio.current_time() - start < 1.2
