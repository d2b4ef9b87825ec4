"""The streaming source: offsets that name leases, and partitions that read under them.

An offset is ``{"run": <uuid>, "batch": n, ...}``: the run is fixed when a
query starts without a checkpoint and kept in every offset after, so the
leases of batch ``n`` are ``run:n:p`` whichever process plans or replays it.
The offset also names the daemons, topic, channel and partition count, so
that whoever learns that the batch was committed can finish its leases
(:mod:`nsq_spark.settle`).

Spark commits a batch by calling :meth:`commit` with its end when it plans
the next one, and calls :meth:`latestOffset` with the last committed end, so
both finish the leases of everything up to that end before returning. The
last batch of a query has no later call: ``Trigger.AvailableNow`` makes one
more :meth:`latestOffset` before it ends, and for any other trigger the
listener that :func:`nsq_spark.register` installs finishes it when the query
ends (and the next run's first :meth:`latestOffset` does, in any case).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

from .client import retrying
from .driver import LeaseDriver
from .leases import LeaseReader, Subscription, lease_base, lease_reply
from .options import ReadOptions
from .rows import Columns


@dataclass(frozen=True)
class LeasePartition(InputPartition):
    """What one task reads: partition ``index`` under lease ``lease`` on ``address``."""

    index: int
    address: str
    lease: str
    #: a replay reads only the leases that exist; a first read also reads new messages
    replay: bool


def partitions_for(opts: ReadOptions, run: str, batch: int, replay: bool) -> list[LeasePartition]:
    return [LeasePartition(p, opts.addresses[p % len(opts.addresses)], lease_base(run, batch, p), replay)
            for p in range(opts.num_partitions)]


def make_offset(opts: ReadOptions, run: str, batch: int) -> dict:
    return {"run": run, "batch": batch, "nsqd": ",".join(opts.addresses), "topic": opts.topic,
            "channel": opts.channel, "partitions": opts.num_partitions}


def read_partition(opts: ReadOptions, partition: LeasePartition, finish: bool = False):
    """A partition's messages as Arrow batches.

    With ``finish`` the leases are finished once the last batch has been taken
    (a batch read: nothing else will acknowledge them).
    """
    link = Subscription(opts, partition.address)
    try:
        reader = LeaseReader(
            link, partition.lease, Columns(opts.topic, opts.channel), replay=partition.replay,
            max_in_flight=opts.max_in_flight, max_messages=opts.share(opts.max_messages, partition.index),
            min_messages=opts.share(opts.min_messages, partition.index), max_delay=opts.max_delay)
        yield from reader.batches()
        if finish and reader.segments:
            retrying(link.backoff, lambda: _finish(link.connect(), list(reader.segments)), on_lost=link.close)
    finally:
        link.close()


def _finish(conn, names: list[str]) -> None:
    conn.send("".join(f"LFIN {name}\n" for name in names).encode())
    for _ in names:
        lease_reply(conn)


class NSQStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self._initial = make_offset(opts, uuid.uuid4().hex, 0)
        self._driver: LeaseDriver | None = None
        self._cutoff_ns: int | None = None

    def __getstate__(self) -> dict:
        """Executors get the options only; the driver's connections stay on the driver."""
        return {**self.__dict__, "_driver": None}

    def initialOffset(self) -> dict:
        return self._initial

    def latestOffset(self, start: dict, limit) -> dict:
        """The next batch if a probe found a message, else ``start`` (no batch)."""
        driver = self._driver_for(start["run"])
        driver.acknowledge(start["batch"])
        batch = start["batch"] + 1
        if driver.new_data(batch, self._cutoff_ns):
            return make_offset(self.opts, start["run"], batch)
        return start

    def partitions(self, start: dict, end: dict) -> list[LeasePartition]:
        if start == end:
            return []
        driver = self._driver_for(end["run"])
        if start["run"] == end["run"]:
            driver.acknowledge(start["batch"])
        driver.hold(end["batch"])
        return partitions_for(self.opts, end["run"], end["batch"], replay=not driver.is_fresh(end["batch"]))

    def read(self, partition: LeasePartition):
        return read_partition(self.opts, partition)

    def commit(self, end: dict) -> None:
        """Spark committed every batch up to ``end``: their leases are finished before this returns."""
        self._driver_for(end["run"]).acknowledge(end["batch"])

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: batches go on until no message published before now is left."""
        self._cutoff_ns = time.time_ns()

    def stop(self) -> None:
        if self._driver is not None:
            self._driver.close()
            self._driver = None

    def _driver_for(self, run: str) -> LeaseDriver:
        if self._driver is None or self._driver.run != run:
            self.stop()
            self._driver = LeaseDriver(self.opts, run)
        return self._driver
