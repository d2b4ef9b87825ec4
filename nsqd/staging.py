"""Publishes that arrive in one pass of the readiness hub are stored as one batch per topic.

A single ``PUB`` stored alone costs a topic lookup, its limits, an id, a
frame, a disk write and a receipt, each with its Python around it: about a
third of the daemon's CPU for 100 publishers sending one message at a time.
While the hub hands out one poll's edges it keeps this batch :attr:`open`;
the protocol then stages a ``PUB`` or ``MPUB`` here instead of publishing
it, and holds its answer. When the pass ends, :meth:`PublishBatch.flush`
publishes each topic's staged messages with one :meth:`Broker.publish
<nsqd.broker.Broker.publish>` (one id run, one disk write, one receipt)
and settles every staged publish from that receipt: at once, or when the
fsync is done (durable). Nothing else runs in between (the pass never
waits), so no other task sees a staged message missing.

The promise of each publish is kept as it would be alone: a publish's
messages stay together and in order, the answer goes out only once the
batch is stored (fsynced, durable), and a batch that is refused (a full
topic, a full disk) is published again one publish at a time, so each one
gets the answer it would have got alone.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import structlog
import trio

from .broker import PublishError

if TYPE_CHECKING:
    from .broker import Broker, Receipt

log = structlog.get_logger("nsqd.staging")


class StagedPublish:
    """One staged publish: what a :class:`~nsqd.broker.Receipt` is to the front end, settled by the flush."""

    __slots__ = ("bodies", "count", "settled", "_error", "_callback", "_event")

    def __init__(self, bodies: list) -> None:
        self.bodies = bodies
        self.count = len(bodies)
        #: stored or refused (by the flush, or the fsync after it)
        self.settled = False
        self._error: PublishError | None = None
        self._callback: Callable[[PublishError | None], None] | None = None
        self._event: trio.Event | None = None

    def on_settled(self, callback: Callable[[PublishError | None], None]) -> None:
        """Call ``callback`` once stored (None) or refused (the error); at once if settled."""
        if self.settled:
            callback(self._error)
        else:
            self._callback = callback

    async def wait(self) -> None:
        """Return once stored; raises PublishError if refused."""
        if not self.settled:
            self._event = trio.Event()
            await self._event.wait()
        if self._error is not None:
            raise self._error

    def settle(self, error: PublishError | None) -> None:
        self.settled = True
        self._error = error
        callback, self._callback = self._callback, None
        if callback is not None:
            callback(error)
        if self._event is not None:
            self._event.set()


class PublishBatch:
    """Owns the publishes staged during one pass of the readiness hub."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        #: a pass is on: the protocol may stage
        self.open = False
        self._topics: dict[str, list[StagedPublish]] = {}

    def stage(self, topic_name: str, bodies: list) -> StagedPublish:
        staged = StagedPublish(bodies)
        items = self._topics.get(topic_name)
        if items is None:
            self._topics[topic_name] = [staged]
        else:
            items.append(staged)
        return staged

    def flush(self) -> None:
        """The pass is over: publish every topic's staged messages and settle each publish."""
        self.open = False
        if not self._topics:
            return
        topics, self._topics = self._topics, {}
        for topic_name, items in topics.items():
            try:
                self._publish(topic_name, items)
            except Exception as exc:  # a bug: these publishers get an error, the hub goes on
                log.error("staged publishes failed", topic=topic_name, exc_info=exc)
                error = PublishError("internal error", kind="storage")
                for item in items:
                    if not item.settled:
                        item.settle(error)

    def _publish(self, topic_name: str, items: list[StagedPublish]) -> None:
        publish = self._broker.publish
        if len(items) == 1:
            bodies = items[0].bodies
        else:
            bodies = [body for item in items for body in item.bodies]
        try:
            receipt = publish(topic_name, bodies)
        except PublishError as exc:
            if len(items) == 1:
                items[0].settle(exc)
                return
            for item in items:  # each alone, so each gets the answer it would have got
                try:
                    _settle_from(publish(topic_name, item.bodies), [item])
                except PublishError as alone:
                    item.settle(alone)
            return
        _settle_from(receipt, items)


def _settle_from(receipt: Receipt, items: list[StagedPublish]) -> None:
    if receipt.confirmed:
        for item in items:
            item.settle(None)
    else:
        receipt.on_settled(partial(_settle_all, items))


def _settle_all(items: list[StagedPublish], error: PublishError | None) -> None:
    for item in items:
        item.settle(error)
