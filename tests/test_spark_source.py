"""The nsq streaming and batch source, in real PySpark (local mode) against the real daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .test_spark_support import (REPO, address, committed_rows, consume, daemon, json_bodies, publish,  # noqa: F401
                                 spark, wait_for)

pytestmark = pytest.mark.slow


def stream_to_parquet(spark, addr, topic, out, checkpoint, **options):
    reader = spark.readStream.format("nsq").option("nsqd.address", addr).option("topic", topic) \
        .option("channel", "spark")
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load().writeStream.format("parquet").option("path", str(out)) \
        .option("checkpointLocation", str(checkpoint)).start()


def committed(spark, out):
    rows = spark.read.parquet(str(out)).select("id", "attempts", "body").collect()
    return [r.id for r in rows], rows


def test_stream_of_n_messages_ends_in_parquet_with_n_distinct_ids(spark, daemon, tmp_path):
    addr = address(daemon)
    publish(addr, "s1", json_bodies(0, 3000))
    query = stream_to_parquet(spark, addr, "s1", tmp_path / "out", tmp_path / "ck",
                              numPartitions=2, maxMessagesPerTrigger=1000, maxInFlight=300)
    try:
        assert wait_for(lambda: committed_rows(tmp_path / "out") >= 3000, 90)
        publish(addr, "s1", json_bodies(3000, 3500))  # while the query runs
        assert wait_for(lambda: committed_rows(tmp_path / "out") >= 3500, 60)
    finally:
        query.stop()
    ids, rows = committed(spark, tmp_path / "out")
    assert len(ids) == len(set(ids)) == 3500
    assert sorted(json.loads(r.body)["i"] for r in rows) == list(range(3500))
    assert {r.attempts for r in rows} == {1}
    assert consume(addr, "s1", "spark", idle=0.5) == []  # nothing left over, nothing redelivered


def test_graceful_stop_and_restart_from_checkpoint_has_no_duplicates(spark, daemon, tmp_path):
    addr = address(daemon)
    out, ck = tmp_path / "out", tmp_path / "ck"
    publish(addr, "s2", json_bodies(0, 1500))
    query = stream_to_parquet(spark, addr, "s2", out, ck, numPartitions=2, maxMessagesPerTrigger=500)
    assert wait_for(lambda: committed_rows(out) >= 1500, 90)
    query.stop()  # the last batch's commit never comes: the next run acknowledges it
    publish(addr, "s2", json_bodies(1500, 2000))
    query = stream_to_parquet(spark, addr, "s2", out, ck, numPartitions=2, maxMessagesPerTrigger=500)
    try:
        assert wait_for(lambda: committed_rows(out) >= 2000, 90)
        time.sleep(1)  # a duplicate would show up within the next batches
    finally:
        query.stop()
    ids, rows = committed(spark, out)
    assert len(ids) == len(set(ids)) == 2000
    assert {r.attempts for r in rows} == {1}


def test_available_now_reads_the_backlog_and_finishes_its_last_batch(spark, daemon, tmp_path):
    addr = address(daemon)
    publish(addr, "s5", json_bodies(0, 1000))
    reader = spark.readStream.format("nsq").option("nsqd.address", addr).option("topic", "s5") \
        .option("channel", "spark").option("numPartitions", 2).option("maxMessagesPerTrigger", 400) \
        .option("msgTimeoutMs", 2000)
    query = reader.load().writeStream.format("parquet").option("path", str(tmp_path / "out")) \
        .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start()
    assert query.awaitTermination(90)
    ids, _ = committed(spark, tmp_path / "out")
    assert len(ids) == len(set(ids)) == 1000
    time.sleep(2.5)  # an unfinished lease would have expired by now, and its messages would come again
    publish(addr, "s5", [b"after"])
    assert [body for _, _, body in consume(addr, "s5", "spark", idle=0.5)] == [b"after"]


def test_the_message_a_probe_took_when_the_query_ended_goes_to_the_next_run(spark, daemon, tmp_path):
    addr = address(daemon)
    publish(addr, "s7", json_bodies(0, 10))

    def run():
        query = spark.readStream.format("nsq").option("nsqd.address", addr).option("topic", "s7") \
            .option("channel", "spark").option("maxMessagesPerTrigger", 10).load() \
            .writeStream.format("parquet").option("path", str(tmp_path / "out")) \
            .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start()
        return query

    query = run()
    assert wait_for(lambda: (tmp_path / "ck" / "offsets" / "0").exists(), 60, 0.02)
    publish(addr, "s7", [b"late"])  # after the query started: the probe takes it, and it ends the query
    assert query.awaitTermination(60)
    assert len(committed(spark, tmp_path / "out")[0]) == 10
    assert run().awaitTermination(60)  # the next run takes the probe's lease over
    _, rows = committed(spark, tmp_path / "out")
    assert b"late" in {r.body for r in rows} and len(rows) == 11
    assert {r.attempts for r in rows} == {1}  # not delivered again: no attempt counted


def run_child(addr, topic, out, checkpoint, expect, options, stall="", marker=""):
    """The query in a child process (and its JVM in the same process group, so a kill takes both)."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "test_spark_support.py"), "--address", addr, "--topic", topic,
         "--channel", "spark", "--out", str(out), "--checkpoint", str(checkpoint), "--expect", str(expect),
         "--options", json.dumps(options), "--stall", stall, "--marker", str(marker)],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kill_mid_batch(addr, topic, tmp_path, total, options):
    """Start the query, let it hang inside a batch on a marked message, SIGKILL its process group."""
    bodies = json_bodies(0, total)
    stall = bodies[total * 2 // 3].decode()
    publish(addr, topic, bodies)
    marker = tmp_path / "stalled"
    child = run_child(addr, topic, tmp_path / "out", tmp_path / "ck", total, options, stall, marker)
    try:
        assert wait_for(lambda: marker.exists() or child.poll() is not None, 120, 0.1) and marker.exists(), \
            child.stderr.read().decode()[-3000:]
        offsets = {p.name for p in (tmp_path / "ck" / "offsets").iterdir() if p.name.isdigit()}
        commits = {p.name for p in (tmp_path / "ck" / "commits").iterdir() if p.name.isdigit()}
        assert offsets - commits, "the kill must come in the middle of a batch"
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    return offsets - commits


def restart(spark, addr, topic, tmp_path, total, options):
    """The killed query's checkpoint, run on in this process until ``total`` rows are committed."""
    query = stream_to_parquet(spark, addr, topic, tmp_path / "out", tmp_path / "ck", **options)
    try:
        assert wait_for(lambda: committed_rows(tmp_path / "out") >= total, 120, 0.1)
    finally:
        query.stop()
        spark._nsq_settler.wait(10)


def test_sigkill_mid_batch_then_restart_within_the_lease_timeout_is_exactly_once(spark, daemon, tmp_path):
    addr = address(daemon)
    options = {"numPartitions": 2, "maxMessagesPerTrigger": 600, "maxInFlight": 200, "msgTimeoutMs": 60000}
    kill_mid_batch(addr, "s3", tmp_path, 3000, options)
    restart(spark, addr, "s3", tmp_path, 3000, options)
    ids, rows = committed(spark, tmp_path / "out")
    assert len(ids) == len(set(ids)) == 3000  # the interrupted batch was replayed with the same messages
    assert {r.attempts for r in rows} == {1}  # and nothing was redelivered by a timeout
    assert consume(addr, "s3", "spark", idle=0.5) == []


def test_sigkill_then_restart_past_the_lease_timeout_loses_nothing(spark, daemon, tmp_path):
    addr = address(daemon)
    options = {"numPartitions": 2, "maxMessagesPerTrigger": 600, "maxInFlight": 200, "msgTimeoutMs": 1000}
    kill_mid_batch(addr, "s4", tmp_path, 2000, options)
    time.sleep(2.5)  # the batch's leases expire: their messages are queued again
    # run on with leases the batches cannot outlive: with 1 s ones, a batch that a loaded machine
    # held past its lease (touches late) left copies queued again behind the query (at least once)
    restart(spark, addr, "s4", tmp_path, 2000, {**options, "msgTimeoutMs": 60000})
    ids, rows = committed(spark, tmp_path / "out")
    assert set(ids) == {r.id for r in rows} and len(set(ids)) == 2000  # duplicates are allowed, loss is not
    assert max(r.attempts for r in rows) >= 2
    assert consume(addr, "s4", "spark", idle=0.5) == []


def test_batch_read_drains_what_is_there_up_to_a_limit(spark, daemon):
    addr = address(daemon)
    publish(addr, "b1", json_bodies(0, 1200))

    def read(**options):
        reader = spark.read.format("nsq").option("nsqd.address", addr).option("topic", "b1") \
            .option("channel", "batch").option("numPartitions", "2")
        for key, value in options.items():
            reader = reader.option(key, str(value))
        return reader.load()

    first = read(maxMessagesPerTrigger=1000, maxInFlight=300).select("id", "body", "topic", "channel").collect()
    assert len(first) == 1000 and {(r.topic, r.channel) for r in first} == {("b1", "batch")}
    rest = read().collect()
    assert len(rest) == 200
    assert sorted(json.loads(r.body)["i"] for r in first + rest) == list(range(1200))
    assert read().count() == 0


def test_trigger_once_runs_further_apart_than_the_lease_timeout_write_each_message_once(spark, daemon, tmp_path):
    addr = address(daemon)

    def run_once():
        query = spark.readStream.format("nsq").option("nsqd.address", addr).option("topic", "s6") \
            .option("channel", "spark").option("numPartitions", 2).option("msgTimeoutMs", 1000).load() \
            .writeStream.format("parquet").option("path", str(tmp_path / "out")) \
            .option("checkpointLocation", str(tmp_path / "ck")).trigger(once=True).start()
        assert query.awaitTermination(90) and query.exception() is None
        assert spark._nsq_settler.wait(10)  # what the interpreter's exit waits for

    publish(addr, "s6", json_bodies(0, 600))
    run_once()
    time.sleep(2.5)  # past the lease timeout: a batch not finished by now would be delivered again
    publish(addr, "s6", json_bodies(600, 900))
    run_once()
    ids, rows = committed(spark, tmp_path / "out")
    assert len(ids) == len(set(ids)) == 900
    assert {r.attempts for r in rows} == {1}
    time.sleep(2.5)
    assert consume(addr, "s6", "spark", idle=0.3) == []  # the second run's batch was finished too


@pytest.mark.parametrize("option, value, message", [
    ("maxMessagePerTrigger", "10", "unknown option 'maxmessagepertrigger'"),
    ("numPartitions", "zero", "option 'numPartitions' must be an integer"),
    ("maxTriggerDelay", "soon", "option 'maxTriggerDelay' must be a duration"),
    ("topic", "bad topic!", "option 'topic' is 'bad topic!', not a valid nsq topic name"),
    ("channel", "spark extra", "option 'channel' is 'spark extra', not a valid nsq channel name"),
    ("reconnectTimeout", "0s", "option 'reconnectTimeout' must be positive"),
    ("minMessagesPerTrigger", "1000", r"option 'minMessagesPerTrigger' \(1000\) must be at most 'maxMessagesPerTrigger' \(100\)"),
    ("maxInFlight", "5000", r"option 'maxInFlight' \(5000\) is above the --max-rdy-count of nsqd .* \(2500\)"),
    ("msgTimeoutMs", "3600000", r"option 'msgTimeoutMs' \(3600000\) is above the --max-msg-timeout"),
])
def test_bad_options_are_errors_naming_the_option_before_any_data(spark, daemon, option, value, message):
    reader = spark.readStream.format("nsq").option("nsqd.address", address(daemon)).option("topic", "x") \
        .option("channel", "c").option("maxMessagesPerTrigger", "100").option(option, value)
    with pytest.raises(Exception, match=message):  # the topic is empty: limits are checked at start
        reader.load().writeStream.format("console").start().awaitTermination(30)


def test_a_bad_streaming_option_is_refused_at_load_with_its_own_message(spark, daemon):
    """Raised from streamReader(), PySpark's runner showed an UnboundLocalError as the error."""
    reader = spark.readStream.format("nsq").option("nsqd.address", address(daemon)).option("topic", "x") \
        .option("channel", "c").option("maxMessagesPerTrigger", "0")
    with pytest.raises(Exception) as raised:
        reader.load()
    text = str(raised.value)
    assert "option 'maxMessagesPerTrigger' must be at least 1, got 0" in text
    assert "UnboundLocalError" not in text
