"""Finishing the last batch of a query that ends: the listener :func:`nsq_spark.register` installs.

Spark tells a source that a batch was committed only when it plans the next
one (``commit``, ``latestOffset``). A query that ends after a batch, as every
``Trigger.Once`` run does, never makes that call, and the leases of its last
batch would wait for the next run: if that comes later than ``msgTimeoutMs``
they have expired, their messages were delivered again, and the next run
writes them a second time.

Spark reports each batch it completed, after writing it to the commit log,
in a progress event. This listener keeps the offsets of the last one per
query and, when the query terminates, finishes those leases (the offsets name
the daemons, topic, channel and partitions). Events reach the listener a
little after the query ends, so at interpreter exit it waits, for at most
:data:`EXIT_WAIT` seconds, until every query that ended has been settled.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time

from pyspark.sql.streaming import StreamingQueryListener

from .client import Backoff, ConnectionLost, retrying
from .leases import lease_base, lease_consumer, settle

log = logging.getLogger("nsq_spark")

#: longest wait at exit for ended queries to be settled, and for one daemon to come back when settling
EXIT_WAIT = 10.0
_OFFSET_KEYS = {"run", "batch", "nsqd", "topic", "channel", "partitions"}


def finish_batch(offset: dict) -> int:
    """LFIN every lease of the batch ``offset`` ends; returns how many messages were finished."""
    addresses = offset["nsqd"].split(",")
    finished = 0
    for address in addresses:
        parts = [p for p in range(offset["partitions"]) if addresses[p % len(addresses)] == address]

        def lfin(address=address, parts=parts) -> int:
            with lease_consumer(address, offset["topic"], offset["channel"], 0) as conn:
                return sum(settle(conn, lease_base(offset["run"], offset["batch"], p), "LFIN") for p in parts)

        finished += retrying(Backoff(EXIT_WAIT, "nsq_spark.settle.EXIT_WAIT"), lfin)
    return finished


def _our_offsets(progress) -> list[dict]:
    offsets = []
    for source in progress.sources:
        try:
            offset = json.loads(source.endOffset or "null")
        except ValueError:
            continue
        if isinstance(offset, dict) and _OFFSET_KEYS <= offset.keys() and offset["batch"] > 0:
            offsets.append(offset)
    return offsets


class Settler(StreamingQueryListener):
    """Finishes the leases of the last committed batch of every nsq source when its query ends."""

    def __init__(self, spark) -> None:
        self.spark = spark
        self._last: dict[str, list[dict]] = {}
        self._running: set[str] = set()
        self._changed = threading.Condition()

    def onQueryStarted(self, event) -> None:
        with self._changed:
            self._running.add(str(event.runId))

    def onQueryProgress(self, event) -> None:
        offsets = _our_offsets(event.progress)
        if offsets:
            self._last[str(event.progress.runId)] = offsets

    def onQueryIdle(self, event) -> None:
        pass

    def onQueryTerminated(self, event) -> None:
        run_id = str(event.runId)
        try:
            for offset in self._last.pop(run_id, []):
                finish_batch(offset)
        except (ConnectionLost, OSError) as exc:  # the next run finishes it, within the lease timeout
            log.warning("could not finish the last batch's leases: %s", exc)
        finally:
            with self._changed:
                self._running.discard(run_id)
                self._changed.notify_all()

    def wait(self, timeout: float = EXIT_WAIT) -> bool:
        """Until every query that is not active any more has been settled; False on timeout."""
        try:
            active = {str(q.runId) for q in self.spark.streams.active}
        except Exception:  # the session is gone: every query has ended
            active = set()
        deadline = time.monotonic() + timeout
        with self._changed:
            return self._changed.wait_for(lambda: not self._running - active, max(deadline - time.monotonic(), 0))


def install(spark) -> Settler:
    """The session's settler, added as a streaming listener (and waited for at exit) the first time."""
    settler = getattr(spark, "_nsq_settler", None)
    if settler is None:
        settler = Settler(spark)
        spark.streams.addListener(settler)
        spark._nsq_settler = settler
        atexit.register(settler.wait)
    return settler
