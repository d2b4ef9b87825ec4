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
