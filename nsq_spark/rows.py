"""The source's schema, and NSQ message frames turned into Arrow record batches.

Reads hand Spark Arrow batches rather than tuples: Spark then skips its
per-row conversion, which is most of the cost of a Python source. The frames
are not decoded one by one either: the connection hands over runs of raw
message frames with where each starts, and :meth:`Columns.take` cuts the
columns out of those bytes with numpy and Arrow, so the only per-message work
in Python is finding where each frame starts.
"""

from __future__ import annotations

import struct

import numpy as np
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

#: the fixed head of a message frame; the body follows it
_HEAD = np.dtype([("size", ">i4"), ("type", ">i4"), ("ts", ">i8"), ("attempts", ">u2"), ("id", "S16")])
_FRAME = struct.Struct(">ii")
_MESSAGE = 2


def _offsets(n: int, width: int) -> pa.Buffer:
    return pa.py_buffer(np.arange(0, (n + 1) * width, width, dtype=np.int32))


class Columns:
    """Raw message frames gathered until they make a record batch.

    ``add_run`` takes bytes holding message frames back to back and where each
    starts; the bytes are kept as they are until :meth:`take`.
    """

    __slots__ = ("topic", "channel", "nbytes", "_pieces", "_starts", "_count")

    def __init__(self, topic: str, channel: str) -> None:
        self.topic = topic
        self.channel = channel
        #: bytes of frames gathered
        self.nbytes = 0
        self._pieces: list[bytes | memoryview] = []
        self._starts: list[np.ndarray] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add_run(self, data: bytes | memoryview, starts: np.ndarray, base: int) -> None:
        """Frames in ``data`` (kept, not copied): the first at ``starts[0] - base``, each ends where the next starts."""
        positions = starts + (self.nbytes - base)
        self._pieces.append(data)
        self._starts.append(positions)
        self.nbytes += len(data)
        self._count += len(starts)

    def add_frame(self, data: bytes) -> None:
        """One message frame's data (timestamp, attempts, id, body), as :meth:`Connection.next_frame` gives it."""
        self.add_run(_FRAME.pack(len(data) + 4, _MESSAGE) + data, np.zeros(1, dtype=np.int64), 0)

    def ids(self) -> list[bytes]:
        """The ids of the gathered messages, in order."""
        data = b"".join(self._pieces)
        return [data[p + 18:p + 34] for starts in self._starts for p in starts.tolist()]

    def take(self) -> pa.RecordBatch:
        """The gathered messages as one batch; the columns start empty again."""
        n = self._count
        data = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
        starts = self._starts[0] if len(self._starts) == 1 else np.concatenate(self._starts)
        self._pieces, self._starts, self._count, self.nbytes = [], [], 0, 0
        # every frame as two binary values, its head and its body: taking every second one
        # gathers the heads (then read as a numpy record array) and the bodies
        bounds = np.empty(2 * n + 1, dtype=np.int32)
        bounds[0:-1:2] = starts
        bounds[1::2] = starts + _HEAD.itemsize
        bounds[-1] = len(data)
        parts = pa.Array.from_buffers(pa.binary(), 2 * n, [None, pa.py_buffer(bounds), pa.py_buffer(data)])
        heads = parts.take(pa.array(np.arange(0, 2 * n, 2)))
        head = np.frombuffer(heads.buffers()[2], _HEAD, count=n)
        stamps = head["ts"] // 1000
        ids = pa.py_buffer(np.ascontiguousarray(head["id"]))
        return pa.RecordBatch.from_arrays([
            pa.Array.from_buffers(pa.string(), n, [None, _offsets(n, 16), ids]),
            parts.take(pa.array(np.arange(1, 2 * n, 2))),
            pa.Array.from_buffers(ARROW_SCHEMA.field("timestamp").type, n, [None, pa.py_buffer(stamps)]),
            pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(head["attempts"].astype(np.int32))]),
            pa.repeat(pa.scalar(self.topic, pa.string()), n),
            pa.repeat(pa.scalar(self.channel, pa.string()), n),
        ], schema=ARROW_SCHEMA)
