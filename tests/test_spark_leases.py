"""The source's lease handling without Spark: partition reads, replays, the driver's probes and acks."""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time

import pyarrow as pa
import pytest

from nsq_spark import leases
from nsq_spark.client import Connection, ConnectionLost
from nsq_spark.driver import LeaseDriver
from nsq_spark.leases import LeaseReader, Subscription, lease_consumer, lease_reply, settle
from nsq_spark.options import OptionError, ReadOptions, WriteOptions, parse_duration
from nsq_spark.rows import ARROW_SCHEMA, Columns
from nsq_spark.sink import Publisher
from nsq_spark.stream import partitions_for, read_partition

from .test_spark_support import (Daemon, RestartableDaemon, address, consume, daemon, publish,  # noqa: F401
                                 wait_for)


def bodies(n, prefix=b"m"):
    return [prefix + b"%05d" % i for i in range(n)]


def read(addr, topic, lease, *, replay=False, max_in_flight=100, max_messages=None, min_messages=0,
         max_delay=5.0, channel="c"):
    """One partition read: (ids, bodies, segments as (name, count))."""
    link = Subscription(ReadOptions.parse({"nsqd.address": addr, "topic": topic, "channel": channel,
                                           "maxInFlight": str(max_in_flight)}), addr)
    reader = LeaseReader(link, lease, Columns(topic, channel), replay=replay, max_in_flight=max_in_flight,
                         max_messages=max_messages, min_messages=min_messages, max_delay=max_delay)
    try:
        batches = list(reader.batches())
    finally:
        link.close()
    assert all(b.schema.equals(ARROW_SCHEMA) for b in batches)
    ids = [i for b in batches for i in b.column("id").to_pylist()]
    return ids, [x for b in batches for x in b.column("body").to_pylist()], list(reader.segments.items())


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


def test_an_unlimited_read_goes_on_over_segments_each_on_a_connection_of_its_own(daemon):
    addr = address(daemon)
    publish(addr, "l10", bodies(5000))
    ids, got, segments = read(addr, "l10", "u:1:0", max_in_flight=100)
    assert got == bodies(5000) and sum(count for _, count in segments) == 5000
    assert [name for name, _ in segments] == [leases.segment_name("u:1:0", i) for i in range(len(segments))]
    # a segment ends once nsqd refills it no more (less than an eighth of RDY free), not earlier
    assert all(88 <= count <= 100 for _, count in segments[:-1]) and 1 <= segments[-1][1] <= 100
    assert read(addr, "l10", "u:1:0", replay=True) == (ids, got, segments)


def test_a_read_of_more_than_the_daemons_max_rdy_count_gets_everything_within_the_budget(tmp_path, monkeypatch):
    capped = RestartableDaemon(tmp_path / "nsqd", "--max-rdy-count=50")
    try:
        addr = address(capped)
        publish(addr, "cap", bodies(1000))
        peak = {"in_flight": 0, "ready": 0}
        reading = threading.Event()
        reading.set()

        def watch():  # what nsqd counts per connection, all along the read
            while reading.is_set():
                for client in capped.channel_stats("cap", "c").get("clients", []):
                    peak["in_flight"] = max(peak["in_flight"], client["in_flight_count"])
                    peak["ready"] = max(peak["ready"], client["ready_count"])
                time.sleep(0.01)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        monkeypatch.setattr(leases, "BATCH_ROWS", 10)
        reader = reader_for(addr, "cap", "cap:1:0", max_in_flight=50, max_delay=30.0)
        got = []
        for batch in reader.batches():  # a slow consumer: nsqd sends ahead only what the budget allows
            got.extend(batch.column("body").to_pylist())
            time.sleep(0.005)
        reader.link.close()
        reading.clear()
        watcher.join()
        assert got == bodies(1000)
        names = list(reader.segments)
        assert names == [leases.segment_name("cap:1:0", i) for i in range(len(names))] and len(names) >= 20
        assert all(1 <= count <= 50 for count in reader.segments.values())
        assert 0 < peak["in_flight"] <= 50 and peak["ready"] <= 50
        assert settle_all(addr, "cap", "cap:1:0", "LFIN") == 1000
        stats = capped.channel_stats("cap", "c")
        assert (stats["depth"], stats["in_flight_count"]) == (0, 0)
    finally:
        capped.stop(signal.SIGKILL)


def test_a_replay_of_expired_leases_reads_nothing_new(daemon):
    addr = address(daemon)
    publish(addr, "l2", bodies(10))
    ids, got, segments = read(addr, "l2", "gone:1:0", replay=True)
    assert (ids, segments) == ([], [])
    assert len(consume(addr, "l2", "c", idle=0.3)) == 10


def test_a_replay_that_finds_a_segment_expired_queues_the_later_ones_again_so_lfin_finishes_nothing_unread(daemon):
    """Segments expire one by one: with the first gone and the others live, the replay read nothing,
    and the driver's LFIN walk (a window of 16 names) finished the later segments unread: lost."""
    addr = address(daemon)
    publish(addr, "gap", bodies(250))
    _, got, segments = read(addr, "gap", "g:1:0", max_in_flight=100, max_messages=250)
    assert got == bodies(250) and len(segments) == 3
    assert lease_command(addr, "gap", "LREQ g:1:0 0")["count"] == segments[0][1]  # as if it expired
    assert read(addr, "gap", "g:1:0", replay=True) == ([], [], [])
    assert settle_all(addr, "gap", "g:1:0", "LFIN") == 0  # nothing of this batch was read again
    assert sorted(b for _, _, b in consume(addr, "gap", "c", idle=0.3)) == bodies(250)


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


def test_a_slow_stream_is_read_whole_although_the_daemon_buffers_its_output(daemon):
    """Messages 80 ms apart: the daemon must not hold them in its output buffer past the reader's idle gap."""
    addr = address(daemon)
    publish(addr, "l5", [b"warm-up"])
    read(addr, "l5", "slow:0:0")

    def trickle():
        for body in bodies(8, b"s"):
            time.sleep(0.08)
            publish(addr, "l5", [body])

    assert leases.OUTPUT_BUFFER_TIMEOUT_MS / 1000 + 0.08 < leases.IDLE_GAP
    writer = threading.Thread(target=trickle)
    writer.start()
    try:
        _, got, _ = read(addr, "l5", "slow:1:0", min_messages=1, max_delay=10.0)
    finally:
        writer.join()
    assert got == bodies(8, b"s")


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



@pytest.mark.parametrize("limit", ["deadline", "share"])
def test_a_read_that_must_stop_at_once_still_gets_the_probes_message(daemon, limit):
    """The probe took the batch's first message under the partition's first lease; a read that
    stopped before opening that lease (its time already up, as after a slow connect to a daemon
    that was restarting, or a share of 0 from maxMessagesPerTrigger) ended empty, and the
    batch's acknowledgement finished the message unread."""
    addr = address(daemon)
    topic = f"probe_{limit}"
    opts = ReadOptions.parse({"nsqd.address": addr, "topic": topic, "channel": "c", "numPartitions": "2"})
    driver = LeaseDriver(opts, "run")
    try:
        publish(addr, topic, [b"only"])
        assert wait_for(lambda: driver.new_data(1), 2, 0.01)
        link = Subscription(opts, addr)
        limits = {"max_messages": 0} if limit == "share" else {"max_delay": 1e-9}
        reader = LeaseReader(link, "run:1:0", Columns(topic, "c"), replay=False, max_in_flight=100,
                             **{"max_messages": None, "min_messages": 0, "max_delay": 5.0, **limits})
        try:
            got = [b for batch in reader.batches() for b in batch.column("body").to_pylist()]
        finally:
            link.close()
        assert got == [b"only"]
        driver.acknowledge(1)
    finally:
        driver.close()

def test_driver_touches_pending_leases_and_the_next_run_takes_over_an_unplanned_probe(daemon):
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
        assert wait_for(lambda: settle_all(addr, "l6", "run:2:0", "LTOUCH") == 1, 5, 0.05)
    finally:
        driver.close()  # batch 2 was never planned: its lease keeps the message for the next run
    assert settle_all(addr, "l6", "run:1:0", "LFIN") == 5
    again = LeaseDriver(opts, "run")  # the query restarted from its checkpoint
    try:
        assert again.new_data(2)  # its probe reopened the lease
        got = [(b, a) for batch in read_partition(opts, partitions_for(opts, "run", 2, replay=False)[0])
               for b, a in zip(batch.column("body").to_pylist(), batch.column("attempts").to_pylist())]
        assert got == [(b"late", 1)]  # taken over: not delivered again, no attempt counted
        again.acknowledge(2)
    finally:
        again.close()
    assert consume(addr, "l6", "c", idle=0.3) == []


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
    assert parse_duration("x", "250ms") == 0.25 and parse_duration("x", "2m") == 120
    assert parse_duration("x", "5") == 0.005
    with pytest.raises(OptionError, match="unknown option 'chanel'"):
        ReadOptions.parse({**base, "chanel": "c"})
    with pytest.raises(OptionError, match="must be at least the number of nsqd addresses"):
        ReadOptions.parse({**base, "numPartitions": "1"})
    assert ReadOptions.parse({**base, "numPartitions": "2048"}).num_partitions == 2048
    with pytest.raises(OptionError, match=r"'numPartitions' \(2049\) must be at most 1024 per nsqd address"):
        ReadOptions.parse({**base, "numPartitions": "2049"})
    with pytest.raises(OptionError, match="'channel' is required"):
        ReadOptions.parse({"nsqd.address": "h:1", "topic": "t"})
    for bad in ("localhost", "127.0.0.1:99999", "127.0.0.1:0"):
        with pytest.raises(OptionError, match="not host:port"):
            WriteOptions.parse({"nsqd.address": bad})
    assert WriteOptions.parse({"nsqd.address": "h:1", "checkpointLocation": "/x"}).topic is None
    assert opts.reconnect_timeout == 300
    assert WriteOptions.parse({"nsqd.address": "h:1", "reconnectTimeout": "30s"}).reconnect_timeout == 30
    assert ReadOptions.parse({**base, "topic": "a" * 54 + "#ephemeral"}).topic.endswith("#ephemeral")
    for delay in ("0", "0s"):
        with pytest.raises(OptionError, match="'maxTriggerDelay' must be more than 0"):
            ReadOptions.parse({**base, "maxTriggerDelay": delay})
    for name in ("a" * 65, "t#ephemeral#ephemeral", "orders_us extra", "t\nPUB x", ""):
        with pytest.raises(OptionError, match="option 'topic'"):
            ReadOptions.parse({**base, "topic": name})


# ---------------------------------------------------------------- lost connections and daemon restarts
@pytest.fixture
def restartable(tmp_path):
    d = RestartableDaemon(tmp_path / "nsqd", "--shutdown-grace=5s")
    yield d
    if d.proc.poll() is None:
        d.stop(signal.SIGKILL)


def reader_for(addr, topic, lease, **limits):
    limits = {"max_in_flight": 100, "max_messages": None, "min_messages": 0, "max_delay": 10.0, **limits}
    link = Subscription(ReadOptions.parse({"nsqd.address": addr, "topic": topic, "channel": "c",
                                           "reconnectTimeout": "30s",
                                           "maxInFlight": str(limits["max_in_flight"])}), addr)
    return LeaseReader(link, lease, Columns(topic, "c"), replay=False, **limits)


def read_in_thread(reader):
    """Run ``reader`` in a thread; returns the thread and the list its bodies go to."""
    got = []

    def run():
        try:
            for batch in reader.batches():
                got.extend(batch.column("body").to_pylist())
        finally:
            reader.link.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def test_a_read_whose_connection_breaks_goes_on_without_repeating_or_losing(daemon, monkeypatch):
    addr = address(daemon)
    publish(addr, "r1", bodies(1000))
    monkeypatch.setattr(leases, "BATCH_ROWS", 60)  # hand batches over mid-segment
    reader = reader_for(addr, "r1", "cut:1:0")
    got = []
    for i, batch in enumerate(reader.batches()):
        got.extend(batch.column("body").to_pylist())
        if i in (1, 4, 9):
            reader.link.conn.sock.shutdown(socket.SHUT_RDWR)  # whatever was on its way is lost with it
    reader.link.close()
    assert got == bodies(1000)  # the reopened segment sent what was lost; what was handed over is skipped
    assert settle_all(addr, "r1", "cut:1:0", "LFIN") == 1000  # and the segment names have no gaps
    assert consume(addr, "r1", "c", idle=0.3) == []


def test_close_wait_ends_a_read_with_what_it_has_and_the_drain_takes_lfin(restartable):
    addr = address(restartable)
    publish(addr, "r2", bodies(100))
    settler = lease_consumer(addr, "r2", "c", 60000)  # subscribed before the drain, as the driver's is
    thread, got = read_in_thread(reader_for(addr, "r2", "cw:1:0", min_messages=1000, max_delay=60.0))
    assert wait_for(lambda: lease_command(addr, "r2", "LTOUCH cw:1:0")["count"] == 100, 10, 0.05)
    started = time.monotonic()
    restartable.proc.send_signal(signal.SIGTERM)
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 3  # it did not wait for its minimum
    assert got == bodies(100)
    assert settle(settler, "cw:1:0", "LFIN") == 100  # the draining daemon still settles leases
    settler.close()
    assert restartable.proc.wait(10) == 0
    restartable.start()
    assert consume(addr, "r2", "c", idle=0.5) == []  # finished before the restart: nothing comes back


def test_a_read_survives_a_daemon_crash_and_goes_on_under_fresh_segment_names(restartable):
    addr = address(restartable)
    publish(addr, "r3", bodies(100))
    reader = reader_for(addr, "r3", "kill:1:0", max_in_flight=40, min_messages=150, max_delay=60.0)
    thread, got = read_in_thread(reader)
    assert wait_for(lambda: len(reader.columns) + len(got) == 100, 10, 0.05)
    restartable.stop(signal.SIGKILL)  # the 100 in memory are gone with it
    time.sleep(1)
    assert thread.is_alive()  # waiting for the daemon
    restartable.start()
    with lease_consumer(addr, "r3", "c", 60000):  # the channel exists again before the publish
        publish(addr, "r3", bodies(50, b"n"))
    thread.join(30)
    assert not thread.is_alive()
    assert got == bodies(100) + bodies(50, b"n")
    names = list(reader.segments)  # renamed from the first: no gap for LFIN
    assert names == [leases.segment_name("kill:1:0", i) for i in range(len(names))]
    assert sum(reader.segments.values()) == 50
    assert settle_all(addr, "r3", "kill:1:0", "LFIN") == 50
    assert consume(addr, "r3", "c", idle=0.3) == []


def test_a_read_survives_a_crash_of_a_durable_daemon_with_its_segments(tmp_path):
    durable = RestartableDaemon(tmp_path / "nsqd", "--durable", "--sync-timeout=100ms")
    try:
        addr = address(durable)
        publish(addr, "r7", bodies(100))
        reader = reader_for(addr, "r7", "dur:1:0", max_in_flight=40, min_messages=150, max_delay=60.0)
        thread, got = read_in_thread(reader)
        assert wait_for(lambda: len(reader.columns) + len(got) == 100, 10, 0.05)
        time.sleep(0.5)  # past a checkpoint: the leases are noted on disk
        durable.stop(signal.SIGKILL)
        time.sleep(0.5)
        assert thread.is_alive()  # waiting for the daemon
        durable.start()
        with lease_consumer(addr, "r7", "c", 60000):
            publish(addr, "r7", bodies(50, b"n"))
        thread.join(30)
        assert not thread.is_alive()
        assert got == bodies(100) + bodies(50, b"n")  # the reopened segment's messages were skipped by id
        names = list(reader.segments)  # the segments before the crash are kept, the read went on after them
        assert names == [leases.segment_name("dur:1:0", i) for i in range(len(names))]
        assert sum(reader.segments.values()) == 150 and list(reader.segments.values())[:3] == [40, 40, 20]
        assert settle_all(addr, "r7", "dur:1:0", "LFIN") == 150
        assert consume(addr, "r7", "c", idle=0.3) == []
    finally:
        durable.stop(signal.SIGKILL)


def batch_bodies(opts, batch, run="run"):
    """The bodies a first read of every partition of ``batch`` gets."""
    return [b for p in partitions_for(opts, run, batch, replay=False)
            for part in read_partition(opts, p) for b in part.column("body").to_pylist()]


@pytest.mark.parametrize("driver_restarts", [False, True])
def test_a_durable_daemon_that_crashed_gets_the_leases_of_batches_finished_just_before_finished_again(
        tmp_path, driver_restarts):
    """LFINs since the daemon's last checkpoint are lost with a crash: the leases came back, in
    flight for nobody, and their messages were delivered again (attempts 2) once they expired.
    The driver finishes them again on its next connection; a driver restarted from the query's
    checkpoint (killed with the daemon, it never knew them) at its first acknowledgement."""
    durable = RestartableDaemon(tmp_path / "nsqd", "--durable", "--sync-timeout=3s")
    try:
        addr = address(durable)
        opts = ReadOptions.parse({"nsqd.address": addr, "topic": "rf", "channel": "c", "maxInFlight": "40"})
        publish(addr, "rf", bodies(100))
        driver = LeaseDriver(opts, "run")
        try:  # a batch read and acknowledged after a checkpoint, then a crash at once
            assert driver.new_data(1) and sorted(batch_bodies(opts, 1)) == bodies(100)
            time.sleep(3.5)  # past a checkpoint: the leases are on disk
            driver.acknowledge(1)
            durable.stop(signal.SIGKILL)  # before the next one: the LFINs are not
            if driver_restarts:
                driver.close()
                driver = LeaseDriver(opts, "run")  # the query restarted from its checkpoint: batch 1 committed
            durable.start()
            assert durable.channel_stats("rf", "c")["in_flight_count"] == 100  # the leases came back
            publish(addr, "rf", [b"next"])
            assert wait_for(lambda: driver.new_data(2), 10, 0.1)
            assert batch_bodies(opts, 2) == [b"next"]
            driver.acknowledge(2)  # batch 1 is finished again first
        finally:
            driver.close()
        stats = durable.channel_stats("rf", "c")
        assert (stats["in_flight_count"], stats["depth"]) == (0, 0)
    finally:
        durable.stop(signal.SIGKILL)


def test_the_driver_waits_for_a_daemon_that_is_away(restartable):
    addr = address(restartable)
    opts = ReadOptions.parse({"nsqd.address": addr, "topic": "r4", "channel": "c", "reconnectTimeout": "30s"})
    publish(addr, "r4", bodies(10))
    driver = LeaseDriver(opts, "run")
    try:
        assert wait_for(lambda: driver.new_data(1), 5, 0.01)
        assert len([b for p in partitions_for(opts, "run", 1, replay=False) for b in read_partition(opts, p)][0]) == 10
        restartable.stop(signal.SIGKILL)
        started = time.monotonic()
        assert not driver.new_data(2) and time.monotonic() - started < 1  # no data while away, at once
        acked = threading.Thread(target=driver.acknowledge, args=(1,), daemon=True)
        acked.start()
        time.sleep(1)
        assert acked.is_alive()  # commit() does not return before the leases are settled
        restartable.start()
        acked.join(10)
        assert not acked.is_alive()
        with lease_consumer(addr, "r4", "c", 60000):
            publish(addr, "r4", [b"after"])
        assert wait_for(lambda: driver.new_data(2), 10, 0.1)
    finally:
        driver.close()


def test_the_driver_gives_up_after_the_reconnect_timeout(restartable):
    addr = address(restartable)
    opts = ReadOptions.parse({"nsqd.address": addr, "topic": "r5", "channel": "c", "reconnectTimeout": "1s"})
    driver = LeaseDriver(opts, "run")
    try:
        assert not driver.new_data(1)
        restartable.stop(signal.SIGKILL)
        with pytest.raises(ConnectionLost, match="gave up after 1 s"):
            wait_for(lambda: driver.new_data(1), 5, 0.05)
    finally:
        driver.close()


def test_the_sink_publishes_through_a_graceful_restart(restartable):
    addr = address(restartable)
    consume(addr, "r6", "check", idle=0.1)
    opts = WriteOptions.parse({"nsqd.address": addr, "topic": "r6", "reconnectTimeout": "30s"})
    publisher = Publisher(opts, addr, {"body": "body"}, 0)
    sent = [bodies(500, b"%03d-" % i) for i in range(40)]

    def run():
        for chunk in sent:
            publisher.publish(pa.record_batch([pa.array(chunk, pa.binary())], names=["body"]))
            time.sleep(0.02)
        publisher.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.3)
    restartable.restart(signal.SIGTERM, pause=0.5)
    thread.join(60)
    assert not thread.is_alive()
    got = sorted(b for _, _, b in consume(addr, "r6", "check", idle=0.5))
    assert got == sorted(b for chunk in sent for b in chunk)  # declined batches were published again, once



@pytest.mark.parametrize("body_type", [pa.binary(), pa.string()])
def test_the_sink_refuses_a_batch_with_an_empty_body_before_publishing_any_of_it(daemon, body_type):
    """nsqd refuses an empty body; the daemon's error (E_BAD_MESSAGE ... invalid message(424) body
    size 0) came after the rows before it were published, and named no row."""
    addr = address(daemon)
    consume(addr, "r7", "check", idle=0.1)
    opts = WriteOptions.parse({"nsqd.address": addr, "topic": "r7"})
    publisher = Publisher(opts, addr, {"body": "body"}, 3)
    rows = ["x%d" % i for i in range(3000)]
    rows[2500] = ""
    if body_type == pa.binary():
        rows = [r.encode() for r in rows]
    with pytest.raises(ValueError, match="row 2500 of partition 3 has an empty body"):
        publisher.publish(pa.record_batch([pa.array(rows, body_type)], names=["body"]))
    publisher.close()
    assert consume(addr, "r7", "check", idle=0.3) == []


def test_the_sink_says_the_daemon_kept_declining_not_that_it_was_away():
    from nsq_spark.client import Backoff, Declined

    backoff = Backoff(0.0)
    with pytest.raises(ConnectionLost, match=r"reconnectTimeout\) nsqd kept declining: nsqd h:1: E_MPUB_FAILED"):
        backoff.failed(Declined("nsqd h:1: E_MPUB_FAILED MPUB failed cannot store: No space left on device"))
    with pytest.raises(ConnectionLost, match=r"reconnectTimeout\) without nsqd: refused"):
        Backoff(0.0).failed(ConnectionLost("refused"))

def test_message_runs_are_taken_around_heartbeats_and_close_wait():
    def message(i):
        data = struct.pack(">qH", 1_700_000_000_000_000_000 + i, 1) + b"%016d" % i + b"body%d" % i
        return struct.pack(">ii", len(data) + 4, 2) + data

    def response(data):
        return struct.pack(">ii", len(data) + 4, 0) + data

    with socket.create_server(("127.0.0.1", 0)) as server:
        conn = Connection(f"127.0.0.1:{server.getsockname()[1]}")
        peer, _ = server.accept()
        stream = b"".join([message(0), message(1), response(b"_heartbeat_"), message(2), message(3),
                           response(b"CLOSE_WAIT"), message(4), message(5), response(b"OK")])
        peer.sendall(stream)
        while conn._end < len(stream):
            conn.fill(1)
        columns = Columns("t", "c")
        assert conn.take_messages(columns, 5) == 5  # the limit
        assert conn.take_messages(columns, 5) == 1 and conn.frame_waiting()
        assert conn.next_frame() == (0, b"OK")
        assert conn.closing
        assert columns.take().column("body").to_pylist() == [b"body%d" % i for i in range(6)]
        peer.settimeout(1)
        assert peer.recv(100) == b"  V2NOP\n"  # the heartbeat was answered
        peer.close()
        conn.close()
