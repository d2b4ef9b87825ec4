"""A link on which the client receives: one subscription to an NSQ channel.

It is to AMQP what ``ClientV2`` is to the TCP protocol: the consumer behind a
:class:`~nsqd.subscription.Subscription`, with the same stats attributes, so
AMQP and NSQ consumers of one channel share its messages and ``/stats``
shows both.

Its link credit is its RDY, within the connection's budget (every link of a
connection shares ``--max-rdy-count``, whatever credit the client grants):
:meth:`fill` takes at most ``min(credit, the session's outgoing window,
FILL_BATCH)`` messages per round, and no more bytes than the round has left
(the connection's ``FILL_BYTES``, shared by its links) or the window's
frames can carry, so a huge credit never holds more than one batch in our
buffers, nor a shut window more than one message; the writer calls it again as
the socket drains. A
pre-settled link (snd-settle-mode settled) is at-most-once: messages are
finished as they are sent.

Dispositions map onto the subscription's verbs (see :meth:`settle`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from nsqd.client_v2 import STATE_SUBSCRIBED
from nsqd.message import MSG_ID_LENGTH as ID_SIZE

from .mapping import encode_delivery
from .performatives import Accepted, Modified, Rejected

if TYPE_CHECKING:
    from nsqd.subscription import Subscription

    from .link import Link

#: most messages taken from the channel for one link per write round (RabbitMQ's queue credit: 256)
FILL_BATCH = 256
#: bytes of messages one write round takes for all the links of a connection (at least one
#: message): a client that does not read holds this and its socket buffers in flight, not its
#: whole credit of large messages (docs/limits.md)
FILL_BYTES = 1024 * 1024
#: bytes of a transfer frame that are not the message: frame header, transfer fields, the tag
TRANSFER_OVERHEAD = 64
#: timed-out deliveries tolerated in the session's unsettled map before it is pruned
STALE_SLACK = 1024


def delivery_tags(ids: list[bytes], failures: list[int]) -> list[bytes]:
    """The tags of deliveries: the NSQ message id, then ``#`` and its failed deliveries if any.

    Spec 2.6.12 wants a tag unique among a link's unsettled deliveries, and a
    message that timed out is sent again (to the same link, maybe) while the
    client may still hold the first copy unsettled; every timeout counts a
    failed delivery, so the suffix tells the copies apart.
    """
    return [msg_id if n == 0 else b"%s#%d" % (msg_id, n) for msg_id, n in zip(ids, failures)]


def message_ids(tags: list[bytes]) -> list[bytes]:
    return [tag[:ID_SIZE] for tag in tags] if any(len(tag) != ID_SIZE for tag in tags) else tags


def current_ids(tags: list[bytes], failed: dict[bytes, int]) -> list[bytes]:
    """The message ids of the deliveries that are the last sent of their message."""
    if not failed:
        return message_ids(tags)
    ids = []
    for tag in tags:
        msg_id = tag[:ID_SIZE]
        sent_after = int(tag[ID_SIZE + 1:]) if len(tag) > ID_SIZE else 0
        if failed.get(msg_id, 0) == sent_after:
            ids.append(msg_id)
    return ids


class LinkConsumer:
    def __init__(self, link: Link, channel_name: str, *, container_id: str, remote_address: str, now_ns: int,
                 on_wake: Callable[[], None]) -> None:
        self.link = link
        self.channel_name = channel_name
        self.sub: Subscription | None = None
        self.presettled = link.sends_settled
        self.on_wake = on_wake
        #: the channel was deleted: the link must be detached
        self.closing = False
        #: the client asked for a flow (echo) that the next fill answers
        self.echo = False
        #: the last fill stopped for a budget with credit left (see Subscription.stopped_short)
        self.stopped_short = False
        #: deliveries that timed out since the session's unsettled map was last pruned
        self.stale = 0
        # what /stats reads (ClientV2's attributes)
        host = remote_address.rsplit(":", 1)[0]
        self.client_id = link.name
        self.hostname = host
        self.remote_address = remote_address
        self.user_agent = f"amqp/{container_id}"
        self.state = STATE_SUBSCRIBED
        self.connect_ts = now_ns // 1_000_000_000
        self.tls = self.snappy = self.deflate = False
        self.authed = False
        self.auth_identity = self.auth_identity_url = ""
        self.sample_rate = 0

    # ---------------------------------------------------------------- stats
    @property
    def ready_count(self) -> int:
        return max(self.link.credit, 0)

    @property
    def in_flight_count(self) -> int:
        return self.sub.in_flight_count

    @property
    def message_count(self) -> int:
        return self.sub.message_count

    @property
    def finish_count(self) -> int:
        return self.sub.finish_count

    @property
    def requeue_count(self) -> int:
        return self.sub.requeue_count

    # ------------------------------------------------------ channel consumer
    @property
    def write_blocked(self) -> bool:
        return self.link.session.connection.write_blocked

    def ready(self) -> int:
        """What a fill could take now, the budget aside: the credit within the session's window.

        A link the peer stopped (credit 0) is thus not woken in place of a
        consumer that can take the messages; the flow that gives it credit
        again wakes its writer, whose fill asks the channel anew.
        """
        link = self.link
        session = link.session
        if session.connection.window_held >= FILL_BYTES:  # the connection holds a round already
            return 0
        return min(link.credit, session.outgoing_room)

    def wake(self) -> None:
        self.on_wake()

    def close(self) -> None:
        self.closing = True
        self.on_wake()

    def drain(self) -> None:
        """Shutdown: the channel hands out nothing more; a flow tells the client
        (available 0) while it settles what it holds, until the connection closes."""
        self.echo = True
        self.on_wake()

    def timed_out(self, count: int) -> None:
        """Timed-out deliveries stay unsettled in the session until the client settles them;
        for a client that never does, they are forgotten once they outnumber the live ones."""
        self.stale += count
        sub = self.sub
        if self.stale > max(len(sub.in_flight), STALE_SLACK):
            in_flight = sub.in_flight
            self.link.session.forget_unsettled(self.link, lambda tag: tag[:ID_SIZE] in in_flight)
            self.stale = 0

    # ------------------------------------------------------------- delivery
    def fill(self, now_ns: int, max_bytes: float = math.inf) -> int:
        """Send one batch of messages within the credit (stopping at the message that reaches
        ``max_bytes``); answer drain and echo. Returns the bytes of the messages sent."""
        link = self.link
        sub = self.sub
        session = link.session
        room = session.outgoing_room
        want = min(link.credit, room, FILL_BATCH) if max_bytes > 0 else 0
        sent = nbytes = 0
        self.stopped_short = False
        if want > 0:
            # no more bytes than the window's frames carry (and at least one message): a message
            # of many frames took a window slot each, and what the window never let through came
            # back as failed deliveries when the client went
            carried = room * (session.connection.peer_max_frame_size - TRANSFER_OVERHEAD)
            pieces = sub.take(want, now_ns, min(max_bytes, carried))
            if pieces:
                sent = self._send(pieces)
            nbytes = sub.taken_bytes
            self.stopped_short = sent < want and sub.stopped_short  # the writer comes back for more
        link.available = sub.available
        dry = sent < want and not self.stopped_short
        # the channel ran dry: the rest of the credit is used up (a flow needs no room in the
        # session window, so a drain is answered even while the window holds transfers back)
        if link.drain and link.credit > 0 and (dry or not link.available):
            link.complete_drain()
            self.echo = False
        elif self.echo or (link.drain_owed and link.credit == 0):  # a drain the transfers used up
            self.echo = False
            link.send_flow()
        return nbytes

    def _send(self, pieces: list) -> int:
        link = self.link
        sub = self.sub
        presettled = self.presettled
        sent = 0
        for ids, frames, _ in pieces:
            failures = sub.failures(ids)
            released = sub.released(ids)
            if failures is None and released is None:
                payloads = [encode_delivery(f) for f in frames]
            else:
                payloads = [encode_delivery(f, failed, back) for f, failed, back in
                            zip(frames, failures or [0] * len(frames), released or [False] * len(frames))]
            if presettled:
                sub.forget_in_flight(ids)
            link.send_transfers(ids if failures is None else delivery_tags(ids, failures), payloads, presettled)
            sent += len(ids)
        return sent

    # ----------------------------------------------------------- settlement
    def settle(self, tags: list[bytes], state: object, now_ns: int) -> None:
        """The client's outcome for deliveries (see :func:`delivery_tags`).

        accepted (or settled with no outcome) finishes; released, and modified
        without flags, requeue at once counting nothing; modified with
        delivery-failed requeues counting an attempt and a failed delivery;
        rejected, and modified with undeliverable-here, remove the message
        from the channel (counted). An outcome we do not know releases a
        settled delivery and leaves an unsettled one in flight.

        A delivery that timed out and was sent again counts only if accepted
        (the message was processed, so it is finished): giving back a copy
        that is no longer the one in flight would requeue the message under
        the consumer that still holds it.
        """
        kind = type(state)
        sub = self.sub
        if kind is Accepted or state is None:
            sub.finish(message_ids(tags))
            return
        tags = current_ids(tags, sub.channel.failed)
        if not tags:
            return
        if kind is Rejected or (kind is Modified and state.undeliverable_here):
            sub.reject(tags)
        elif kind is Modified and state.delivery_failed:
            sub.requeue_many(tags, now_ns, count_attempt=True)
        else:  # released, modified without flags, or an outcome we do not know
            sub.requeue_many(tags, now_ns, count_attempt=False)
