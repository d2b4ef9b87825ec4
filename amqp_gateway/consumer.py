"""A link on which the client receives: one consumer of an NSQ channel.

It is to AMQP what ``ClientV2`` is to the TCP protocol, with the same
channel interface (``in_flight``, ``wake``, ``messages_timed_out``,
``close``) and the same stats attributes, so AMQP and NSQ consumers of one
channel share its messages and ``/stats`` shows both.

Its link credit is its RDY: :meth:`fill` takes at most ``min(credit, the
session's outgoing window, FILL_BATCH)`` messages per round from the channel,
so a huge credit never holds more than one batch in our buffers; the writer
calls it again as the socket drains. A pre-settled link (snd-settle-mode
settled) is at-most-once: messages are finished as they are sent.

Dispositions map onto the channel's verbs (see :meth:`settle`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from nsqd.client_v2 import STATE_SUBSCRIBED
from nsqd.in_flight import InFlight

from .mapping import encode_delivery
from .performatives import Accepted, Modified, Rejected

if TYPE_CHECKING:
    from nsqd.channel import Channel

    from .link import Link

#: most messages taken from the channel for one link per write round (RabbitMQ's queue credit: 256)
FILL_BATCH = 256
#: timed-out deliveries tolerated in the session's unsettled map before it is pruned
STALE_SLACK = 1024


class LinkConsumer:
    def __init__(self, link: Link, channel: Channel, consumer_id: int, *, container_id: str,
                 remote_address: str, msg_timeout_ns: int, now_ns: int, on_wake: Callable[[], None]) -> None:
        self.link = link
        self.channel = channel
        self.id = consumer_id
        self.in_flight = InFlight()
        self.lease = None
        self.presettled = link.sends_settled
        self.msg_timeout_ns = msg_timeout_ns
        self.on_wake = on_wake
        #: the channel was deleted: the link must be detached
        self.closing = False
        #: the client asked for a flow (echo) that the next fill answers
        self.echo = False
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
        self.pub_counts: dict[str, int] = {}
        self.message_count = 0
        self.finish_count = 0
        self.requeue_count = 0
        self.timeout_count = 0

    @property
    def ready_count(self) -> int:
        return max(self.link.credit, 0)

    # ------------------------------------------------------ channel consumer
    def wake(self) -> int:
        self.on_wake()
        return max(self.link.credit, 0)

    def messages_timed_out(self, count: int) -> None:
        """Their deliveries stay unsettled in the session until the client settles them;
        for a client that never does, they are forgotten once they outnumber the live ones."""
        self.timeout_count += count
        self.stale += count
        if self.stale > max(len(self.in_flight), STALE_SLACK):
            self.link.session.forget_unsettled(self.link, self.in_flight.map.__contains__)
            self.stale = 0

    def close(self) -> None:
        self.closing = True
        self.on_wake()

    def drain(self) -> None:
        """Shutdown: the channel hands out nothing more; a flow tells the client
        (available 0) while it settles what it holds, until the connection closes."""
        self.echo = True
        self.on_wake()

    # ------------------------------------------------------------- delivery
    def fill(self, now_ns: int) -> int:
        """Send one batch of messages within the credit; answer drain and echo. Returns messages sent."""
        link = self.link
        channel = self.channel
        want = min(link.credit, link.session.outgoing_room, FILL_BATCH)
        sent = 0
        if want > 0:
            pieces = channel.take(want, self, now_ns)
            if pieces:
                sent = self._send(pieces, now_ns)
        link.available = 0 if channel.draining else channel.depth
        if link.drain and link.credit > 0 and sent < want:
            link.complete_drain()  # the channel ran dry: the rest of the credit is used up
            self.echo = False
        elif self.echo:
            self.echo = False
            link.send_flow()
        return sent

    def _send(self, pieces: list, now_ns: int) -> int:
        link = self.link
        channel = self.channel
        failed = channel.failed
        presettled = self.presettled
        deadline = now_ns + self.msg_timeout_ns
        sent = 0
        for ids, frames in pieces:
            if failed:
                payloads = [encode_delivery(f, failed.get(i, 0)) for i, f in zip(ids, frames)]
            else:
                payloads = [encode_delivery(f) for f in frames]
            if presettled:
                if failed:
                    channel.forget(ids)
            else:
                self.in_flight.add(ids, frames, deadline, now_ns)
            link.send_transfers(ids, payloads, presettled)
            sent += len(ids)
        self.message_count += sent
        if presettled:
            self.finish_count += sent
        return sent

    # ----------------------------------------------------------- settlement
    def settle(self, tags: list[bytes], state: object, now_ns: int) -> None:
        """The client's outcome for deliveries (tags are NSQ message ids).

        accepted (or settled with no outcome) finishes; released, and modified
        without flags, requeue at once counting nothing; modified with
        delivery-failed requeues counting an attempt and a failed delivery;
        rejected, and modified with undeliverable-here, remove the message
        from the channel (counted). An outcome we do not know releases a
        settled delivery and leaves an unsettled one in flight.
        """
        kind = type(state)
        if kind is Accepted or state is None:
            self._finish(tags)
        elif kind is Rejected or (kind is Modified and state.undeliverable_here):
            self._reject(tags)
        elif kind is Modified and state.delivery_failed:
            self._requeue(tags, now_ns, counted=True)
        else:  # released, modified without flags, or an outcome we do not know
            self._requeue(tags, now_ns, counted=False)

    def _finish(self, tags: list[bytes]) -> None:
        pop = self.in_flight.map.pop
        finished = 0
        for tag in tags:
            if pop(tag, None) is not None:
                finished += 1
        self.finish_count += finished
        if self.channel.failed:
            self.channel.forget(tags)

    def _requeue(self, tags: list[bytes], now_ns: int, counted: bool) -> None:
        # backwards, since each goes to the head of the queue: the first released is redelivered first
        take = self.in_flight.take
        requeue = self.channel.requeue
        for tag in reversed(tags):
            frame = take(tag)
            if frame is not None:
                requeue(frame, 0, now_ns, failed=counted, count_attempt=counted)
                self.requeue_count += 1

    def _reject(self, tags: list[bytes]) -> None:
        take = self.in_flight.take
        for tag in tags:
            frame = take(tag)
            if frame is not None:
                self.channel.reject(frame)
