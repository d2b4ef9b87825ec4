"""One AMQP connection bound to the daemon: engine events in, topic and channel calls out.

Still no I/O here: the server feeds :meth:`GatewayConnection.receive_data`,
calls :meth:`fill` before every write and :meth:`poll_publishers` on a timer,
and writes ``engine.output``. Links become :class:`~consumer.LinkConsumer`
(the client receives from ``/topics/<t>/channels/<c>``) or
:class:`~publisher.LinkPublisher` (the client sends to ``/topics/<t>``);
a link we cannot serve is refused (attach with a null node, then detach
with the error) and the rest of the connection carries on.

The connection is also the daemon's record of an AMQP producer: it is added
to ``nsqd.clients`` with ``pub_counts``, so ``/stats`` lists it among the
producers as it lists NSQ publishers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from nsqd.channel import ChannelExiting
from nsqd.client_v2 import STATE_SUBSCRIBED
from nsqd.version import NSQD_VERSION

from . import events as ev
from .addresses import channel_address, topic_address
from .connection import Connection
from .consumer import LinkConsumer
from .errors import INVALID_FIELD, NOT_IMPLEMENTED, RESOURCE_DELETED, RESOURCE_LIMIT_EXCEEDED, LinkRefused
from .link import Link
from .performatives import RCV_FIRST, RCV_SECOND, SND_SETTLED, SND_UNSETTLED, Error, Source, Target
from .publisher import LinkPublisher
from .sasl import Authenticate, SaslServer

if TYPE_CHECKING:
    from nsqd.nsqd import NSQD

log = structlog.get_logger("amqp_gateway")

CONTAINER_ID = "nsqd"
_OUTCOMES = ("amqp:accepted:list", "amqp:rejected:list", "amqp:released:list", "amqp:modified:list")


class GatewayConnection:
    def __init__(self, nsqd: NSQD, remote_address: str, *, authenticate: Authenticate,
                 idle_timeout: float | None) -> None:
        self.nsqd = nsqd
        auth_required = bool(nsqd.options.auth_http_addresses)
        self.engine = Connection(client=False, container_id=CONTAINER_ID,
                                 sasl=SaslServer(authenticate, anonymous=not auth_required),
                                 sasl_required=auth_required, idle_timeout=idle_timeout,
                                 properties={"product": "nsqd-trio", "version": NSQD_VERSION})
        self.consumers: dict[Link, LinkConsumer] = {}
        self.publishers: dict[Link, LinkPublisher] = {}
        #: set by the I/O layer: wake the writer (messages arrived, a link must be detached)
        self.on_wake = _noop
        # the producer record /stats reads (ClientV2's attribute names)
        self.id = nsqd.new_client_id()
        self.remote_address = remote_address
        self.hostname = self.client_id = remote_address.rsplit(":", 1)[0]
        self.user_agent = "amqp"
        self.state = STATE_SUBSCRIBED
        self.connect_ts = nsqd.now_ns() // 1_000_000_000
        self.pub_counts: dict[str, int] = {}
        self.channel = None
        nsqd.add_client(self)

    @property
    def container_id(self) -> str:
        remote = self.engine.remote_open
        return remote.container_id if remote is not None else ""

    # ----------------------------------------------------------------- input
    def receive_data(self, data: bytes, now_ns: int) -> None:
        for event in self.engine.receive_data(data):
            self.handle(event, now_ns)

    def handle(self, event, now_ns: int) -> None:
        kind = type(event)
        if kind is ev.Transfers:
            publisher = self.publishers.get(event.link)
            if publisher is not None:
                publisher.publish(event.deliveries, now_ns)
        elif kind is ev.Settled:
            consumer = self.consumers.get(event.link)
            if consumer is not None:
                consumer.settle(event.tags, event.state, now_ns)
        elif kind is ev.LinkFlow:
            self._flow(event)
        elif kind is ev.LinkAttaching:
            self._attach(event.link, now_ns)
        elif kind is ev.LinkDetached:
            self._forget(event.link)
            if event.error is not None and not event.by_peer:
                log.warning("link detached", client=self.remote_address, link=event.link.name,
                            error=event.error.condition, description=event.error.description)
        elif kind is ev.SessionEnded:
            for link in [link for link in (*self.consumers, *self.publishers) if link.session is event.session]:
                self._forget(link)
        elif kind is ev.ConnectionOpened:
            self.user_agent = f"amqp/{event.open.container_id}"
            log.info("AMQP client connected", client=self.remote_address, container=event.open.container_id)
        elif kind is ev.ConnectionClosed:
            if event.error is not None:
                log.warning("AMQP connection closed", client=self.remote_address, by_peer=event.by_peer,
                            error=event.error.condition, description=event.error.description)
            self.connection_lost()

    def _flow(self, event: ev.LinkFlow) -> None:
        consumer = self.consumers.get(event.link)
        if consumer is not None:
            consumer.echo = consumer.echo or event.echo
            self.on_wake()
        elif event.echo:
            event.link.send_flow()

    # ----------------------------------------------------------------- links
    def _attach(self, link: Link, now_ns: int) -> None:
        attach = link.remote_attach
        try:
            if attach.rcv_settle_mode == RCV_SECOND:
                raise LinkRefused(NOT_IMPLEMENTED, "rcv-settle-mode second is not supported: use first")
            if link.is_sender:
                self._attach_consumer(link, now_ns)
            else:
                self._attach_publisher(link)
        except LinkRefused as exc:
            log.info("link refused", client=self.remote_address, link=link.name, error=exc.error.condition,
                     description=exc.error.description)
            link.refuse(exc.error)

    def _attach_consumer(self, link: Link, now_ns: int) -> None:
        attach = link.remote_attach
        source = attach.source
        if not isinstance(source, Source) or source.dynamic:
            raise LinkRefused(INVALID_FIELD, "consuming needs a source address /topics/<topic>/channels/<channel>")
        topic_name, channel_name = channel_address(source.address)
        nsqd = self.nsqd
        try:
            channel = nsqd.get_topic(topic_name).get_channel(channel_name)
        except (ChannelExiting, RuntimeError) as exc:
            raise LinkRefused(RESOURCE_DELETED, f"cannot subscribe: {exc}") from None
        # our answer fixes the settle mode before the consumer reads it
        snd_mode = SND_SETTLED if attach.snd_settle_mode == SND_SETTLED else SND_UNSETTLED
        link.snd_settle_mode = snd_mode
        consumer = LinkConsumer(link, channel, nsqd.new_client_id(), container_id=self.container_id,
                                remote_address=self.remote_address,
                                msg_timeout_ns=int(nsqd.options.msg_timeout * 1e9), now_ns=now_ns,
                                on_wake=self._wake)
        try:
            channel.add_consumer(consumer.id, consumer, nsqd.options.max_channel_consumers)
        except ChannelExiting as exc:
            raise LinkRefused(RESOURCE_DELETED, f"cannot subscribe: {exc}") from None
        except ValueError as exc:
            raise LinkRefused(RESOURCE_LIMIT_EXCEEDED, str(exc)) from None
        self.consumers[link] = consumer
        link.attach(Source(source.address, outcomes=_OUTCOMES), attach.target, snd_settle_mode=snd_mode,
                    rcv_settle_mode=RCV_FIRST)
        log.info("AMQP consumer attached", client=self.remote_address, link=link.name, topic=topic_name,
                 channel=channel_name, presettled=consumer.presettled)

    def _attach_publisher(self, link: Link) -> None:
        attach = link.remote_attach
        target = attach.target
        if not isinstance(target, Target) or target.dynamic:
            raise LinkRefused(INVALID_FIELD, "publishing needs a target address /topics/<topic>")
        topic_name = topic_address(target.address)
        try:
            self.nsqd.get_topic(topic_name)
        except (ChannelExiting, RuntimeError) as exc:
            raise LinkRefused(RESOURCE_DELETED, f"cannot publish: {exc}") from None
        publisher = LinkPublisher(link, topic_name, self.nsqd, self.pub_counts)
        self.publishers[link] = publisher
        link.attach(attach.source, Target(target.address), snd_settle_mode=attach.snd_settle_mode,
                    rcv_settle_mode=RCV_FIRST)
        publisher.grant()
        log.info("AMQP publisher attached", client=self.remote_address, link=link.name, topic=topic_name)

    def _forget(self, link: Link) -> None:
        consumer = self.consumers.pop(link, None)
        if consumer is not None:
            consumer.channel.remove_consumer(consumer.id)
        self.publishers.pop(link, None)

    def _wake(self) -> None:
        self.on_wake()

    # ---------------------------------------------------------------- output
    def fill(self, now_ns: int) -> int:
        """One batch per consuming link (detaching those whose channel went); returns messages sent."""
        if self.engine.close_sent:
            return 0
        sent = 0
        for link, consumer in list(self.consumers.items()):
            if consumer.closing:
                self._forget(link)
                link.detach(Error(RESOURCE_DELETED, f"channel {consumer.channel.name} was deleted"))
            elif link.attached:
                sent += consumer.fill(now_ns)
        return sent

    @property
    def publishers_starved(self) -> bool:
        return any(p.starved for p in self.publishers.values())

    def poll_publishers(self) -> None:
        for publisher in self.publishers.values():
            if publisher.starved:
                publisher.grant()

    def idle_expired(self) -> None:
        self.engine.close(Error(RESOURCE_LIMIT_EXCEEDED, "idle timeout: no frame from the client in time"))

    def connection_lost(self) -> None:
        """The connection is over: consumers leave their channels (requeueing what they had)."""
        for link in list(self.consumers):
            self._forget(link)
        self.publishers.clear()
        self.nsqd.remove_client(self)


def _noop() -> None:
    return None
