"""The sink: every partition publishes its rows over a connection of its own.

Rows become ``MPUB`` batches of consecutive rows with the same topic (``DPUB``
for a row with a positive ``deferMs``); a few batches are sent before their
``OK``s are read. Topic names are checked before a batch of rows is published,
so a bad name fails the task naming the row instead of reaching another topic
(``MPUB orders_us extra`` would publish to ``orders_us``).

When the daemon goes away (a restart: publishes are declined while it drains,
then the connection closes) the partition connects again with backoff and
publishes again what was declined or not answered; that may publish a batch
twice. Any other error response fails the task, so Spark runs it again: a
retried task publishes all its rows again. The sink is at-least-once.
"""

from __future__ import annotations

from collections import deque

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, IntegerType, LongType, ShortType, StringType, StructType

from .client import Backoff, Connection, ConnectionLost, Declined, body_command, mpub_body
from .options import NAME_RULE, OptionError, WriteOptions

#: bytes of one MPUB's body (nsqd's --max-body-size is 5 MiB by default)
MPUB_BYTES = 1 << 20
#: commands sent before their answers are read
PIPELINE = 4
#: nsqd's topic name rule (see options.is_valid_name), for a whole column at once
_TOPIC = r"^[.a-zA-Z0-9_-]+(#ephemeral)?$"

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
    """One connection publishing record batches of partition ``partition``; raises on an error response."""

    def __init__(self, opts: WriteOptions, address: str, columns: dict[str, str], partition: int) -> None:
        self.address = address
        self.topic = opts.topic
        self.columns = columns
        self.partition = partition
        self.backoff = Backoff(opts.reconnect_timeout)
        self.conn = self._connect()
        #: commands sent and not answered yet, oldest first (sent again after a reconnect)
        self.unanswered: deque[bytes] = deque()
        self.count = 0

    def _connect(self) -> Connection:
        while True:
            try:
                conn = Connection(self.address)
                try:
                    conn.identify(heartbeat_interval=-1)  # a slow upstream must not get us disconnected
                except BaseException:
                    conn.close()
                    raise
                return conn
            except ConnectionLost as exc:
                self.backoff.failed(exc)
                self.backoff.wait()

    def publish(self, batch: pa.RecordBatch) -> None:
        topics = self._check(batch)
        bodies = batch.column(self.columns["body"]).to_pylist()
        delays = batch.column(self.columns["deferMs"]).to_pylist() if "deferMs" in self.columns else None
        run: list[bytes] = []
        run_topic = None
        size = 0
        for i, body in enumerate(bodies):
            if isinstance(body, str):
                body = body.encode()
            topic = (topics[i] if topics is not None else None) or self.topic
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

    def _check(self, batch: pa.RecordBatch) -> list[str | None] | None:
        """The batch's topics (None without a topic column), once every row is known to be publishable."""
        bodies = batch.column(self.columns["body"])
        if bodies.null_count:
            self._bad_row(bodies.is_null(), "has a null body")
        sizes = pc.binary_length(bodies)
        if len(bodies) and pc.min(sizes).as_py() == 0:
            self._bad_row(pc.equal(sizes, 0), "has an empty body (nsqd refuses those)")
        if "topic" not in self.columns:
            return None
        topics = batch.column(self.columns["topic"])
        if topics.null_count and self.topic is None:
            self._bad_row(topics.is_null(), "has a null topic and the sink has no 'topic' option")
        valid = pc.and_(pc.match_substring_regex(topics, _TOPIC), pc.less_equal(pc.utf8_length(topics), 64))
        bad = pc.index(valid, False).as_py()
        if bad >= 0:
            raise ValueError(f"row {self.count + bad} of partition {self.partition} has topic "
                             f"{topics[bad].as_py()!r}, not a valid nsq topic name ({NAME_RULE})")
        return topics.to_pylist()

    def _bad_row(self, mask: pa.Array, what: str) -> None:
        raise ValueError(f"row {self.count + pc.index(mask, True).as_py()} of partition {self.partition} {what}")

    def flush(self) -> None:
        """Return once every command sent has been answered ``OK``."""
        self._answers(0)

    def close(self) -> None:
        """Wait for every answer, then close."""
        try:
            self.flush()
        finally:
            self.conn.close()

    def _send(self, command: bytes) -> None:
        self._answers(PIPELINE - 1)
        self.unanswered.append(command)
        try:
            self.conn.send(command)
        except ConnectionLost as exc:
            self._publish_again(exc)

    def _answers(self, keep: int) -> None:
        while len(self.unanswered) > keep:
            try:
                self.conn.expect_ok()
            except ConnectionLost as exc:
                self._publish_again(exc)
                continue
            self.unanswered.popleft()
            self.backoff.succeeded()

    def _publish_again(self, exc: ConnectionLost) -> None:
        """Send again, on a new connection, what was declined or never answered.

        A declined command leaves the connection open, and the commands after
        it are answered as usual; answers that arrived before the connection
        broke are read too. Only what got no ``OK`` is sent again.
        """
        again = []
        if isinstance(exc, Declined):
            again.append(self.unanswered.popleft())
        while self.unanswered:
            try:
                self.conn.expect_ok()
            except Declined:
                again.append(self.unanswered.popleft())
                continue
            except ConnectionLost as lost:
                exc = lost
                break
            self.unanswered.popleft()
        again.extend(self.unanswered)
        self.unanswered.clear()
        while True:
            self.conn.close()
            self.backoff.failed(exc)
            self.backoff.wait()
            self.conn = self._connect()
            try:
                for command in again:
                    self.conn.send(command)
            except ConnectionLost as lost:
                exc = lost
                continue
            self.unanswered.extend(again)
            return


def _publish_partition(opts: WriteOptions, columns: dict[str, str], batches) -> Published:
    context = TaskContext.get()
    index = context.partitionId() if context is not None else 0
    publisher = Publisher(opts, opts.addresses[index % len(opts.addresses)], columns, index)
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
