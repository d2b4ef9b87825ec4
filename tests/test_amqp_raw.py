"""The gateway driven by our own engine as a client, for what proton cannot send or show:
echo, available, exact credit, per-link back-pressure, windows, heartbeats and violations."""

from __future__ import annotations

from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from amqp_gateway import codec, events as ev, performatives as p
from amqp_gateway import connection as amqp_connection
from amqp_gateway.connection import Connection
from amqp_gateway.consumer import FILL_BYTES
from amqp_gateway.framing import EMPTY_FRAME, encode_frame
from amqp_gateway.publisher import POLL_INTERVAL
from amqp_gateway.sasl import SaslClient
from amqp_gateway.sections import Data, Header, Message, decode_message, encode_message
from amqp_gateway.server import serve_amqp

import signal

from .support import Daemon, NSQConnection, free_port, running_nsqd, tcp_port
from .test_protocol_v2 import pub_command


class Client:
    """Our engine as an AMQP client on a Trio socket."""

    def __init__(self, stream: trio.SocketStream, conn: Connection) -> None:
        self.stream = stream
        self.conn = conn
        self.events: list = []
        self.session = None

    @classmethod
    async def connect(cls, port: int, *, begin: bool = True, **options) -> Client:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        client = cls(stream, Connection(client=True, container_id="raw-client", **options))
        client.conn.open()
        await client.until(lambda: client.conn.open_received or client.conn.finished)
        if begin and client.conn.open_received:
            client.session = client.conn.begin()
            await client.until(lambda: client.session.begin_received)
        return client

    async def flush(self) -> None:
        if self.conn.output:
            await self.stream.send_all(self.conn.data_to_send())

    async def read(self) -> bytes:
        data = await self.stream.receive_some(1 << 16)
        if data:
            self.events += self.conn.receive_data(data)
        return data

    async def until(self, condition, timeout: float = 5.0) -> None:
        with trio.fail_after(timeout):
            await self.flush()
            while not condition():
                if not await self.read():
                    raise EOFError("the gateway hung up")
                await self.flush()

    async def for_a_while(self, seconds: float) -> None:
        """Keep reading (and answering) without waiting for anything in particular."""
        with trio.move_on_after(seconds):
            await self.until(lambda: False, timeout=seconds + 1)

    def take(self, kind, link=None) -> list:
        found = [e for e in self.events if isinstance(e, kind) and (link is None or e.link is link)]
        self.events = [e for e in self.events if e not in found]
        return found

    def deliveries(self, link) -> list:
        return [d for e in self.take(ev.Transfers, link) for d in e.deliveries]

    async def attach(self, role: bool, address: str, *, name: str | None = None, settled: bool = False):
        link = self.session.attach(name or f"{role}:{address}", role)
        mode = p.SND_SETTLED if settled else p.SND_UNSETTLED
        if role is p.SENDER:
            link.attach(p.Source(), p.Target(address), snd_settle_mode=mode)
        else:
            link.attach(p.Source(address), p.Target(), snd_settle_mode=mode)
        await self.until(lambda: link.attach_received)
        return link

    async def publish(self, link, bodies: list[bytes]) -> list:
        """Send unsettled within credit, wait for every outcome; returns them in order."""
        outcomes: dict[bytes, object] = {}
        tags = [b"%d" % i for i in range(len(bodies))]
        sent = 0
        while len(outcomes) < len(bodies):
            n = min(link.credit, len(bodies) - sent)
            if n > 0:
                link.send_transfers(tags[sent:sent + n], [body_payload(b) for b in bodies[sent:sent + n]], False)
                sent += n
            await self.flush()
            await self.read()
            for settled in self.take(ev.Settled, link):
                outcomes.update(dict.fromkeys(settled.tags, settled.state))
        return [outcomes[t] for t in tags]

    async def aclose(self) -> None:
        await self.stream.aclose()


def body_payload(body: bytes) -> bytes:
    return encode_message(Message(body=[Data(body)]))


def body_of(delivery) -> bytes:
    return decode_message(delivery[3]).body[0].value


@asynccontextmanager
async def gateway(tmp_path, *, amqp_options=None, **overrides):
    """The daemon and a gateway on an ephemeral port (``amqp_options`` for serve_amqp)."""
    async with running_nsqd(tmp_path / "nsqd", **overrides) as nsqd:
        async with trio.open_nursery() as nursery:
            addresses = await nursery.start(partial(serve_amqp, nsqd, "127.0.0.1:0", **(amqp_options or {})))
            nsqd.amqp_port = addresses[0][1]
            yield nsqd
            nursery.cancel_scope.cancel()


async def eventually(condition, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


def put(nsqd, topic: str, channel: str, bodies: list[bytes]) -> None:
    """Messages into a channel through the core (the NSQ side of publishing is tested elsewhere)."""
    nsqd.declare(topic, channel)
    nsqd.publish(topic, bodies)


def consumers(channel) -> list:
    return [sub.consumer for sub in channel.subscriptions.values()]


# ------------------------------------------------------------ link flow
async def test_credit_is_set_not_added_and_echo_reports_available(tmp_path):
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [b"%d" % i for i in range(7)])
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(0, echo=True)
        await client.until(lambda: client.take(ev.LinkFlow, link))
        assert (link.available, link.credit) == (7, 0)
        link.flow(2)
        link.flow(2)   # the same credit again: still 2, not 4
        await client.until(lambda: len([e for e in client.events if isinstance(e, ev.Transfers)]) >= 1)
        await client.for_a_while(0.2)
        assert [body_of(d) for d in client.deliveries(link)] == [b"0", b"1"]
        link.flow(0, echo=True)
        await client.until(lambda: client.take(ev.LinkFlow, link))
        assert (link.available, link.credit, link.delivery_count) == (5, 0, 2)
        (consumer,) = consumers(nsqd.topics["t"].channels["c"])
        assert consumer.ready_count == 0 and consumer.in_flight_count == 2


async def test_drain_flow_carries_available_and_the_advanced_delivery_count(tmp_path):
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [b"a", b"b", b"c"])
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(2, drain=True)
        got = []
        await client.until(lambda: got.extend(client.deliveries(link)) or len(got) == 2)
        await client.for_a_while(0.1)
        client.take(ev.LinkFlow, link)  # the drain's answer (see the test below)
        # two transfers used the credit; the flow it answers with says one is left
        link.flow(0, echo=True)
        await client.until(lambda: client.take(ev.LinkFlow, link))
        assert (link.available, link.delivery_count) == (1, 2)
        link.flow(5, drain=True)
        await client.until(lambda: client.take(ev.LinkFlow, link))
        assert (link.credit, link.delivery_count, link.available) == (0, 7, 0)
        assert [body_of(d) for d in client.deliveries(link)] == [b"c"]


async def test_a_drain_whose_credit_the_transfers_use_up_is_answered_with_a_flow(tmp_path):
    """The spec asks for a flow only when messages run out, but drain callers (go-amqp, the
    Azure SDKs) wait for one, and RabbitMQ sends it: with 5 messages ready and a drain of 3,
    we sent 3 transfers and no flow."""
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [b"%d" % i for i in range(5)])
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(3, drain=True)
        await client.until(lambda: client.take(ev.LinkFlow, link))
        assert [body_of(d) for d in client.deliveries(link)] == [b"0", b"1", b"2"]
        assert (link.credit, link.delivery_count, link.available) == (0, 3, 2)
        link.flow(2, drain=False)  # not a drain: no flow owed when it is used up
        await client.until(lambda: len(client.deliveries(link)) == 2)
        await client.for_a_while(0.2)
        assert client.take(ev.LinkFlow, link) == []


async def test_a_released_range_comes_back_in_order_uncounted(tmp_path):
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [b"%d" % i for i in range(4)])
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(4)
        await client.until(lambda: sum(len(e.deliveries) for e in client.events if isinstance(e, ev.Transfers)) == 4)
        first = client.deliveries(link)
        link.settle([d[0] for d in first], p.Released())   # one disposition for the range
        link.flow(4)
        await client.until(lambda: sum(len(e.deliveries) for e in client.events if isinstance(e, ev.Transfers)) == 4)
        again = client.deliveries(link)
        assert [d[1] for d in again] == [d[1] for d in first]
        assert all((decode_message(d[3]).header or Header()).delivery_count == 0 for d in again)  # uncounted
        channel = nsqd.topics["t"].channels["c"]
        assert channel.requeue_count == 4 and not channel.failed


async def test_presettled_consumer_gets_settled_transfers(tmp_path):
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [b"x", b"y"])
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c", settled=True)
        assert link.remote_attach.snd_settle_mode == p.SND_SETTLED
        link.flow(10)
        await client.until(lambda: len([d for e in client.events if isinstance(e, ev.Transfers)
                                        for d in e.deliveries]) == 2)
        assert all(d[2] for d in client.deliveries(link))
        channel = nsqd.topics["t"].channels["c"]
        (consumer,) = consumers(channel)
        assert consumer.finish_count == 2 and channel.in_flight_count == 0



async def test_a_receiver_behind_a_big_expired_backlog_gets_the_fresh_message(tmp_path):
    """The takes drop expired messages a bounded step at a time, sending nothing; the gateway
    must come back for the next step by itself (nothing else wakes a link that is not hungry)."""
    from nsqd.channel import EXAMINE_STEP

    async with gateway(tmp_path, message_ttl=0.3) as nsqd:
        put(nsqd, "t", "c", [b"old-%d" % i for i in range(3 * EXAMINE_STEP)])
        await trio.sleep(0.4)
        nsqd.publish("t", [b"fresh"])
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(10)
        await client.until(lambda: any(isinstance(e, ev.Transfers) for e in client.events), timeout=10)
        assert [body_of(d) for d in client.deliveries(link)] == [b"fresh"]
        # memory and disk take turns: the rest of the expired ones may be dropped after it
        await eventually(lambda: nsqd.topics["t"].channels["c"].expired_count == 3 * EXAMINE_STEP)

# ------------------------------------------------------------ publishing
async def test_one_full_topic_starves_only_its_own_link(tmp_path):
    """Two senders and a receiver on one session: the full topic's link gets no credit,
    the other link keeps publishing and the receiver keeps consuming."""
    async with gateway(tmp_path, channel_max_messages=100) as nsqd:
        nsqd.get_topic("full").get_channel("idle")       # nobody consumes: it fills up
        nsqd.get_topic("free").get_channel("c")
        client = await Client.connect(nsqd.amqp_port)
        blocked = await client.attach(p.SENDER, "/topics/full")
        flowing = await client.attach(p.SENDER, "/topics/free")
        receiver = await client.attach(p.RECEIVER, "/topics/free/channels/c")
        await client.until(lambda: blocked.credit and flowing.credit)
        assert blocked.credit == 100   # a grant never exceeds the room the limit leaves
        receiver.flow(500)
        outcomes = {blocked: [], flowing: []}
        sent = {blocked: 0, flowing: 0}
        consumed = 0
        with trio.fail_after(10):
            while len(outcomes[flowing]) < 5000 or consumed < 5000:
                for link in (blocked, flowing):
                    n = link.credit if link is blocked else min(link.credit, 5000 - sent[flowing])
                    if n > 0:
                        tags = [b"%d" % (sent[link] + i) for i in range(n)]
                        link.send_transfers(tags, [body_payload(b"m")] * n, False)
                        sent[link] += n
                await client.flush()
                await client.read()
                for settled in client.take(ev.Settled):
                    outcomes[settled.link] += [type(settled.state).__name__] * len(settled.tags)
                ids = [d[0] for d in client.deliveries(receiver)]
                if ids:
                    consumed += len(ids)
                    receiver.settle(ids, p.Accepted())
                    if receiver.credit < 250:
                        receiver.flow(500)
        # the full topic's link used its 100 credits and got no more
        assert sent[blocked] == 100 and blocked.credit == 0
        assert outcomes[blocked] == ["Accepted"] * 100
        assert nsqd.topics["full"].channels["idle"].depth == 100
        assert outcomes[flowing] == ["Accepted"] * 5000 and consumed == 5000
        # once the topic has room again the starved link gets credit within a poll or two
        nsqd.topics["full"].channels["idle"].empty()
        await client.until(lambda: blocked.credit == 100, timeout=1)


async def test_links_to_a_bounded_topic_share_its_room_so_none_is_refused(tmp_path):
    """Credit granted to one link is room promised: a second link is not granted it again (each
    got the whole room, and half of what publishers sent within their credit was refused)."""
    async with gateway(tmp_path, channel_max_messages=10) as nsqd:
        channel = nsqd.get_topic("t").get_channel("c")
        first_client = await Client.connect(nsqd.amqp_port)
        second_client = await Client.connect(nsqd.amqp_port)   # other connections count too
        first = await first_client.attach(p.SENDER, "/topics/t", name="first")
        await first_client.until(lambda: first.credit == 10)
        second = await second_client.attach(p.SENDER, "/topics/t", name="second")
        await second_client.for_a_while(0.1)
        assert second.credit == 0   # the room is the first link's already
        states = await first_client.publish(first, [b"a"] * 10)
        assert [type(s).__name__ for s in states] == ["Accepted"] * 10 and channel.depth == 10
        channel.empty()   # room again: shared out, within a poll or two
        await first_client.until(lambda: first.credit > 0, timeout=3)
        await second_client.until(lambda: second.credit > 0, timeout=3)
        assert first.credit + second.credit <= 10 and max(first.credit, second.credit) <= 5
        states = (await first_client.publish(first, [b"a"] * first.credit)
                  + await second_client.publish(second, [b"b"] * second.credit))
        assert {type(s).__name__ for s in states} == {"Accepted"}
        assert channel.depth == len(states)


async def test_a_link_gone_gives_back_the_room_its_credit_held(tmp_path):
    async with gateway(tmp_path, channel_max_messages=10) as nsqd:
        nsqd.get_topic("t").get_channel("c")
        holder = await Client.connect(nsqd.amqp_port)
        held = await holder.attach(p.SENDER, "/topics/t")
        await holder.until(lambda: held.credit == 10)
        other = await Client.connect(nsqd.amqp_port)
        waiting = await other.attach(p.SENDER, "/topics/t")
        await other.for_a_while(0.1)
        assert waiting.credit == 0
        await holder.aclose()   # its 10 credits were never used
        await other.until(lambda: waiting.credit == 10, timeout=3)


async def test_publish_refusals_keep_the_link(tmp_path):
    async with gateway(tmp_path, max_msg_size=100) as nsqd:
        nsqd.get_topic("t").get_channel("c")
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.SENDER, "/topics/t")
        states = await client.publish(link, [b"x" * 101, b"", b"y" * 100, b"z" * 200_000])
        assert [type(s).__name__ for s in states] == ["Rejected", "Rejected", "Accepted", "Rejected"]
        assert [s.error.condition for s in states if isinstance(s, p.Rejected)] == [
            "amqp:link:message-size-exceeded", "amqp:invalid-field", "amqp:link:message-size-exceeded"]
        link.send_transfers([b"bad"], [b"\x00\x53\x76\x45"], False)   # an amqp-sequence body
        await client.until(lambda: any(isinstance(e, ev.Settled) for e in client.events))
        (settled,) = client.take(ev.Settled, link)
        assert settled.state.error.condition == "amqp:decode-error"
        assert nsqd.topics["t"].channels["c"].depth == 1
        assert client.conn.open_received and not client.conn.finished


async def test_multi_frame_deliveries_respect_the_clients_frame_size(tmp_path):
    async with gateway(tmp_path) as nsqd:
        body = bytes(range(256)) * 8
        put(nsqd, "t", "c", [body])
        client = await Client.connect(nsqd.amqp_port, max_frame_size=512)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(1)
        await client.until(lambda: any(isinstance(e, ev.Transfers) for e in client.events))
        assert body_of(client.deliveries(link)[0]) == body
        assert client.session.next_incoming_id >= 5   # it came in several frames


async def test_session_incoming_window_is_honoured(tmp_path):
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [b"%d" % i for i in range(20)])
        client = await Client.connect(nsqd.amqp_port)
        session = client.session
        session.keep_window_open = lambda: None   # this client manages its window by hand
        session.incoming_window = 5
        session.send_flow()
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(100)
        await client.for_a_while(0.3)
        assert len(client.deliveries(link)) == 5
        session.incoming_window = 10
        session.send_flow()
        await client.for_a_while(0.3)
        assert len(client.deliveries(link)) == 10
        assert link.credit == 85


async def narrow_window_client(nsqd, window: int = 3) -> Client:
    """A client with 512-byte frames whose session window holds ``window`` frames until it widens it."""
    client = await Client.connect(nsqd.amqp_port, max_frame_size=512)
    client.session.keep_window_open = lambda: None
    client.session.incoming_window = window
    client.session.send_flow()
    return client


def widen_window(client: Client) -> None:
    client.session.incoming_window = 1000
    client.session.send_flow()


async def held_back_receiver(nsqd):
    """Two 2 KiB messages to a receiver with credit 2 whose window of 3 frames holds seven of ten back."""
    put(nsqd, "t", "c", [bytes(range(256)) * 8] * 2)
    client = await narrow_window_client(nsqd)
    link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
    link.flow(2)
    await client.until(lambda: client.session.next_incoming_id == 3)
    return client, link


async def test_a_detach_comes_after_the_transfers_the_window_held_back(tmp_path):
    """Two 2 KiB messages are ten 512-byte frames; a window of 3 holds seven back. The client
    detaches meanwhile: our detach must follow those frames, never leave them on an unattached handle."""
    async with gateway(tmp_path) as nsqd:
        client, link = await held_back_receiver(nsqd)
        link.detach()
        widen_window(client)
        await client.until(lambda: link.detach_received, timeout=3)
        await client.for_a_while(0.2)
        assert not client.take(ev.SessionEnded) and not client.session.end_sent
        other = await client.attach(p.RECEIVER, "/topics/t/channels/c", name="other")
        other.flow(10)
        await client.until(lambda: len(client.deliveries(other)) == 2, timeout=3)


async def test_a_narrow_window_takes_no_more_messages_than_its_frames_carry(tmp_path):
    """Five 3,000-byte messages, 512-byte frames, a window of 3 frames, credit 100: a message
    needs 6 frames, yet a round took one message per window slot. When the client went, the ones
    never put on the wire came back as failed deliveries (dead-lettered unseen with
    --max-attempts). Now a round takes what the window's frames carry, at least one message."""
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [bytes([97 + i]) * 3000 for i in range(5)])
        client = await narrow_window_client(nsqd)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(100)
        await client.until(lambda: client.session.next_incoming_id == 3)
        await client.for_a_while(0.2)
        channel = nsqd.topics["t"].channels["c"]
        assert channel.in_flight_count == 1
        await client.stream.aclose()
        await eventually(lambda: not consumers(channel) and channel.in_flight_count == 0)
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.command("RDY 5")
        got = [await conn.read_message() for _ in range(5)]
        # the first was partly sent: a delivery attempt; the others were never taken
        assert [(m.body[:1], m.attempts) for m in got] == [(b"a", 2), (b"b", 1), (b"c", 1), (b"d", 1), (b"e", 1)]


async def test_a_drain_flow_comes_after_the_transfers_the_window_held_back(tmp_path):
    """A drain that runs the channel dry is answered with a flow whose delivery-count counts every
    transfer: it must not reach the client before transfers the window still holds back."""
    async with gateway(tmp_path) as nsqd:
        body = bytes(range(256)) * 8
        put(nsqd, "t", "c", [body] * 2)
        client = await narrow_window_client(nsqd)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(5, drain=True)
        await client.until(lambda: client.session.next_incoming_id == 3)
        widen_window(client)
        await client.until(lambda: client.take(ev.LinkFlow, link), timeout=3)
        await client.for_a_while(0.2)
        assert not client.take(ev.LinkDetached), "a transfer beyond the credit the flow left"
        assert [body_of(d) for d in client.deliveries(link)] == [body, body]
        assert (link.credit, link.delivery_count) == (0, 5)


async def test_credit_for_publishing_does_not_wait_behind_held_back_transfers(tmp_path):
    async with gateway(tmp_path) as nsqd:
        client, link = await held_back_receiver(nsqd)
        sender = await client.attach(p.SENDER, "/topics/other")
        await client.until(lambda: sender.credit > 0, timeout=3)
        assert await client.publish(sender, [b"x"]) == [p.Accepted()]


async def test_a_drain_on_an_empty_channel_is_answered_while_the_window_is_closed(tmp_path):
    """A flow is not a transfer: the session window does not hold back the answer to a drain."""
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [b"a", b"b"])
        client = await narrow_window_client(nsqd, window=2)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(2)
        await client.until(lambda: client.session.next_incoming_id == 2)
        assert client.session.incoming_window == 0   # the two transfers used it up
        link.flow(5, drain=True)
        await client.until(lambda: client.take(ev.LinkFlow, link), timeout=3)
        assert (link.credit, link.delivery_count) == (0, 7)


async def test_huge_credit_never_takes_more_than_the_socket_drains_nor_the_budget(tmp_path):
    async with gateway(tmp_path, mem_queue_size=5000) as nsqd:
        total = 3000
        put(nsqd, "t", "c", [b"b" * 16_000] * total)
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(1_000_000)
        await client.flush()
        await trio.sleep(0.5)   # and read nothing
        channel = nsqd.topics["t"].channels["c"]
        in_flight = channel.in_flight_count
        # taken a round at a time (FILL_BATCH messages or FILL_BYTES: 66 of these), and only as
        # far as the socket took the rounds
        assert 0 < in_flight <= total // 2 and in_flight % (FILL_BYTES // 16_000 + 1) == 0
        assert channel.depth == total - in_flight
        got = []
        with trio.fail_after(10):
            while len(got) < 2500:
                await client.read()
                await client.flush()  # our session window refills
                got += client.deliveries(link)
        await client.for_a_while(0.3)
        got += client.deliveries(link)
        # a credit of a million still holds no more than --max-rdy-count in flight
        assert len(got) == 2500 and channel.in_flight_count == 2500 and channel.depth == total - 2500
        link.settle([d[0] for d in got[:100]], p.Accepted())
        with trio.fail_after(5):
            while len(got) < 2600:
                await client.flush()
                await client.read()
                got += client.deliveries(link)
        assert channel.in_flight_count == 2500


async def test_sessions_whose_windows_stay_shut_hold_one_round_of_messages_not_one_each(tmp_path):
    """A client that opened 100 sessions with a window of one frame, credit 5 on each, pinned a
    whole message per session in our buffers (88 MB for 1 MB messages): the rest of each waited
    for a window that never opened. Now what waits for the windows counts against the rounds."""
    size, sessions = 100_000, 30
    async with gateway(tmp_path, mem_queue_size=1000) as nsqd:
        put(nsqd, "t", "c", [b"m" * size] * (5 * sessions))
        client = await Client.connect(nsqd.amqp_port, begin=False, max_frame_size=16_384)
        links = []
        for _ in range(sessions):  # a message is 7 frames, of which a window lets one through
            session = client.session = client.conn.begin()
            await client.until(lambda: session.begin_received)
            session.keep_window_open = lambda: None
            session.incoming_window = 1
            session.send_flow()
            link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
            link.flow(5)
            links.append(link)
        await client.for_a_while(0.5)
        channel = nsqd.topics["t"].channels["c"]
        # what waits for the windows (all but each message's first frame) fills one round
        # (FILL_BYTES) and the message that crossed it, not a message per session
        assert 0 < channel.in_flight_count <= FILL_BYTES // (size - 16_384) + 2 < sessions
        for session in client.conn.sessions.values():
            session.incoming_window = 10_000
            session.send_flow()
        got = []
        with trio.fail_after(20):
            while len(got) < 5 * sessions:
                await client.flush()
                await client.read()
                for link in links:
                    got += client.deliveries(link)
        assert len(got) == 5 * sessions and all(body_of(d) == b"m" * size for d in got[:3])


async def test_a_client_that_never_settles_does_not_grow_our_unsettled_map(tmp_path):
    async with gateway(tmp_path, msg_timeout=0.2) as nsqd:
        put(nsqd, "t", "c", [b"x"] * 1100)
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(5000)
        (consumer,) = consumers(nsqd.topics["t"].channels["c"])
        received = 0
        with trio.fail_after(5):
            while received < 2200:   # everything, then everything again after the timeout
                await client.flush()
                await client.read()
                received += len(client.deliveries(link))
        assert consumer.sub.timeout_count >= 1100 and consumer.message_count >= 2200
        assert len(consumer.link.session.unsettled) <= 1100   # the timed-out first deliveries went


async def test_a_timed_out_delivery_sent_again_gets_its_own_tag_and_its_late_outcome_is_stale(tmp_path):
    async with gateway(tmp_path, msg_timeout=1.0) as nsqd:
        put(nsqd, "t", "c", [b"x"])
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(10)
        got = []
        with trio.fail_after(5):
            while len(got) < 2:   # the first copy, then the same message again after its timeout
                await client.flush()
                await client.read()
                got += client.deliveries(link)
        (first_id, first_tag, _, _), (second_id, second_tag, _, _) = got
        assert first_tag != second_tag   # unique among the link's unsettled deliveries (spec 2.6.12)
        assert second_tag == first_tag + b"#1" and len(first_tag) == 16
        channel = nsqd.topics["t"].channels["c"]
        link.settle([first_id], p.Released())   # a late outcome for the copy that timed out
        await client.for_a_while(0.1)
        assert channel.in_flight_count == 1 and not client.deliveries(link)   # the live copy stays put
        link.settle([second_id], p.Accepted())
        await client.flush()
        await eventually(lambda: channel.in_flight_count == 0)
        (consumer,) = consumers(channel)
        assert consumer.finish_count == 1 and channel.depth == 0


async def test_messages_in_flight_at_a_crash_come_back_as_failed_deliveries(tmp_path):
    """A SIGKILL took the deliveries a client held unsettled: as from a consumer gone (spec 3.2.1),
    they come back counted in delivery-count and not first-acquired (as of the last checkpoint)."""
    amqp_port = free_port()
    args = ("--mem-queue-size=0", "--sync-timeout=100ms", f"--amqp-address=127.0.0.1:{amqp_port}")
    daemon = Daemon(tmp_path, *args)
    try:
        await daemon.wait_ready()
        client = await Client.connect(amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        publisher = await NSQConnection.open(daemon.port)
        await publisher.mpub("t", [b"%d" % i for i in range(5)])
        link.flow(5)
        await client.until(lambda: sum(len(e.deliveries) for e in client.events if isinstance(e, ev.Transfers)) == 5)
        first = client.deliveries(link)
        assert all((decode_message(d[3]).header or Header()).first_acquirer for d in first)
        await trio.sleep(0.5)   # a checkpoint notes them in flight
    finally:
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
    daemon = Daemon(tmp_path, *args)
    try:
        await daemon.wait_ready()
        client = await Client.connect(amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(5)
        await client.until(lambda: sum(len(e.deliveries) for e in client.events if isinstance(e, ev.Transfers)) == 5)
        again = client.deliveries(link)
        assert sorted(body_of(d) for d in again) == [b"%d" % i for i in range(5)]
        headers = [decode_message(d[3]).header or Header() for d in again]
        assert all(h.delivery_count == 1 and not h.first_acquirer for h in headers)
    finally:
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()


async def test_a_late_accept_on_another_link_leaves_the_current_copys_counts_alone(tmp_path):
    """A's accept of its timed-out copy finishes nothing (B holds the message now), and must not
    wipe the message's failed count: B's release of its copy then still counts."""
    async with gateway(tmp_path, msg_timeout=1.0) as nsqd:
        put(nsqd, "t", "c", [b"x", b"z"])
        first = await Client.connect(nsqd.amqp_port)
        a = await first.attach(p.RECEIVER, "/topics/t/channels/c", name="A")
        a.flow(2)
        await first.until(lambda: sum(len(e.deliveries) for e in first.events if isinstance(e, ev.Transfers)) == 2)
        got_a = first.deliveries(a)
        second = await Client.connect(nsqd.amqp_port)
        b = await second.attach(p.RECEIVER, "/topics/t/channels/c", name="B")
        b.flow(2)   # both time out at A and come to B
        await second.until(lambda: sum(len(e.deliveries) for e in second.events if isinstance(e, ev.Transfers)) == 2,
                           timeout=5)
        got_b = second.deliveries(b)
        channel = nsqd.topics["t"].channels["c"]
        a.settle([got_a[0][0]], p.Accepted())
        await first.for_a_while(0.2)
        assert channel.in_flight_count == 2 and channel.failed   # B's copies stand, still counted
        current = next(d for d in got_b if d[1][:16] == got_a[0][1][:16])
        b.settle([current[0]], p.Released())
        await second.for_a_while(0.2)
        assert channel.requeue_count == 1 and channel.in_flight_count <= 2


# ------------------------------------------------------------ lifecycle
async def test_connection_loss_requeues_in_order(tmp_path):
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [b"%d" % i for i in range(5)])
        first = await Client.connect(nsqd.amqp_port)
        link = await first.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(5)
        await first.until(lambda: sum(len(e.deliveries) for e in first.events if isinstance(e, ev.Transfers)) == 5)
        before = [d[1] for d in first.deliveries(link)]
        await first.aclose()   # no detach, no close: the socket just goes
        channel = nsqd.topics["t"].channels["c"]
        await eventually(lambda: not channel.subscriptions and channel.depth == 5)
        second = await Client.connect(nsqd.amqp_port)
        link = await second.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(5)
        await second.until(lambda: sum(len(e.deliveries) for e in second.events if isinstance(e, ev.Transfers)) == 5)
        again = second.deliveries(link)
        assert [d[1] for d in again] == [tag + b"#1" for tag in before]   # the same messages, in order
        # a consumer that went away holding them may have processed them: each comes back as a
        # failed delivery (spec 3.2.1; RabbitMQ's quorum queues count returned messages too)
        headers = [decode_message(d[3]).header for d in again]
        assert all(h.delivery_count == 1 and not h.first_acquirer for h in headers)


async def test_deleted_channel_detaches_its_consumers(tmp_path):
    async with gateway(tmp_path) as nsqd:
        nsqd.get_topic("t").get_channel("c")
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        other = await client.attach(p.SENDER, "/topics/t")
        nsqd.delete_channel(nsqd.topics["t"], "c")
        await client.until(lambda: client.take(ev.LinkDetached, link) or link.detach_received)
        assert link.detach_received
        assert [type(s).__name__ for s in await client.publish(other, [b"still here"])] == ["Accepted"]


@pytest.fixture
def short_idle_timeouts(monkeypatch):
    """Idle timeouts in tenths of a second, below the 500 ms floor both engines keep to, for speed."""
    monkeypatch.setattr(amqp_connection, "MIN_PEER_IDLE_TIMEOUT_MS", 100)


async def test_idle_timeout_closes_a_silent_client_and_heartbeats_keep_ours(tmp_path, short_idle_timeouts):
    async with gateway(tmp_path, amqp_options={"idle_timeout": 0.3}) as nsqd:
        silent = await Client.connect(nsqd.amqp_port, begin=False)
        assert silent.conn.peer_idle_timeout == 0.3
        with trio.fail_after(3):
            while not silent.conn.finished:
                if not await silent.read():
                    break
        (closed,) = silent.take(ev.ConnectionClosed)
        assert closed.error.condition == "amqp:resource-limit-exceeded"

        chatty = await Client.connect(nsqd.amqp_port, begin=False, idle_timeout=0.2)
        raw = b""
        with trio.move_on_after(0.27):  # (it sends nothing itself, so it goes at 0.3 s too)
            while True:
                raw += await chatty.stream.receive_some(1 << 16)
        assert raw.count(EMPTY_FRAME) >= 2   # one every 100 ms: half its idle timeout


async def test_a_client_a_little_late_with_its_heartbeat_is_not_cut_off(tmp_path, short_idle_timeouts):
    """Spec 2.4.5: a peer SHOULD announce half its real idle threshold, so that a frame the other
    side sends at the announced interval, delayed on the way, arrives in time. A client whose empty
    frames come every 1.2 announced intervals stays connected; a silent one is closed."""
    async with gateway(tmp_path, amqp_options={"idle_timeout": 0.3}) as nsqd:
        late = await Client.connect(nsqd.amqp_port, begin=False)
        assert late.conn.peer_idle_timeout == 0.3
        for _ in range(5):
            await trio.sleep(0.36)
            await late.stream.send_all(EMPTY_FRAME)
        await late.for_a_while(0.05)
        assert not late.conn.finished and not late.take(ev.ConnectionClosed)


async def test_protocol_violation_closes_that_connection_only(tmp_path):
    async with gateway(tmp_path) as nsqd:
        bad = await Client.connect(nsqd.amqp_port)
        good = await Client.connect(nsqd.amqp_port)
        await bad.stream.send_all(encode_frame(0, b"\x00\x53\x13\xc0\x02\x01\xff"))
        await bad.until(lambda: bad.conn.finished)
        (closed,) = bad.take(ev.ConnectionClosed)
        assert closed.by_peer and closed.error.condition == "amqp:decode-error"
        await bad.stream.send_all(encode_frame(0, b"x" * 200_000))  # and then a frame far too big
        link = await good.attach(p.SENDER, "/topics/t")
        assert [type(s).__name__ for s in await good.publish(link, [b"ok"])] == ["Accepted"]


async def test_sasl_plain_goes_through_the_authenticate_hook(tmp_path):
    logins = []

    def authenticate(username: str, password: str) -> bool:
        logins.append(username)
        return password == "s3cret"

    async with gateway(tmp_path, amqp_options={"authenticate": authenticate}) as nsqd:
        ok = await Client.connect(nsqd.amqp_port, sasl=SaslClient("PLAIN", "app", "s3cret"))
        assert ok.conn.open_received
        refused = await Client.connect(nsqd.amqp_port, sasl=SaslClient("PLAIN", "app", "nope"))
        assert refused.conn.finished and not refused.conn.open_received
        assert refused.take(ev.ConnectionClosed)[0].error.condition == "amqp:unauthorized-access"
        anonymous = await Client.connect(nsqd.amqp_port, sasl=SaslClient())
        assert anonymous.conn.open_received
        assert logins == ["app", "app"]


async def test_with_auth_servers_configured_nothing_gets_in_unchecked(tmp_path):
    async with gateway(tmp_path, auth_http_addresses=["127.0.0.1:1"]) as nsqd:
        for options in ({}, {"sasl": SaslClient()}, {"sasl": SaslClient("PLAIN", "u", "p")}):
            client = await Client.connect(nsqd.amqp_port, **options)
            assert client.conn.finished and not client.conn.open_received, options


async def test_shutdown_stops_deliveries_then_closes_with_connection_forced(tmp_path):
    async with running_nsqd(tmp_path / "nsqd", amqp_address="127.0.0.1:0", shutdown_grace=0.3) as nsqd:
        put(nsqd, "t", "c", [b"a", b"b", b"c"])
        client = await Client.connect(nsqd.amqp_addresses[0][1])
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(2)
        await client.until(lambda: sum(len(e.deliveries) for e in client.events if isinstance(e, ev.Transfers)) == 2)
        link.flow(0, echo=True)
        await client.until(lambda: client.take(ev.LinkFlow, link))
        assert link.available == 1
        nsqd.request_shutdown()
        await client.until(lambda: client.conn.finished)
        assert client.take(ev.LinkFlow, link) and link.available == 0   # told while the daemon drained
        (closed,) = client.take(ev.ConnectionClosed)
        assert closed.error.condition == "amqp:connection:forced"


async def test_a_starved_publisher_is_woken_when_room_is_made_not_polled(tmp_path):
    async with gateway(tmp_path, channel_max_messages=10) as nsqd:
        nsqd.declare("full", "c")
        client = await Client.connect(nsqd.amqp_port)
        sender = await client.attach(p.SENDER, "/topics/full")
        await client.until(lambda: sender.credit > 0)
        assert sender.credit == 10  # the room the limit leaves
        for i in range(10):
            sender.send_transfers([b"t%d" % i], [encode_message(Message(body=[Data(b"%d" % i)]))], False)
        await client.flush()
        await client.for_a_while(0.2)
        assert sender.credit == 0 and nsqd.topics["full"].channels["c"].depth == 10
        nsqd.topics["full"].channels["c"].drop_oldest(5)  # room for five
        with trio.fail_after(0.5):  # well before the POLL_INTERVAL safety net (1 s)
            while sender.credit == 0:
                await client.read()
        assert sender.credit == 5


# ------------------------------------------------------------ wake-ups
async def test_a_link_whose_credit_went_to_0_does_not_keep_a_message_from_an_idle_nsq_consumer(tmp_path):
    """An AMQP link waited for messages with credit, then its peer set the credit to 0; an
    NSQ consumer with RDY 1 waits behind it. The next message is the NSQ consumer's at once."""
    async with gateway(tmp_path) as nsqd:
        nsqd.declare("t", "c")
        client = await Client.connect(nsqd.amqp_port)
        link = await client.attach(p.RECEIVER, "/topics/t/channels/c")
        link.flow(1, echo=True)
        await client.until(lambda: client.take(ev.LinkFlow, link))   # it asked and got nothing: hungry
        idle = await NSQConnection.open(tcp_port(nsqd))
        await idle.sub("t", "c")
        await idle.command("RDY 1")
        await idle.send(pub_command("elsewhere", b"-"))
        await idle.expect_response()  # answered after RDY 1 ran: hungry too
        link.flow(0, echo=True)
        await client.until(lambda: client.take(ev.LinkFlow, link))   # credit 0 is in force
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.pub("t", b"x")
        assert (await idle.read_message(timeout=3)).body == b"x"
        assert not client.deliveries(link)


async def test_a_link_whose_credit_went_to_0_does_not_keep_a_message_from_an_idle_link(tmp_path):
    """The same with two AMQP links on two connections: the one that still has credit gets it."""
    async with gateway(tmp_path) as nsqd:
        nsqd.declare("t", "c")
        stopped_client = await Client.connect(nsqd.amqp_port)
        stopped = await stopped_client.attach(p.RECEIVER, "/topics/t/channels/c")
        stopped.flow(1, echo=True)
        await stopped_client.until(lambda: stopped_client.take(ev.LinkFlow, stopped))
        idle_client = await Client.connect(nsqd.amqp_port)
        idle = await idle_client.attach(p.RECEIVER, "/topics/t/channels/c")
        idle.flow(1, echo=True)
        await idle_client.until(lambda: idle_client.take(ev.LinkFlow, idle))
        stopped.flow(0, echo=True)
        await stopped_client.until(lambda: stopped_client.take(ev.LinkFlow, stopped))
        publisher = await NSQConnection.open(tcp_port(nsqd))
        await publisher.pub("t", b"x")
        await idle_client.until(lambda: any(isinstance(e, ev.Transfers) for e in idle_client.events), timeout=3)
        assert [body_of(d) for d in idle_client.deliveries(idle)] == [b"x"]


# ------------------------------------------------------------ settlement modes
def record_dispositions(session) -> list:
    """The dispositions the gateway sends on ``session``, recorded before the engine handles them."""
    seen: list = []
    handle = session.on_disposition

    def on_disposition(disposition, events):
        seen.append(disposition)
        handle(disposition, events)

    session.on_disposition = on_disposition
    return seen


async def test_rcv_settle_mode_second_consuming_our_settlement_follows_the_clients_outcome(tmp_path):
    """Spec 2.8.3 and 3.4: under rcv-settle-mode second the receiver sends its outcome unsettled and
    settles only once the sender has settled. The receiver's mode is the link's: we take it, and
    answer the outcome with a settled disposition."""
    async with gateway(tmp_path) as nsqd:
        put(nsqd, "t", "c", [b"a"])
        client = await Client.connect(nsqd.amqp_port)
        seen = record_dispositions(client.session)
        link = client.session.attach("second", p.RECEIVER)
        link.attach(p.Source("/topics/t/channels/c"), p.Target(), snd_settle_mode=p.SND_UNSETTLED,
                    rcv_settle_mode=p.RCV_SECOND)
        await client.until(lambda: link.attach_received)
        assert link.remote_attach.source is not None and link.remote_attach.rcv_settle_mode == p.RCV_SECOND
        link.flow(1)
        await client.until(lambda: any(isinstance(e, ev.Transfers) for e in client.events))
        ((did, _tag, settled, _payload),) = client.deliveries(link)
        assert not settled
        client.session.send(p.Disposition(p.RECEIVER, did, did, False, p.Accepted()))
        await client.until(lambda: seen)
        assert [(d.role, d.first, d.settled, type(d.state)) for d in seen] == [(p.SENDER, did, True, p.Accepted)]
        channel = nsqd.topics["t"].channels["c"]
        assert channel.in_flight_count == 0 and not link.detach_received


async def test_rcv_settle_mode_second_publishing_is_answered_first_and_settled(tmp_path):
    """Spec 2.7.3: the receiver states its rcv-settle-mode. A publisher asking for second gets
    first and a settled accepted: Azure's pyamqp sender asks for second and waited for a settled
    outcome until its send timed out (the message stored; a retry duplicated it)."""
    async with gateway(tmp_path) as nsqd:
        nsqd.declare("t", "c")
        client = await Client.connect(nsqd.amqp_port)
        seen = record_dispositions(client.session)
        link = client.session.attach("second", p.SENDER)
        link.attach(p.Source(), p.Target("/topics/t"), snd_settle_mode=p.SND_UNSETTLED, rcv_settle_mode=p.RCV_SECOND)
        await client.until(lambda: link.attach_received and link.credit)
        assert link.remote_attach.target is not None and link.remote_attach.rcv_settle_mode == p.RCV_FIRST
        assert await client.publish(link, [b"x"]) == [p.Accepted()]
        assert [(d.role, d.settled) for d in seen] == [(p.RECEIVER, True)]
        await client.for_a_while(0.1)
        assert nsqd.topics["t"].channels["c"].depth == 1 and not client.conn.finished


# ------------------------------------------------------------ termini we lack
async def refused_with(client: Client, role: bool, source, target) -> p.Error:
    """Attach a link with these termini; the error of the detach that refuses it (after a null node)."""
    link = client.session.attach(f"refused-{len(client.session.by_handle)}", role)
    link.attach(source, target)
    await client.until(lambda: link.detach_received)
    (detached,) = client.take(ev.LinkDetached, link)
    remote = link.remote_attach
    assert (remote.source if role is p.RECEIVER else remote.target) is None
    return detached.error


async def test_dynamic_nodes_and_coordinators_are_refused_as_not_implemented(tmp_path):
    """Spec 3.5.3/3.5.4: a dynamic source or target asks us to create a node, and a coordinator
    target (4.5) asks for transactions: functions we lack, refused with amqp:not-implemented.
    A dynamic node that also names an address is malformed (3.5.3: "the address field MUST NOT
    be set"): amqp:invalid-field. The connection carries on."""
    async with gateway(tmp_path) as nsqd:
        client = await Client.connect(nsqd.amqp_port)
        coordinator = codec.Described(codec.ULong(0x30), [])
        cases = [
            (p.RECEIVER, p.Source(dynamic=True), p.Target(), "amqp:not-implemented"),
            (p.SENDER, p.Source(), p.Target(dynamic=True), "amqp:not-implemented"),
            (p.SENDER, p.Source(), coordinator, "amqp:not-implemented"),
            (p.RECEIVER, p.Source("/topics/t/channels/c", dynamic=True), p.Target(), "amqp:invalid-field"),
            (p.SENDER, p.Source(), None, "amqp:invalid-field"),
        ]
        for role, source, target, condition in cases:
            assert (await refused_with(client, role, source, target)).condition == condition, (source, target)
        link = await client.attach(p.SENDER, "/topics/t")
        assert await client.publish(link, [b"fine"]) == [p.Accepted()]



async def test_a_sender_starved_by_the_disk_budget_gets_credit_once_it_is_freed(tmp_path):
    """Without heartbeats nothing else wakes the connection: the disk budget is sampled, and no
    event says it was freed, so the starved link must be looked at again on its own."""
    async with gateway(tmp_path, max_disk_bytes=2000, mem_queue_size=0) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.mpub("t", [b"x" * 100] * 20)  # about 2.8 kB on disk
        await trio.sleep(0.15)  # the budget is sampled every 100 ms
        client = await Client.connect(nsqd.amqp_port)  # no idle-time-out: no heartbeats
        sender = await client.attach(p.SENDER, "/topics/other")
        await client.for_a_while(0.3)
        assert sender.credit == 0
        await conn.command("RDY 20")
        for _ in range(20):
            msg = await conn.read_message()
            await conn.command(b"FIN " + msg.id)
        await client.until(lambda: sender.credit > 0, timeout=3 * POLL_INTERVAL)
