"""The core's answers to its front ends: publish receipts and the errors of publishing and subscribing.

TCP, HTTP and AMQP publish through one call (``NSQD.publish``) and consume
through subscriptions (``NSQD.subscribe``); these types are what those calls
return or raise, so a front end only encodes them in its own protocol.
"""

from __future__ import annotations

from . import diskq


class PublishError(Exception):
    """A publish the daemon did not take (or could not make durable).

    ``reason`` says why in words; ``kind`` is one of ``full`` (a limit or the
    disk budget), ``exiting`` (shutting down) and ``storage`` (the disk
    failed); ``retryable`` tells whether trying again can help.
    """

    def __init__(self, reason: str, *, kind: str, retryable: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        self.retryable = retryable


class SubscribeError(Exception):
    """A subscription the daemon refused (shutting down, a deleted channel, a consumer limit)."""


class Receipt:
    """What a publish was promised: ``count`` messages stored; durable once :meth:`wait` returns.

    Without durability to wait for, ``confirmed`` is already true and the
    front end answers at once; else one fsync per touched queue (group
    commit: one serves every publish waiting on it) confirms it.
    """

    __slots__ = ("count", "queues")

    def __init__(self, count: int, queues: list) -> None:
        self.count = count
        self.queues = queues

    @property
    def confirmed(self) -> bool:
        return not self.queues

    async def wait(self) -> None:
        """Return once the messages are fsynced; raises PublishError if they could not be."""
        for queue in self.queues:
            if queue.closed:  # its channel was deleted meanwhile: nothing to keep there
                continue
            try:
                await queue.wait_durable()
            except diskq.DiskQueueError as exc:
                if queue.closed:
                    continue
                raise PublishError(f"not durable: {exc}", kind="storage") from None
        self.queues = []
