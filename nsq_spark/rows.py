"""The source's schema, and NSQ message frames turned into Arrow record batches.

Reads hand Spark Arrow batches rather than tuples: Spark then skips its
per-row conversion, which is most of the cost of a Python source.
"""

from __future__ import annotations

import struct

import pyarrow as pa
from pyspark.sql.types import BinaryType, IntegerType, StringType, StructField, StructType, TimestampType

SCHEMA = StructType([
    StructField("id", StringType()),
    StructField("body", BinaryType()),
    StructField("timestamp", TimestampType()),
    StructField("attempts", IntegerType()),
    StructField("topic", StringType()),
    StructField("channel", StringType()),
])

#: what Spark expects for SCHEMA (timestamps travel as UTC microseconds)
ARROW_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("body", pa.binary()),
    ("timestamp", pa.timestamp("us", tz="UTC")),
    ("attempts", pa.int32()),
    ("topic", pa.string()),
    ("channel", pa.string()),
])

_TS_ATTEMPTS = struct.Struct(">qH")


class Columns:
    """Message fields gathered column by column until they make a record batch."""

    __slots__ = ("topic", "channel", "ids", "bodies", "stamps", "attempts")

    def __init__(self, topic: str, channel: str) -> None:
        self.topic = topic
        self.channel = channel
        self.ids: list[bytes] = []
        self.bodies: list[bytes] = []
        self.stamps: list[int] = []
        self.attempts: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, data: bytes) -> None:
        """One message frame's data: ``ts(8) | attempts(2) | id(16) | body``."""
        ts, attempts = _TS_ATTEMPTS.unpack_from(data)
        self.stamps.append(ts // 1000)
        self.attempts.append(attempts)
        self.ids.append(data[10:26])
        self.bodies.append(data[26:])

    def take(self) -> pa.RecordBatch:
        """The gathered messages as one batch; the columns start empty again."""
        n = len(self.ids)
        batch = pa.RecordBatch.from_arrays([
            pa.array(self.ids, pa.binary()).cast(pa.string()),
            pa.array(self.bodies, pa.binary()),
            pa.array(self.stamps, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            pa.array(self.attempts, pa.int32()),
            pa.array([self.topic] * n, pa.string()),
            pa.array([self.channel] * n, pa.string()),
        ], schema=ARROW_SCHEMA)
        self.ids, self.bodies, self.stamps, self.attempts = [], [], [], []
        return batch
