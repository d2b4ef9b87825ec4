"""What nsqd tells nsqlookupd and when, checked against Go nsqd's lookup loop."""

import trio
import trio.testing

from nsqd import lookup

from .support import running_nsqd
from .test_lookup import Lookupd


def lookupd_address(lookupd: Lookupd) -> list[str]:
    return [f"127.0.0.1:{lookupd.port}"]


async def test_reconnect_registers_channels_and_only_channelless_topics(tmp_path):
    """After IDENTIFY, nsqd's connect callback sends REGISTER topic channel for each
    channel, and REGISTER topic only for a topic that has no channels."""
    lookupd = Lookupd()
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.serve)
        async with running_nsqd(tmp_path) as nsqd:
            nsqd.get_topic("a").get_channel("x")
            nsqd.get_topic("a").get_channel("y")
            nsqd.get_topic("b")
            nsqd.set_option("lookupd_tcp_addresses", lookupd_address(lookupd))
            await lookupd.wait_for(lambda: {("a", "x"), ("a", "y"), ("b", "")} <= lookupd.registrations)
            nsqd.get_topic("c")  # answered after anything else queued on the connection
            await lookupd.wait_for(lambda: ("c", "") in lookupd.registrations)
            assert lookupd.commands[0] == "IDENTIFY"
            assert sorted(lookupd.commands[1:4]) == ["REGISTER a x", "REGISTER a y", "REGISTER b"]
            assert lookupd.commands[4:] == ["REGISTER c"]
        nursery.cancel_scope.cancel()


class RefusingLookupd(Lookupd):
    """Hangs up on every connection while ``refusing`` is set."""

    refusing = True

    async def handle(self, stream):
        if not self.refusing:
            return await super().handle(stream)
        self.connections += 1
        await stream.aclose()
        self.changed.set()
        self.changed = trio.Event()


async def test_a_new_topic_reconnects_at_once_while_lookupd_is_unreachable(tmp_path):
    """nsqd's lookup peer connects for the command announcing a new topic, so nsqlookupd
    learns of it as soon as it is back, whatever the wait between reconnections."""
    lookupd = RefusingLookupd()
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.serve)
        async with running_nsqd(tmp_path, lookupd_tcp_addresses=lookupd_address(lookupd)) as nsqd:
            await lookupd.wait_for(lambda: lookupd.connections == 2)  # now waiting 2 s to reconnect
            lookupd.refusing = False
            nsqd.get_topic("orders")
            await lookupd.wait_for(lambda: ("orders", "") in lookupd.registrations, timeout=1.5)
        nursery.cancel_scope.cancel()


async def test_an_unanswered_identify_is_given_up_after_a_second(tmp_path):
    """nsqd's lookup peer reads with a one-second deadline and closes the connection
    when nsqlookupd does not answer in time."""
    hung_up_after = []
    hung_up = trio.Event()

    async def silent(stream):
        start = trio.current_time()
        while await stream.receive_some(4096):
            pass
        hung_up_after.append(trio.current_time() - start)
        hung_up.set()

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, silent, listeners)
        port = listeners[0].socket.getsockname()[1]
        async with running_nsqd(tmp_path, lookupd_tcp_addresses=[f"127.0.0.1:{port}"]):
            with trio.fail_after(3):
                await hung_up.wait()
        nursery.cancel_scope.cancel()
    assert 0.9 <= hung_up_after[0] < 2


async def _connected(nsqd, lookupd) -> None:
    """nsqd has identified to the HTTP-serving test nsqlookupd (so it knows its HTTP address)."""
    nsqd.set_option("lookupd_tcp_addresses", [f"127.0.0.1:{lookupd.tcp_port}"])
    await lookupd.wait_for(lambda: lookupd.producers)
    with trio.fail_after(5):
        while not nsqd.lookupd_http_addresses():
            await trio.sleep(0.01)


async def test_a_new_topic_starts_with_the_channels_nsqlookupd_knows(tmp_path):
    """As nsqd's GetTopic: the channels other nsqds registered for the topic (not #ephemeral ones)
    are created before the topic hands out its first message, so each gets it."""
    from .lookupd import NSQLookupd, Producer

    lookupd = NSQLookupd()
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.serve)
        lookupd.producers[-1] = Producer("10.0.0.9:4150", {}, {("t", ""), ("t", "a"), ("t", "b"),
                                                                 ("t", "e#ephemeral"), ("other", "x")})
        async with running_nsqd(tmp_path) as nsqd:
            await _connected(nsqd, lookupd)
            nsqd.publish("t", [b"first"])
            topic = nsqd.topics["t"]
            with trio.fail_after(5):
                while topic.starting:
                    await trio.sleep(0.01)
            assert sorted(topic.channels) == ["a", "b"]
            assert [c.depth for c in topic.channels.values()] == [1, 1]
            assert any(target.startswith("/channels?topic=t") for target in lookupd.requests)
            nsqd.publish("u", [b"a topic nobody registered starts with no channel"])
            with trio.fail_after(5):
                while nsqd.topics["u"].starting:
                    await trio.sleep(0.01)
            assert nsqd.topics["u"].channels == {}
        nursery.cancel_scope.cancel()


async def test_a_new_topic_takes_at_most_1024_channels_from_nsqlookupd_and_serves_everyone_meanwhile(tmp_path):
    """110,000 channel names (900 KB, under the reply's cap) made as many disk queues in one go:
    the event loop was held for 23 minutes and the daemon grew to 1.6 GB."""
    from nsqd.broker import LOOKUPD_CHANNELS

    from .lookupd import NSQLookupd, Producer
    from .support import NSQConnection, tcp_port

    lookupd = NSQLookupd()
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.serve)
        names = {("t", "c%05d" % i) for i in range(LOOKUPD_CHANNELS + 500)}
        lookupd.producers[-1] = Producer("10.0.0.9:4150", {}, names)
        async with running_nsqd(tmp_path) as nsqd:
            await _connected(nsqd, lookupd)
            conn = await NSQConnection.open(tcp_port(nsqd))
            await conn.pub("t", b"first")
            topic = nsqd.topics["t"]
            answers = 0
            with trio.fail_after(60):
                while topic.starting:  # another client is answered while the channels are made
                    await conn.pub("other", b"x")
                    answers += 1
            assert answers > 1
            assert len(topic.channels) == LOOKUPD_CHANNELS
            assert sorted(topic.channels)[-1] == "c%05d" % (LOOKUPD_CHANNELS - 1)
            assert all(channel.depth == 1 for channel in topic.channels.values())
        nursery.cancel_scope.cancel()


async def test_a_new_topic_starts_without_channels_when_nsqlookupd_does_not_answer(tmp_path):
    """A lookupd whose HTTP port refuses: the query is logged and skipped, and the topic starts
    (a consumer that subscribed meanwhile gets what was published)."""
    from .lookupd import NSQLookupd
    from .support import NSQConnection, tcp_port

    lookupd = NSQLookupd()
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.serve)
        with trio.socket.socket() as unused:
            await unused.bind(("127.0.0.1", 0))
            lookupd.http_port = unused.getsockname()[1]  # what IDENTIFY's answer names: nothing listens
        async with running_nsqd(tmp_path) as nsqd:
            await _connected(nsqd, lookupd)
            consumer = await NSQConnection.open(tcp_port(nsqd))
            await consumer.sub("t", "c")
            await consumer.command("RDY 1")
            nsqd.publish("t", [b"kept, then handed on"])
            msg = await consumer.read_message()
            assert msg.body == b"kept, then handed on"
            assert not nsqd.topics["t"].starting
        nursery.cancel_scope.cancel()


class FlakyLookupd(Lookupd):
    """Hangs up at once on the first ``refuse`` connections, then after answering IDENTIFY."""

    def __init__(self, refuse):
        super().__init__()
        self.refuse = refuse
        self.times: list[float] = []

    async def handle(self, stream):
        self.times.append(trio.current_time())
        if len(self.times) > self.refuse:
            with trio.move_on_after(0.05):  # IDENTIFY answered, then the connection drops
                await super().handle(stream)
        else:
            self.connections += 1
        await stream.aclose()
        self.changed.set()
        self.changed = trio.Event()


async def test_a_session_that_identified_starts_the_backoff_afresh(tmp_path, monkeypatch):
    """Failures in a row double the wait; a session that was up (IDENTIFY answered) and then
    dropped is retried after the first wait again, not after the doubled one."""
    monkeypatch.setattr(lookup, "FIRST_BACKOFF", 0.1)
    lookupd = FlakyLookupd(refuse=4)  # waits 0.1, 0.2, 0.4, 0.8 after these
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.serve)
        async with running_nsqd(tmp_path, lookupd_tcp_addresses=lookupd_address(lookupd)):
            await lookupd.wait_for(lambda: lookupd.connections == 6, timeout=10)
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in zip(lookupd.times, lookupd.times[1:])]
    assert gaps[3] > 0.7  # the fourth failure in a row: 0.8 s
    assert lookupd.identify is not None
    assert gaps[4] < 0.5  # the fifth connection identified: back to 0.1 s (plus its 0.05 s)


async def _serve_raw(nursery, handler) -> int:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, handler, listeners)
    return listeners[0].socket.getsockname()[1]


async def test_an_identify_answer_that_is_no_object_is_refused_and_topics_still_start(tmp_path):
    """It was kept as the lookupd's info, and every new topic's start failed on it
    (E_PUB_FAILED internal error), even after that lookupd was gone."""
    import struct

    from .support import NSQConnection, tcp_port

    sessions = []

    async def odd(stream):
        sessions.append(stream)
        await stream.receive_some(4096)
        await stream.send_all(struct.pack(">i", 6) + b"[1, 2]")
        while await stream.receive_some(4096):
            pass

    async with trio.open_nursery() as nursery:
        port = await _serve_raw(nursery, odd)
        async with running_nsqd(tmp_path, lookupd_tcp_addresses=[f"127.0.0.1:{port}"]) as nsqd:
            with trio.fail_after(5):
                while not sessions:
                    await trio.sleep(0.01)
            await trio.sleep(0.2)
            conn = await NSQConnection.open(tcp_port(nsqd))
            await conn.pub("brand_new", b"x")
            assert nsqd.topics["brand_new"].message_count == 1
            with trio.fail_after(5):  # refused: the session ends and is tried again
                while len(sessions) < 2:
                    await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


async def test_a_lookupd_that_sends_what_nothing_asked_for_or_stops_reading_is_dropped(tmp_path):
    """Unasked-for frames were thrown away at every wake-up (each going over every registration:
    a core's worth at one a millisecond); a lookupd that stopped reading wedged the session."""
    import struct

    sessions = []

    async def chatty(stream):
        sessions.append(trio.current_time())
        await stream.receive_some(4096)
        await stream.send_all(struct.pack(">i", 2) + b"{}")
        try:
            while True:
                await trio.sleep(0.01)
                await stream.send_all(struct.pack(">i", 2) + b"OK")
        except trio.BrokenResourceError:
            pass

    async with trio.open_nursery() as nursery:
        port = await _serve_raw(nursery, chatty)
        async with running_nsqd(tmp_path, lookupd_tcp_addresses=[f"127.0.0.1:{port}"]):
            with trio.fail_after(5):
                while len(sessions) < 2:
                    await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


async def test_a_write_to_lookupd_has_nsqds_one_second_deadline():
    """A lookupd that stops reading must fail the session, not wedge it."""
    start = trio.current_time()
    never_read = trio.testing.lockstep_stream_pair()[0]  # a send waits for a reader that never comes
    with trio.move_on_after(5):
        try:
            await lookup._write(never_read, b"REGISTER t\n")
        except trio.TooSlowError:
            pass
    assert 0.9 <= trio.current_time() - start < 2


async def test_channel_queries_under_way_are_capped_and_the_rest_skipped():
    """Each is a connection: 1,000 new topics and 50 slow lookupds took 19,000 descriptors."""
    async def silent(stream):
        await trio.sleep_forever()

    finished = {}
    async with trio.open_nursery() as nursery:
        port = await _serve_raw(nursery, silent)
        limiter = trio.CapacityLimiter(1)
        start = trio.current_time()

        async def start_topic(name):
            await lookup.topic_channels([f"127.0.0.1:{port}"], name, connect_timeout=1, request_timeout=1,
                                        limiter=limiter)
            finished[name] = trio.current_time() - start

        async with trio.open_nursery() as topics:
            topics.start_soon(start_topic, "first")
            await trio.sleep(0.1)
            topics.start_soon(start_topic, "second")
        nursery.cancel_scope.cancel()
    assert finished["second"] < 0.5 and finished["first"] >= 0.9
    assert limiter.borrowed_tokens == 0
