"""The sink: every partition publishes its rows over a connection of its own.

Rows become ``MPUB`` batches of consecutive rows with the same topic (``DPUB``
for a row with a positive ``deferMs``); a few batches are sent before their
``OK``s are read. Any error response fails the task, so Spark runs it again:
a retried task publishes all its rows again, which makes the sink
at-least-once.
"""

from __future__ import annotations

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, IntegerType, LongType, ShortType, StringType, StructType

from .client import Connection, body_command, mpub_body
from .options import OptionError, WriteOptions

#: bytes of one MPUB's body (nsqd's --max-body-size is 5 MiB by default)
MPUB_BYTES = 1 << 20
#: commands sent before their answers are read
PIPELINE = 4

_COLUMN_TYPES = {
    "body": (BinaryType, StringType),
    "topic": (StringType,),
    "deferMs": (IntegerType, LongType, ShortType),
}


def check_columns(schema: StructType, opts: WriteOptions) -> dict[str, str]:
    """The sink's columns by their canonical name; a missing body or a stray column is an error."""
    names = {}
    canonical = {name.lower(): name for name in _COLUMN_TYPES}
    for field in schema.fields:
        name = canonical.get(field.name.lower())
        if name is None:
            raise OptionError(f"the nsq sink takes columns body, topic and deferMs; got column {field.name!r}")
        if not isinstance(field.dataType, _COLUMN_TYPES[name]):
            kinds = " or ".join(t.typeName() for t in _COLUMN_TYPES[name])
            raise OptionError(f"column {field.name!r} must be {kinds}, not {field.dataType.simpleString()}")
        names[name] = field.name
    if "body" not in names:
        raise OptionError("the nsq sink needs a 'body' column (binary or string)")
    if "topic" not in names and opts.topic is None:
        raise OptionError("the nsq sink needs option 'topic' or a 'topic' column")
    return names


class Published(WriterCommitMessage):
    def __init__(self, count: int) -> None:
        self.count = count


class Publisher:
    """One connection publishing record batches; raises on any error response."""

    def __init__(self, address: str, topic: str | None, columns: dict[str, str]) -> None:
        self.topic = topic
        self.columns = columns
        self.conn = Connection(address)
        self.conn.identify(heartbeat_interval=-1)  # a slow upstream must not get us disconnected
        self.unanswered = 0
        self.count = 0

    def publish(self, batch: pa.RecordBatch) -> None:
        bodies = batch.column(self.columns["body"]).to_pylist()
        topics = batch.column(self.columns["topic"]).to_pylist() if "topic" in self.columns else None
        delays = batch.column(self.columns["deferMs"]).to_pylist() if "deferMs" in self.columns else None
        run: list[bytes] = []
        run_topic = None
        size = 0
        for i, body in enumerate(bodies):
            if body is None:
                raise ValueError("the nsq sink cannot publish a row whose body is null")
            if isinstance(body, str):
                body = body.encode()
            topic = (topics[i] if topics is not None else None) or self.topic
            if topic is None:
                raise ValueError("row has a null topic and the sink has no 'topic' option")
            delay = delays[i] if delays is not None else None
            if delay and delay > 0:
                self._send(body_command(f"DPUB {topic} {delay}", body))
                continue
            if run and (topic != run_topic or size + 4 + len(body) > MPUB_BYTES):
                self._send(body_command(f"MPUB {run_topic}", mpub_body(run)))
                run, size = [], 0
            run.append(body)
            run_topic = topic
            size += 4 + len(body)
        if run:
            self._send(body_command(f"MPUB {run_topic}", mpub_body(run)))
        self.count += len(bodies)

    def close(self) -> None:
        """Wait for every answer, then close."""
        try:
            self._answers(0)
        finally:
            self.conn.close()

    def _send(self, command: bytes) -> None:
        self._answers(PIPELINE - 1)
        self.conn.send(command)
        self.unanswered += 1

    def _answers(self, keep: int) -> None:
        while self.unanswered > keep:
            self.conn.expect_ok()
            self.unanswered -= 1


def _publish_partition(opts: WriteOptions, columns: dict[str, str], batches) -> Published:
    context = TaskContext.get()
    index = context.partitionId() if context is not None else 0
    publisher = Publisher(opts.addresses[index % len(opts.addresses)], opts.topic, columns)
    try:
        for batch in batches:
            publisher.publish(batch)
    except BaseException:
        publisher.conn.close()
        raise
    publisher.close()
    return Published(publisher.count)


class NSQWriter(DataSourceArrowWriter):
    def __init__(self, opts: WriteOptions, columns: dict[str, str]) -> None:
        self.opts = opts
        self.columns = columns

    def write(self, iterator) -> Published:
        return _publish_partition(self.opts, self.columns, iterator)


class NSQStreamWriter(DataSourceStreamArrowWriter):
    """Publishing is done when a task ends; there is nothing to commit or undo afterwards."""

    def __init__(self, opts: WriteOptions, columns: dict[str, str]) -> None:
        self.opts = opts
        self.columns = columns

    def write(self, iterator) -> Published:
        return _publish_partition(self.opts, self.columns, iterator)

    def commit(self, messages, batchId) -> None:
        return None

    def abort(self, messages, batchId) -> None:
        return None
