"""One AMQP connection bound to the daemon: engine events in, topic and channel calls out.

Still no I/O here: the server feeds :meth:`GatewayConnection.receive_data`,
calls :meth:`fill` before every write and :meth:`poll_publishers` when woken,
and writes ``engine.output``. Links become :class:`~consumer.LinkConsumer`
(the client receives from ``/topics/<t>/channels/<c>``) or
:class:`~publisher.LinkPublisher` (the client sends to ``/topics/<t>``);
a link we cannot serve is refused (attach with a null node, then detach
with the error) and the rest of the connection carries on.

With auth servers a connection logs in with SASL PLAIN, the password being
the secret: the engine's ``SaslLogin`` sets :attr:`~GatewayConnection.auth_pending`,
the I/O layer asks the auth servers and hands the answer to
:meth:`~GatewayConnection.auth_done`. As nsqd does for SUB and PUB, every
attach and every publish is checked against the authorizations, and an
expired authorization is first asked for again: the event that found it
expired, and the events after it, wait for the answer.

The connection is also the daemon's record of an AMQP producer: it is added
to ``nsqd.clients`` with ``pub_counts``, so ``/stats`` lists it among the
producers as it lists NSQ publishers.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import structlog

from nsqd.body_budget import BIG_BODY
from nsqd.broker import SubscribeError
from nsqd.client_v2 import STATE_SUBSCRIBED, PubCounts
from nsqd.subscription import Budget
from nsqd.version import NSQD_VERSION

from . import events as ev
from .addresses import channel_address, terminus, topic_address
from .connection import MAX_PARTIAL_BYTES, Connection
from .consumer import FILL_BYTES, LinkConsumer
from .errors import (
    INVALID_FIELD, RESOURCE_DELETED, RESOURCE_LIMIT_EXCEEDED, UNAUTHORIZED_ACCESS, LinkRefused,
)
from .link import Link
from .performatives import (
    RCV_FIRST, RCV_SECOND, SND_MIXED, SND_SETTLED, SND_UNSETTLED, Attach, Error, Source, Target,
)
from .publisher import SECTIONS_ALLOWANCE, LinkPublisher, Pending
from .sasl import Authenticate, SaslServer

if TYPE_CHECKING:
    from nsqd.auth import AuthState
    from nsqd.broker import Broker

log = structlog.get_logger("amqp_gateway")

CONTAINER_ID = "nsqd"
#: links one connection may have attached (consuming and publishing): 255 sessions of 255 links
#: each made 65,025 consumers on one connection, 175 MB and seconds of the event loop to attach
MAX_LINKS = 1024
#: frames the engine handles per step: a read of thousands of tiny frames is worked through in
#: steps, and the I/O layer yields between them
STEP_FRAMES = 128
_OUTCOMES = ("amqp:accepted:list", "amqp:rejected:list", "amqp:released:list", "amqp:modified:list")
#: events that use the authorizations: attach and publish
_AUTHORIZED = (ev.LinkAttaching, ev.Transfers)


class GatewayConnection:
    def __init__(self, nsqd: Broker, remote_address: str, *, authenticate: Authenticate,
                 idle_timeout: float | None, tls: dict | None = None) -> None:
        """``tls``: the negotiated TLS parameters of an amqps connection (``nsqd.tls.describe``), for /stats."""
        self.nsqd = nsqd
        #: with auth servers, PLAIN logins wait for them (``authenticate`` is not asked) and nothing else gets in
        self.auth_enabled = bool(nsqd.options.auth_http_addresses)
        sasl = SaslServer(None if self.auth_enabled else authenticate, anonymous=not self.auth_enabled)
        self.engine = Connection(client=False, container_id=CONTAINER_ID, sasl=sasl,
                                 sasl_required=self.auth_enabled, idle_timeout=idle_timeout,
                                 properties={"product": "nsqd-trio", "version": NSQD_VERSION},
                                 step_frames=STEP_FRAMES,
                                 # room for two of the biggest messages at once, at the least
                                 max_partial_bytes=max(MAX_PARTIAL_BYTES,
                                                       2 * (nsqd.options.max_msg_size + SECTIONS_ALLOWANCE)),
                                 # past what a TCP client may hold unreserved, the daemon's body budget
                                 partial_budget=nsqd.body_budget, free_partial_bytes=BIG_BODY)
        #: the SASL PLAIN password: the secret the auth servers are asked about
        self.auth_secret = ""
        self.auth_state: AuthState | None = None
        #: the I/O layer must ask the auth servers about :attr:`auth_secret`, then call :meth:`auth_done`
        self.auth_pending = False
        self._held: deque = deque()
        self.consumers: dict[Link, LinkConsumer] = {}
        #: where the next fill round starts among the consumers (see :meth:`fill`)
        self._fill_next = 0
        #: a link's part of the last round stopped for a budget with credit left: the driver
        #: comes back for more, after a checkpoint, even if the round sent nothing
        self.stopped_short = False
        #: something may have changed what the links can be sent since the last fill round (a
        #: frame other than a heartbeat, a channel's wake-up, a send): a round over a thousand
        #: links costs milliseconds, and a heartbeat, 8 bytes, must not buy one
        self.fill_due = True
        self.publishers: dict[Link, LinkPublisher] = {}
        #: every receiving link's messages in flight count in one budget: --max-rdy-count per connection
        self.budget = Budget(nsqd.options.max_rdy_count)
        #: publishes whose answers wait for a durable receipt; the I/O layer settles them
        self.pending: list[Pending] = []
        #: set by the I/O layer: wake the writer (messages arrived, a link must be detached)
        self.on_wake = _noop
        # the producer record /stats reads (ClientV2's attribute names)
        self.id = nsqd.new_client_id()
        self.remote_address = remote_address
        self.hostname = self.client_id = remote_address.rsplit(":", 1)[0]
        self.user_agent = "amqp"
        self.state = STATE_SUBSCRIBED
        self.connect_ts = nsqd.now_ns() // 1_000_000_000
        self.pub_counts = PubCounts(nsqd.topics)
        self.authed = False
        self.auth_identity = self.auth_identity_url = ""
        self.tls = tls is not None
        self.tls_details = tls or {}
        for key, value in self.tls_details.items():
            setattr(self, key, value)
        nsqd.add_client(self)

    @property
    def container_id(self) -> str:
        remote = self.engine.remote_open
        return remote.container_id if remote is not None else ""

    # ----------------------------------------------------------------- input
    def receive_data(self, data: bytes, now_ns: int) -> None:
        engine = self.engine
        frames = engine.frames_received
        self._held.extend(engine.receive_data(data))
        if engine.frames_received != frames:
            self.fill_due = True
        self._run(now_ns)

    def _run(self, now_ns: int) -> None:
        """Handle events in order until one needs the auth servers."""
        held = self._held
        while held and not self.auth_pending:
            event = held.popleft()
            state = self.auth_state
            if state is not None and type(event) in _AUTHORIZED and state.is_expired(now_ns / 1e9):
                held.appendleft(event)
                self.auth_pending = True
            else:
                self.handle(event, now_ns)

    def auth_done(self, state: AuthState | None, now_ns: int) -> None:
        """The auth servers' answer for :attr:`auth_secret` (None: refused, or none answered).

        Without authorizations a client can do nothing, so that fails too (nsqd closes such a connection).
        """
        self.auth_pending = False
        ok = state is not None and bool(state.authorizations)
        login = self.auth_state is None
        if ok:
            self.auth_state = state
            self.authed = True
            self.auth_identity, self.auth_identity_url = state.identity, state.identity_url
        if login:
            self._held.extend(self.engine.sasl_verdict(ok))
        elif not ok:
            self._held.clear()
            log.warning("AMQP authorization expired and was not renewed", client=self.remote_address)
            self.engine.close(Error(UNAUTHORIZED_ACCESS, "the authorization expired and was not renewed"))
            return
        self._run(now_ns)

    def handle(self, event, now_ns: int) -> None:
        self.fill_due = True  # held events are handled after the round their frames started
        kind = type(event)
        if kind is ev.Transfers:
            publisher = self.publishers.get(event.link)
            if publisher is not None:
                self._publish(publisher, event.deliveries)
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
        elif kind is ev.SaslLogin:
            self.auth_secret = event.password
            self.auth_pending = True
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

    def _publish(self, publisher: LinkPublisher, deliveries: list[ev.IncomingDelivery]) -> None:
        if self._allows(publisher.topic_name):
            pending = publisher.publish(deliveries)
            if pending is not None:
                self.pending.append(pending)
            return
        # renewed authorizations that no longer cover the topic: the link goes, unsettled
        error = Error(UNAUTHORIZED_ACCESS, f"not authorized to publish to {publisher.topic_name}")
        log.warning("link detached", client=self.remote_address, link=publisher.link.name, error=error.condition,
                    description=error.description)
        self._forget(publisher.link)
        publisher.link.detach(error)

    # ----------------------------------------------------------------- links
    def _attach(self, link: Link, now_ns: int) -> None:
        if link.over:  # detached, ended or closed with the attach: answered (if at all) with no node
            link.refuse(None)
            return
        try:
            attach = link.remote_attach
            if (attach.snd_settle_mode not in (SND_UNSETTLED, SND_SETTLED, SND_MIXED)
                    or attach.rcv_settle_mode not in (RCV_FIRST, RCV_SECOND)):
                raise LinkRefused(INVALID_FIELD, f"settle modes {attach.snd_settle_mode}/{attach.rcv_settle_mode} "
                                                 "are not sender-settle-mode 0-2 and receiver-settle-mode 0-1")
            if len(self.consumers) + len(self.publishers) >= MAX_LINKS:
                raise LinkRefused(RESOURCE_LIMIT_EXCEEDED, f"a connection may have at most {MAX_LINKS} links")
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
        source = terminus(attach.source, Source, "consuming needs a source address /topics/<topic>/channels/<channel>")
        topic_name, channel_name = channel_address(source.address)
        if not self._allows(topic_name, channel_name):
            raise LinkRefused(UNAUTHORIZED_ACCESS, f"not authorized to subscribe to {topic_name}/{channel_name}")
        nsqd = self.nsqd
        # our answer fixes the settle mode before the consumer reads it
        snd_mode = SND_SETTLED if attach.snd_settle_mode == SND_SETTLED else SND_UNSETTLED
        link.snd_settle_mode = snd_mode
        consumer = LinkConsumer(link, channel_name, container_id=self.container_id,
                                remote_address=self.remote_address, now_ns=now_ns, on_wake=self._wake)
        consumer.authed, consumer.auth_identity, consumer.auth_identity_url = (
            self.authed, self.auth_identity, self.auth_identity_url)
        consumer.tls = self.tls
        for key, value in self.tls_details.items():
            setattr(consumer, key, value)
        try:
            consumer.sub = nsqd.subscribe(topic_name, channel_name, consumer, budget=self.budget,
                                          msg_timeout_ns=int(nsqd.options.msg_timeout * 1e9))
        except SubscribeError as exc:
            condition = RESOURCE_LIMIT_EXCEEDED if "exceeds limit" in str(exc) else RESOURCE_DELETED
            raise LinkRefused(condition, f"cannot subscribe: {exc}") from None
        self.consumers[link] = consumer
        link.attach(Source(source.address, outcomes=_OUTCOMES), attach.target, snd_settle_mode=snd_mode,
                    rcv_settle_mode=_rcv_settle_mode(attach))
        log.info("AMQP consumer attached", client=self.remote_address, link=link.name, topic=topic_name,
                 channel=channel_name, presettled=consumer.presettled)

    def _attach_publisher(self, link: Link) -> None:
        attach = link.remote_attach
        target = terminus(attach.target, Target, "publishing needs a target address /topics/<topic>")
        topic_name = topic_address(target.address)
        if not self._allows(topic_name):
            raise LinkRefused(UNAUTHORIZED_ACCESS, f"not authorized to publish to {topic_name}")
        try:
            self.nsqd.declare(topic_name)
        except SubscribeError as exc:
            raise LinkRefused(RESOURCE_DELETED, f"cannot publish: {exc}") from None
        publisher = LinkPublisher(link, topic_name, self.nsqd, self.pub_counts, self._wake)
        self.publishers[link] = publisher
        # we settle our outcome at once whatever mode the client asked for (it is ours to state,
        # spec 2.7.3): the message is stored, and Azure's pyamqp sender waits for a settled outcome
        link.attach(attach.source, Target(target.address), snd_settle_mode=attach.snd_settle_mode,
                    rcv_settle_mode=RCV_FIRST)
        publisher.grant()
        log.info("AMQP publisher attached", client=self.remote_address, link=link.name, topic=topic_name)

    def _allows(self, topic: str, channel: str = "") -> bool:
        """nsqd's rule: publishing needs ``publish`` on the topic, consuming ``subscribe`` on topic and channel."""
        return not self.auth_enabled or self.auth_state.allows(topic, channel)

    def _forget(self, link: Link) -> None:
        consumer = self.consumers.pop(link, None)
        if consumer is not None:  # the pair holds each other: let go, it would wait for the collector
            sub, consumer.sub = consumer.sub, None
            sub.close()
        publisher = self.publishers.pop(link, None)
        if publisher is not None:
            publisher.close()

    def _wake(self) -> None:
        self.fill_due = True
        self.on_wake()

    # ---------------------------------------------------------------- output
    def fill(self, now_ns: int) -> None:
        """One batch per consuming link, ``FILL_BYTES`` for them all less what waits for the peer's
        session windows (detaching those whose channel went).

        A round that runs out of bytes ends at that link; the next round starts
        with the link after it, so every link gets its turn. Nothing happens
        unless a round is due (:attr:`fill_due`).
        """
        self.stopped_short = False
        if self.engine.close_sent or not self.fill_due:
            return
        self.fill_due = False
        items = list(self.consumers.items())
        count = len(items)
        # transfers still waiting for the peer's session windows count against the round: a peer
        # that keeps its windows shut holds one round's messages, not one per session
        start = left = FILL_BYTES - self.engine.window_held
        with self.budget.counted():  # the links' takes share it: counted once, not once a link
            for i in range(self._fill_next, self._fill_next + count):
                link, consumer = items[i % count]
                if consumer.closing:
                    self._forget(link)
                    link.detach(Error(RESOURCE_DELETED, f"channel {consumer.channel_name} was deleted"))
                elif link.attached and (left > 0 or link.drain or consumer.echo):
                    left -= consumer.fill(now_ns, left)
                    self.stopped_short = self.stopped_short or consumer.stopped_short
                    if left <= 0 < start:
                        self._fill_next = (i + 1) % count
        if self.stopped_short or left < start:  # a link may have more to send than the round took
            self.fill_due = True

    @property
    def publishers_starved(self) -> bool:
        return any(p.starved for p in self.publishers.values())

    def poll_publishers(self) -> None:
        for publisher in self.publishers.values():
            if publisher.starved:
                publisher.grant()

    def idle_expired(self) -> None:
        self.engine.close(Error(RESOURCE_LIMIT_EXCEEDED, "idle timeout: no frame from the client in time"))

    def partials_expired(self, seconds: float) -> None:
        log.info("AMQP unfinished delivery not completed in time", client=self.remote_address)
        self.engine.close(Error(RESOURCE_LIMIT_EXCEEDED, f"unfinished deliveries: one was not completed within "
                                                         f"{seconds:g} s of its first frame"))

    def connection_lost(self) -> None:
        """The connection is over: consumers leave their channels (requeueing what they had), and
        publishers stop waiting for room in full topics."""
        for link in [*self.consumers, *self.publishers]:
            self._forget(link)
        self.engine.release_partials()
        self.nsqd.remove_client(self)
        self.engine.forget_sessions()
        self.on_wake = _noop  # the driver's: it holds this connection


def _rcv_settle_mode(attach: Attach) -> int:
    """A consuming client's rcv-settle-mode, which we follow (spec 2.8.3): we settle every
    outcome it sends unsettled at once, which is all that second asks of a sender."""
    return RCV_SECOND if attach.rcv_settle_mode == RCV_SECOND else RCV_FIRST


def _noop() -> None:
    return None
