"""What nsqd tells nsqlookupd and when, checked against Go nsqd's lookup loop."""

import trio

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
