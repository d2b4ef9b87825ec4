"""A link on which the client publishes to a topic, with back-pressure per link.

Credit is granted in batches of ``PUBLISH_CREDIT`` (RabbitMQ's 170), topped
up once less than half is left, and only while ``topic.accepting`` is true;
under a limit a grant never exceeds the room left, so a publisher that keeps
to its credit is not refused for a full topic (several links racing for the
last room can be).

When the topic is full the link simply runs out of credit: the other links
of the connection and session keep their own credit, so one full topic never
slows publishing elsewhere or consuming on the same connection. The
connection polls starved links (``POLL_INTERVAL``) and tops them up as soon
as the topic takes messages again.

All complete deliveries that arrived in a row on the link become one
``put_chunk``; unsettled ones are answered ``accepted`` only after it
returned (the message is stored), or ``rejected`` with the reason. Pre-settled
deliveries are at-most-once: a failure is only logged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from nsqd import message
from nsqd.channel import ChannelExiting
from nsqd.topic import QueueFull

from .codec import DecodeError
from .errors import (
    DECODE_ERROR, INTERNAL_ERROR, INVALID_FIELD, MESSAGE_SIZE_EXCEEDED, RESOURCE_DELETED, RESOURCE_LIMIT_EXCEEDED,
)
from .performatives import Accepted, Error, Rejected
from .sections import message_body

if TYPE_CHECKING:
    from nsqd.nsqd import NSQD

    from .events import IncomingDelivery
    from .link import Link

log = structlog.get_logger("amqp_gateway.publisher")

PUBLISH_CREDIT = 170
#: seconds between looks at a full topic whose links are out of credit
POLL_INTERVAL = 0.05
#: bytes of non-body sections a message may carry on top of --max-msg-size
SECTIONS_ALLOWANCE = 64 * 1024

_ACCEPTED = Accepted()


class LinkPublisher:
    def __init__(self, link: Link, topic_name: str, nsqd: NSQD, pub_counts: dict[str, int]) -> None:
        self.link = link
        self.topic_name = topic_name
        self.nsqd = nsqd
        self.pub_counts = pub_counts
        #: out of credit because the topic is full; the connection polls it
        self.starved = False
        link.max_message_size = nsqd.options.max_msg_size + SECTIONS_ALLOWANCE

    def grant(self) -> None:
        """Top the credit up once below half: to ``PUBLISH_CREDIT``, or to the room the
        topic's limit leaves if that is less; none while the topic takes nothing."""
        link = self.link
        if link.credit >= PUBLISH_CREDIT // 2 or not link.attached:
            self.starved = False
            return
        topic = self.nsqd.get_existing_topic(self.topic_name)
        if topic is None:  # deleted: the next publish creates it again
            credit = PUBLISH_CREDIT
        elif not topic.accepting:
            credit = 0
        else:
            room = topic.room()  # may be <= 0 under a policy that makes room itself (drop-oldest)
            credit = PUBLISH_CREDIT if room is None or room <= 0 else min(PUBLISH_CREDIT, room)
        self.starved = credit <= link.credit
        if not self.starved:
            link.flow(credit)

    def publish(self, deliveries: list[IncomingDelivery], now_ns: int) -> None:
        """Store a run of deliveries as one chunk and answer each unsettled one."""
        max_size = self.nsqd.options.max_msg_size
        bodies: list[bytes] = []
        stored: list[tuple[int, bool]] = []
        failures: list[tuple[int, bool, Error]] = []
        for did, _tag, settled, payload in deliveries:
            if payload is None:
                failures.append((did, settled, Error(MESSAGE_SIZE_EXCEEDED, f"message larger than {max_size} bytes")))
                continue
            try:
                body = message_body(payload)
            except DecodeError as exc:
                failures.append((did, settled, Error(DECODE_ERROR, str(exc))))
                continue
            if not body:
                failures.append((did, settled, Error(INVALID_FIELD, "empty message body")))
            elif len(body) > max_size:
                failures.append((did, settled, Error(MESSAGE_SIZE_EXCEEDED,
                                                     f"message body {len(body)} > {max_size} bytes")))
            else:
                bodies.append(body)
                stored.append((did, settled))
        if bodies:
            failures.extend(self._store(bodies, stored, now_ns))
        link = self.link
        accepted = [did for did, settled in stored if not settled]
        if accepted:
            link.settle(accepted, _ACCEPTED)
        for did, settled, error in failures:
            if settled:
                log.warning("pre-settled message dropped", topic=self.topic_name, error=error.description)
            else:
                link.settle([did], Rejected(error))
        self.grant()

    def _store(self, bodies: list[bytes], stored: list[tuple[int, bool]], now_ns: int):
        """Put what the topic takes; returns failures and trims ``stored`` to what was stored.

        A batch bigger than the room left under a ``reject`` limit is cut:
        the head is stored, the tail refused.
        """
        nsqd = self.nsqd
        ids = nsqd.guid.new_ids(len(bodies))
        frames = [message.encode_frame(i, b, now_ns) for i, b in zip(ids, bodies)]
        count = len(frames)
        error = None
        try:
            topic = nsqd.get_topic(self.topic_name)
            try:
                topic.put_chunk(ids, frames, sum(len(b) for b in bodies))
            except QueueFull as exc:
                error = Error(RESOURCE_LIMIT_EXCEEDED, str(exc))
                count = max(min(topic.room() or 0, count), 0)
                if count:
                    topic.put_chunk(ids[:count], frames[:count], sum(len(b) for b in bodies[:count]))
        except QueueFull as exc:
            count, error = 0, Error(RESOURCE_LIMIT_EXCEEDED, str(exc))
        except ChannelExiting as exc:
            count, error = 0, Error(RESOURCE_DELETED, f"cannot publish: {exc}")
        except Exception as exc:  # a disk failure: refuse the batch, keep the link
            log.error("publish failed", topic=self.topic_name, error=repr(exc))
            count, error = 0, Error(INTERNAL_ERROR, f"failed to store the message: {exc}")
        if count:
            self.pub_counts[self.topic_name] = self.pub_counts.get(self.topic_name, 0) + count
        failed = stored[count:]
        del stored[count:]
        return [(did, settled, error) for did, settled in failed]
