"""A link on which the client publishes to a topic, with back-pressure per link.

Credit is granted in batches of ``PUBLISH_CREDIT`` (RabbitMQ's 170), topped
up once less than half is left, and only while the topic takes messages.
Under a limit a grant never exceeds the room left less the credit the
topic's other publishing links hold (all connections: :class:`TopicLinks`),
nor an equal share of the room among them, so publishers that keep to their
credit are not refused for a full topic, and a link that holds credit it
does not use keeps no more than its share from the others.

When the topic is full the link simply runs out of credit: the other links
of the connection and session keep their own credit, so one full topic never
slows publishing elsewhere or consuming on the same connection. A starved
link asks the daemon to wake its connection as soon as the topic may take
messages again (messages left a queue, a limit changed) and is topped up
then; the connection also looks again every ``POLL_INTERVAL`` (a safety net
for the disk budget, which is sampled).

All complete deliveries that arrived in a row on the link become one
publish through the daemon's one publish path; unsettled ones are answered
``accepted`` only once it is confirmed (stored, and fsynced when the topic
is durable or a message's header says ``durable``), or ``rejected`` with the
reason. Pre-settled deliveries are at-most-once: a failure is only logged.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Callable

import structlog

from nsqd.broker import PublishError, Receipt

from .codec import DecodeError
from .errors import DECODE_ERROR, INVALID_FIELD, MESSAGE_SIZE_EXCEEDED, RESOURCE_DELETED, RESOURCE_LIMIT_EXCEEDED
from .events import NO_ROOM
from .performatives import Accepted, Error, Rejected
from .sections import message_body

if TYPE_CHECKING:
    from nsqd.broker import Broker
    from nsqd.client_v2 import PubCounts

    from .events import IncomingDelivery
    from .link import Link

log = structlog.get_logger("amqp_gateway.publisher")

PUBLISH_CREDIT = 170
#: seconds a topic's sum of the credit its publishing links hold is used before it is summed again
HELD_TTL = 0.05
#: seconds between looks at a full topic whose links are out of credit, besides the wake-ups
POLL_INTERVAL = 1.0
#: bytes of non-body sections a message may carry on top of --max-msg-size
SECTIONS_ALLOWANCE = 64 * 1024

_ACCEPTED = Accepted()
#: AMQP error conditions for the reasons a publish is refused
_CONDITIONS = {"full": RESOURCE_LIMIT_EXCEEDED, "storage": RESOURCE_LIMIT_EXCEEDED, "exiting": RESOURCE_DELETED}


class Pending:
    """Deliveries stored but waiting for their receipt (a durable publish) before ``accepted``."""

    __slots__ = ("publisher", "receipt", "accepted", "settled")

    def __init__(self, publisher: LinkPublisher, receipt: Receipt, accepted: list[int], settled: int) -> None:
        self.publisher = publisher
        self.receipt = receipt
        self.accepted = accepted
        self.settled = settled

    def done(self, error: PublishError | None) -> None:
        """Answer the deliveries once the receipt is settled."""
        self.publisher.confirmed(self, error)


class TopicLinks:
    """The publishing links of each topic, over every connection of one daemon: the credit they
    hold is room the topic promised already.

    The credit held is summed over a topic's links at most every :data:`HELD_TTL` and kept
    up to date with our own grants in between: transfers that used credit meanwhile only make
    it look higher, so a grant may be smaller than it could be, never too big. (Summed at every
    grant, polling 5,000 starved links of one topic cost 7.6 s of the event loop a round.)
    """

    _of: weakref.WeakKeyDictionary[Broker, TopicLinks] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.links: dict[str, set[LinkPublisher]] = {}
        #: per topic: when the credit its links hold was summed, the sum, and each link's part of it
    #: (both kept up to date with our grants since)
        self._held: dict[str, list] = {}

    @classmethod
    def of(cls, nsqd: Broker) -> TopicLinks:
        found = cls._of.get(nsqd)
        if found is None:
            found = cls._of[nsqd] = cls()
        return found

    def add(self, publisher: LinkPublisher) -> None:
        self.links.setdefault(publisher.topic_name, set()).add(publisher)

    def discard(self, publisher: LinkPublisher) -> None:
        links = self.links.get(publisher.topic_name)
        if links is not None:
            links.discard(publisher)
            self._held.pop(publisher.topic_name, None)  # what it held is free again
            if not links:
                del self.links[publisher.topic_name]

    def share(self, publisher: LinkPublisher, room: int) -> int:
        """What ``publisher`` may hold of ``room``: the room the others' credit leaves, at most an
        equal share of it among the topic's links."""
        topic = publisher.topic_name
        links = self.links.get(topic, ())
        now = time.monotonic()
        held = self._held.get(topic)
        if held is None or now - held[0] > HELD_TTL:
            each = {other: max(other.link.credit, 0) for other in links}
            held = self._held[topic] = [now, sum(each.values()), each]
        others = held[1] - held[2].get(publisher, 0)
        return min(room - others, -(-room // max(len(links), 1)))

    def granted(self, publisher: LinkPublisher, credit: int) -> None:
        """Our grant set ``publisher``'s credit to ``credit``."""
        held = self._held.get(publisher.topic_name)
        if held is not None:
            held[1] += credit - held[2].get(publisher, 0)
            held[2][publisher] = credit


class LinkPublisher:
    def __init__(self, link: Link, topic_name: str, nsqd: Broker, pub_counts: PubCounts,
                 wake: Callable[[], None]) -> None:
        self.link = link
        self._wake = wake
        self.topic_name = topic_name
        self.nsqd = nsqd
        self.pub_counts = pub_counts
        #: out of credit because the topic is full; the connection looks at it again later
        self.starved = False
        link.max_message_size = nsqd.options.max_msg_size + SECTIONS_ALLOWANCE
        self._topic_links = TopicLinks.of(nsqd)
        self._topic_links.add(self)

    def grant(self) -> None:
        """Top the credit up once below half: to ``PUBLISH_CREDIT``, or to what the topic's limit
        leaves this link if that is less (see :meth:`TopicLinks.share`); none while the topic takes
        nothing."""
        link = self.link
        if link.credit >= PUBLISH_CREDIT // 2 or not link.attached:
            self.starved = False
            return
        accepting, room = self.nsqd.publish_room(self.topic_name)
        if not accepting:
            credit = 0
        elif room is None:
            credit = PUBLISH_CREDIT
        else:
            credit = min(PUBLISH_CREDIT, self._topic_links.share(self, room))
        self.starved = credit <= link.credit
        if self.starved:
            self.nsqd.when_room(self.topic_name, self.room_made)
        else:
            self._topic_links.granted(self, credit)
            link.flow(credit)

    def room_made(self) -> None:
        """The topic may take publishes again (what it calls, once, after :meth:`grant` found it full)."""
        self._wake()

    def close(self) -> None:
        """The link went: the topic forgets it, which would else keep the connection until room is
        made, and its credit is no longer room promised."""
        self.nsqd.forget_room_waiter(self.topic_name, self.room_made)
        self._topic_links.discard(self)

    def publish(self, deliveries: list[IncomingDelivery]) -> Pending | None:
        """Publish a run of deliveries as one batch; answer each unsettled one.

        Returns a :class:`Pending` when the answers must wait for a durable receipt.
        """
        max_size = self.nsqd.options.max_msg_size
        bodies: list[bytes] = []
        stored: list[tuple[int, bool]] = []
        failures: list[tuple[int, bool, Error]] = []
        durable = False
        for did, _tag, settled, payload in deliveries:
            if payload is None:
                failures.append((did, settled, Error(MESSAGE_SIZE_EXCEEDED, f"message larger than {max_size} bytes")))
                continue
            if payload is NO_ROOM:
                self.nsqd.body_budget.refusals += 1
                failures.append((did, settled, Error(RESOURCE_LIMIT_EXCEEDED, (
                    "no memory free for messages arriving over several frames "
                    "(--max-body-memory is in use by other clients); try again"))))
                continue
            try:
                body, wants_durable = message_body(payload)
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
                durable = durable or (wants_durable and not settled)
        pending = None
        if bodies:
            receipt, error = self._store(bodies, durable)
            count = receipt.count if receipt is not None else 0
            failures.extend((did, settled, error) for did, settled in stored[count:])
            del stored[count:]
            if receipt is not None and not receipt.confirmed:
                pending = Pending(self, receipt, [did for did, settled in stored if not settled], count)
                stored = []
        self._answer([did for did, settled in stored if not settled], failures)
        self.grant()
        return pending

    def _store(self, bodies: list[bytes], durable: bool) -> tuple[Receipt | None, Error | None]:
        """The core publish; a batch bigger than the room left under a ``reject`` limit is cut."""
        try:
            receipt = self.nsqd.publish(self.topic_name, bodies, durable=durable, partial=True)
        except PublishError as exc:
            if exc.kind == "storage":
                log.error("publish failed", topic=self.topic_name, error=exc.reason)
            return None, Error(_CONDITIONS.get(exc.kind, RESOURCE_LIMIT_EXCEEDED), exc.reason)
        if receipt.confirmed:
            self._count(receipt.count)
        full = None if receipt.count == len(bodies) else Error(
            RESOURCE_LIMIT_EXCEEDED, f"topic {self.topic_name} is full")
        return receipt, full

    def confirmed(self, pending: Pending, error: PublishError | None) -> None:
        if error is None:
            self._count(pending.settled)
            self._answer(pending.accepted, [])
        else:
            failure = Error(_CONDITIONS.get(error.kind, RESOURCE_LIMIT_EXCEEDED), error.reason)
            self._answer([], [(did, False, failure) for did in pending.accepted])

    def _count(self, count: int) -> None:
        if count:
            self.pub_counts.add(self.topic_name, count)

    def _answer(self, accepted: list[int], failures: list[tuple[int, bool, Error]]) -> None:
        link = self.link
        if not link.attached:
            return
        if accepted:
            link.settle(accepted, _ACCEPTED)
        for did, settled, error in failures:
            if settled:
                log.warning("pre-settled message dropped", topic=self.topic_name, error=error.description)
            else:
                link.settle([did], Rejected(error))
