"""The batch source: a one-off job drains what a channel holds now, up to a limit.

Each partition reads as the first read of a micro-batch does (stopping at its
share of ``maxMessagesPerTrigger``, at ``maxTriggerDelay``, or when nothing
more arrives) and finishes its leases once Spark has taken every row. A task
that fails before that leaves its leases to expire, and their messages are
delivered again; a retried task reopens them and reads the same messages.
"""

from __future__ import annotations

import uuid

from pyspark.sql.datasource import DataSourceReader

from .leases import Subscription
from .options import ReadOptions
from .stream import LeasePartition, partitions_for, read_partition


class NSQBatchReader(DataSourceReader):
    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts

    def partitions(self) -> list[LeasePartition]:
        """The partitions, once every daemon has been asked whether it takes our options."""
        for address in self.opts.addresses:
            link = Subscription(self.opts, address)
            link.connect()
            link.close()
        return partitions_for(self.opts, uuid.uuid4().hex, 0, replay=False)

    def read(self, partition: LeasePartition):
        return read_partition(self.opts, partition, finish=True)
