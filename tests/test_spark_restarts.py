"""A streaming query across daemon restarts, in real PySpark against a daemon that is stopped and started again.

A publisher sends numbered messages at a steady pace (through the sink's
publisher, which publishes again what a restarting daemon declined) while a
query copies the topic into Parquet. The daemon is restarted in the middle;
the query must keep running, and the Parquet output is compared with what
was published.
"""

from __future__ import annotations

import signal
import threading
import time

import pyarrow as pa
import pytest

from nsq_spark.options import WriteOptions
from nsq_spark.sink import Publisher

from .test_spark_support import RestartableDaemon, address, committed_rows, spark, wait_for  # noqa: F401

pytestmark = pytest.mark.slow


class SteadyPublisher:
    """Publishes ``b"%08d" % n`` for n in ``range(start, stop)``, ``chunk`` at a time every ``pause`` s."""

    def __init__(self, addr: str, topic: str, start: int, stop: int, chunk: int = 200, pause: float = 0.05):
        opts = WriteOptions.parse({"nsqd.address": addr, "topic": topic, "reconnectTimeout": "60s"})
        self.publisher = Publisher(opts, addr, {"body": "body"}, 0)
        self.numbers = range(start, stop)
        self.chunk, self.pause = chunk, pause
        self.running = threading.Event()
        self.running.set()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for i in range(0, len(self.numbers), self.chunk):
            self.running.wait()
            bodies = [b"%08d" % n for n in self.numbers[i:i + self.chunk]]
            self.publisher.publish(pa.record_batch([pa.array(bodies, pa.binary())], names=["body"]))
            self.publisher.flush()
            self.sent += len(bodies)
            time.sleep(self.pause)
        self.publisher.close()

    def join(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive()


def start_query(spark, addr, topic, tmp_path, **options):
    reader = (spark.readStream.format("nsq").option("nsqd.address", addr).option("topic", topic)
              .option("channel", "spark").option("numPartitions", 2).option("maxTriggerDelay", "500ms")
              .option("reconnectTimeout", "60s"))
    for key, value in options.items():
        reader = reader.option(key, value)
    return (reader.load()
            .writeStream.format("parquet").option("path", str(tmp_path / "out"))
            .option("checkpointLocation", str(tmp_path / "ck")).start())


def numbers_written(spark, tmp_path) -> list[int]:
    return [int(r.body) for r in spark.read.parquet(str(tmp_path / "out")).select("body").collect()]


def test_a_graceful_restart_of_the_daemon_loses_and_repeats_nothing(spark, tmp_path):
    daemon = RestartableDaemon(tmp_path / "nsqd", "--shutdown-grace=10s")
    addr = address(daemon)
    total = 8000
    publisher = SteadyPublisher(addr, "g1", 0, total)
    query = start_query(spark, addr, "g1", tmp_path)
    try:
        assert wait_for(lambda: committed_rows(tmp_path / "out") >= 1500, 90, 0.1)
        daemon.restart(signal.SIGTERM)  # the batch being read ends at CLOSE_WAIT and is finished in the drain
        publisher.join()
        assert wait_for(lambda: committed_rows(tmp_path / "out") >= total, 120, 0.2), committed_rows(tmp_path / "out")
        time.sleep(1)  # a duplicate would come within the next batches
        assert query.isActive and query.exception() is None
    finally:
        query.stop()
        spark._nsq_settler.wait(10)  # the last batch is finished before the daemon goes
        daemon.stop(signal.SIGKILL)
    numbers = numbers_written(spark, tmp_path)
    assert len(numbers) == total and sorted(numbers) == list(range(total))


def test_a_daemon_crash_loses_only_what_the_daemon_held_in_memory(spark, tmp_path):
    daemon = RestartableDaemon(tmp_path / "nsqd")  # Go-style: queues in memory, nothing fsynced
    addr = address(daemon)
    before, total = 6000, 9000
    publisher = SteadyPublisher(addr, "k1", 0, before)
    query = start_query(spark, addr, "k1", tmp_path, maxMessagesPerTrigger=1000)  # a backlog stays queued
    try:
        assert wait_for(lambda: committed_rows(tmp_path / "out") >= 1500, 90, 0.1)
        publisher.running.clear()
        time.sleep(0.2)
        stats = daemon.channel_stats("k1", "spark")
        held = stats["depth"] + stats["in_flight_count"]  # what a crash can take with it now
        assert held > 0
        published = publisher.sent
        daemon.restart(signal.SIGKILL)
        publisher.running.set()
        publisher.join()
        after = SteadyPublisher(addr, "k1", before, total)
        after.join()
        assert wait_for(lambda: set(range(before, total)) <= set(numbers_written(spark, tmp_path)), 120, 1)
        assert query.isActive and query.exception() is None
    finally:
        query.stop()
        spark._nsq_settler.wait(10)  # the last batch is finished before the daemon goes
        daemon.stop(signal.SIGKILL)
    numbers = numbers_written(spark, tmp_path)
    assert len(numbers) == len(set(numbers))  # nothing came back from disk: nothing twice
    missing = set(range(published)) - set(numbers)
    assert len(missing) <= held, (len(missing), held)
    assert set(range(published, total)) <= set(numbers)  # published after the snapshot: all there
