"""The source's lease handling without Spark: partition reads, replays, the driver's probes and acks."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from nsq_spark.client import Connection, lease_consumer
from nsq_spark.driver import LeaseDriver
from nsq_spark.leases import LeaseReader, lease_reply, settle
from nsq_spark.options import OptionError, ReadOptions, WriteOptions, parse_duration
from nsq_spark.rows import ARROW_SCHEMA, Columns
from nsq_spark.stream import partitions_for, read_partition

from .test_spark_support import Daemon, address, consume, daemon, publish, wait_for  # noqa: F401


def bodies(n, prefix=b"m"):
    return [prefix + b"%05d" % i for i in range(n)]


def read(addr, topic, lease, *, replay=False, max_in_flight=100, max_messages=None, min_messages=0,
         max_delay=5.0, channel="c"):
    """One partition read on its own connection: (ids, bodies, segments)."""
    with lease_consumer(addr, topic, channel, 60000) as conn:
        reader = LeaseReader(conn, lease, Columns(topic, channel), replay=replay, max_in_flight=max_in_flight,
                             max_messages=max_messages, min_messages=min_messages, max_delay=max_delay)
        batches = list(reader.batches())
    assert all(b.schema.equals(ARROW_SCHEMA) for b in batches)
    ids = [i for b in batches for i in b.column("id").to_pylist()]
    return ids, [x for b in batches for x in b.column("body").to_pylist()], reader.segments


def lease_command(addr, topic, line, channel="c"):
    with lease_consumer(addr, topic, channel, 60000) as conn:
        conn.command(line)
        return lease_reply(conn)


def settle_all(addr, topic, base, verb, channel="c"):
    with lease_consumer(addr, topic, channel, 60000) as conn:
        return settle(conn, base, verb)


def test_first_read_takes_segments_up_to_its_limit_and_a_replay_gets_exactly_them(daemon):
    addr = address(daemon)
    publish(addr, "l1", bodies(400))
    ids, got, segments = read(addr, "l1", "r:1:0", max_in_flight=100, max_messages=250)
    assert got == bodies(250)
    assert [name for name, _ in segments] == ["r:1:0", "r:1:0.1", "r:1:0.2"]
    assert all(1 <= count <= 100 for _, count in segments)
    again, got_again, replayed = read(addr, "l1", "r:1:0", replay=True)
    assert (again, got_again, replayed) == (ids, got, segments)
    assert settle_all(addr, "l1", "r:1:0", "LFIN") == 250
    rest = consume(addr, "l1", "c", idle=0.3)
    assert [b for _, _, b in rest] == bodies(400)[250:]


def test_an_unlimited_read_opens_each_next_segment_early(daemon):
    addr = address(daemon)
    publish(addr, "l10", bodies(5000))
    ids, got, segments = read(addr, "l10", "u:1:0", max_in_flight=100)
    assert got == bodies(5000) and sum(count for _, count in segments) == 5000
    assert all(1 <= count <= 100 for _, count in segments)
    assert read(addr, "l10", "u:1:0", replay=True) == (ids, got, segments)


def test_a_replay_of_expired_leases_reads_nothing_new(daemon):
    addr = address(daemon)
    publish(addr, "l2", bodies(10))
    ids, got, segments = read(addr, "l2", "gone:1:0", replay=True)
    assert (ids, segments) == ([], [])
    assert len(consume(addr, "l2", "c", idle=0.3)) == 10


def test_a_retried_first_read_replays_the_earlier_attempt_then_reads_on(daemon):
    addr = address(daemon)
    publish(addr, "l3", bodies(300))
    first, _, _ = read(addr, "l3", "r:1:0", max_in_flight=50, max_messages=120)
    ids, got, segments = read(addr, "l3", "r:1:0", max_in_flight=50, max_messages=200)
    assert ids[:120] == first and got == bodies(200)
    assert segments == [("r:1:0", 50), ("r:1:0.1", 50), ("r:1:0.2", 20), ("r:1:0.3", 50), ("r:1:0.4", 30)]


def test_an_empty_lease_left_open_by_another_connection_is_started_afresh(daemon):
    addr = address(daemon)
    publish(addr, "l7", bodies(20))
    with lease_consumer(addr, "l7", "c", 60000) as holder:
        holder.command("LEASE e:1:0")  # open and empty: reopening it would seal it empty
        assert lease_reply(holder)["reopened"] is False
        _, got, segments = read(addr, "l7", "e:1:0")
    assert got == bodies(20) and segments == [("e:1:0", 20)]


def test_a_first_read_stops_when_nothing_arrives_or_waits_for_its_minimum(daemon):
    addr = address(daemon)
    publish(addr, "l4", bodies(30))
    started = time.monotonic()
    ids, _, segments = read(addr, "l4", "idle:1:0")
    assert len(ids) == 30 and segments == [("idle:1:0", 30)] and time.monotonic() - started < 2
    later = threading.Timer(0.4, publish, (addr, "l4", bodies(20, b"n")))
    later.start()
    _, got, _ = read(addr, "l4", "min:1:0", min_messages=20, max_delay=5.0)
    later.join()
    assert got == bodies(20, b"n")
    started = time.monotonic()
    assert read(addr, "l4", "min:2:0", min_messages=5, max_delay=0.5)[0] == []
    assert 0.4 < time.monotonic() - started < 3


def test_driver_probes_plans_and_acknowledges(daemon):
    addr = address(daemon)
    opts = ReadOptions.parse({"nsqd.address": addr, "topic": "l5", "channel": "c", "numPartitions": "2",
                              "maxInFlight": "40"})
    driver = LeaseDriver(opts, "run")
    try:
        assert not driver.new_data(1)
        publish(addr, "l5", bodies(100))
        assert wait_for(lambda: driver.new_data(1), 2, 0.01) and driver.is_fresh(1)
        parts = partitions_for(opts, "run", 1, replay=False)
        got = [b for p in parts for batch in read_partition(opts, p) for b in batch.column("body").to_pylist()]
        assert sorted(got) == bodies(100)  # the probe's message is read by partition 0
        replayed = [b for p in partitions_for(opts, "run", 1, replay=True)
                    for batch in read_partition(opts, p) for b in batch.column("body").to_pylist()]
        assert replayed == got

        def held():
            return sum(settle_all(addr, "l5", f"run:1:{p}", "LTOUCH") for p in (0, 1))

        assert held() == 100
        driver.acknowledge(1)
        assert held() == 0
    finally:
        driver.close()


def test_driver_touches_pending_leases_and_gives_back_an_unplanned_probe(daemon):
    addr = address(daemon)
    opts = ReadOptions.parse({"nsqd.address": addr, "topic": "l6", "channel": "c", "msgTimeoutMs": "2000"})
    publish(addr, "l6", bodies(5))
    driver = LeaseDriver(opts, "run")
    try:
        assert driver.new_data(1)
        list(read_partition(opts, partitions_for(opts, "run", 1, replay=False)[0]))
        assert not driver.new_data(2)  # nothing left: the probe for batch 2 waits
        time.sleep(4.5)  # past the message timeout: only the keeper's LTOUCHes keep the leases
        assert settle_all(addr, "l6", "run:1:0", "LTOUCH") == 5
        publish(addr, "l6", [b"late"])  # the waiting probe takes it
        time.sleep(0.2)
    finally:
        driver.close()  # batch 2 was never planned: the probe gives its message back
    assert settle_all(addr, "l6", "run:1:0", "LFIN") == 5
    assert [(b, a) for _, a, b in consume(addr, "l6", "c", idle=0.3)] == [(b"late", 2)]


@pytest.fixture(scope="module")
def second_daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("nsqd2"))
    d.wait_ready_sync()
    yield d
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0


def test_several_daemons_each_get_a_partition_and_a_probe(daemon, second_daemon):
    first, second = address(daemon), address(second_daemon)
    opts = ReadOptions.parse({"nsqd.address": f"{first},{second}", "topic": "l9", "channel": "c",
                              "numPartitions": "3"})
    assert [p.address for p in partitions_for(opts, "run", 1, replay=False)] == [first, second, first]
    driver = LeaseDriver(opts, "run")
    try:
        assert not driver.new_data(1)
        publish(second, "l9", bodies(50))  # data on the second daemon only
        assert wait_for(lambda: driver.new_data(1), 2, 0.01)
        got = [b for p in partitions_for(opts, "run", 1, replay=False)
               for batch in read_partition(opts, p) for b in batch.column("body").to_pylist()]
        assert sorted(got) == bodies(50)
        assert settle_all(second, "l9", "run:1:1", "LTOUCH") == 50
        driver.acknowledge(1)
        assert settle_all(second, "l9", "run:1:1", "LTOUCH") == 0
    finally:
        driver.close()


def test_heartbeats_are_answered_while_reading(daemon):
    addr = address(daemon)
    with Connection(addr) as conn:
        conn.identify(heartbeat_interval=1000)
        conn.subscribe("l8", "c")
        assert conn.read_frames(2.5) == []  # two heartbeats came and were answered
        publish(addr, "l8", [b"still here"])
        conn.command("RDY 1")
        kind, data = conn.read_frame()
        assert data.endswith(b"still here")


def test_options_are_checked():
    base = {"nsqd.address": "127.0.0.1:4150,127.0.0.1:4250", "topic": "t", "channel": "c"}
    opts = ReadOptions.parse({**base, "MAXMESSAGESPERTRIGGER": "10", "numpartitions": "3"})
    assert [opts.share(opts.max_messages, p) for p in range(3)] == [4, 3, 3]
    assert opts.num_partitions == 3 and opts.max_delay == 1.0
    assert parse_duration("x", "250ms") == 0.25 and parse_duration("x", "2m") == 120 and parse_duration("x", "5") == 0.005
    with pytest.raises(OptionError, match="unknown option 'chanel'"):
        ReadOptions.parse({**base, "chanel": "c"})
    with pytest.raises(OptionError, match="must be at least the number of nsqd addresses"):
        ReadOptions.parse({**base, "numPartitions": "1"})
    with pytest.raises(OptionError, match="'channel' is required"):
        ReadOptions.parse({"nsqd.address": "h:1", "topic": "t"})
    with pytest.raises(OptionError, match="not host:port"):
        WriteOptions.parse({"nsqd.address": "localhost"})
    assert WriteOptions.parse({"nsqd.address": "h:1", "checkpointLocation": "/x"}).topic is None
