"""queueScanLoop: pool sizing, prompt timeouts and deferred release, dirty rescans."""

import trio

from nsqd import message
from nsqd.channel import Channel
from nsqd.queue_scan import pool_size_for, queue_scan_loop
from nsqd.options import Options

from .support import NSQConnection, running_nsqd, tcp_port
from .test_channel import chunk, fill, subscribe


class Daemon:
    """The three things the scan loop reads from the daemon (unit-test stand-in)."""

    def __init__(self, options):
        self.options = options
        self.list = []
        self.channels_version = 0

    def channels(self):
        return list(self.list)

    def now_ns(self):
        return int(trio.current_time() * 1e9)

    def add_channels(self, n):
        for i in range(n):
            self.list.append(Channel("t", f"c{len(self.list)}", mem_queue_size=100, backend=None))


def test_pool_size_rule():
    assert [pool_size_for(n, 4) for n in (0, 1, 4, 7, 8, 12, 16, 100)] == [1, 1, 1, 1, 2, 3, 4, 4]
    assert pool_size_for(100, 2) == 2


async def test_pool_follows_channel_count_on_refresh(autojump_clock):
    daemon = Daemon(Options(queue_scan_refresh_interval=5.0))
    daemon.add_channels(2)
    async with trio.open_nursery() as nursery:
        pool = await nursery.start(queue_scan_loop, daemon)
        assert pool.size == 1
        daemon.add_channels(10)  # 12 channels: 3 workers, but only at the next refresh
        await trio.sleep(1)
        assert pool.size == 1
        await trio.sleep(5)
        assert pool.size == 3
        daemon.add_channels(30)
        daemon.channels_version += 1  # a change of channels refreshes at the next scan
        await trio.sleep(0.2)
        assert pool.size == 4
        del daemon.list[3:]
        daemon.channels_version += 1
        await trio.sleep(0.2)
        assert pool.size == 1
        nursery.cancel_scope.cancel()


async def test_timeouts_and_deferreds_across_many_channels(autojump_clock):
    daemon = Daemon(Options())
    daemon.add_channels(200)
    for i, channel in enumerate(daemon.list):
        sub, _ = subscribe(channel, rdy=5, timeout=1_000_000_000)
        channel.put_chunk(*chunk(5, start=i * 10))
        fill(sub, daemon.now_ns())
        msg_id = b"%016x" % (i * 10 + 9)
        channel.commit_put(channel.prepare_put([msg_id], [message.encode_frame(msg_id, b"d", 0)], False,
                                               due_ns=daemon.now_ns() + 2_000_000_000))
    async with trio.open_nursery() as nursery:
        await nursery.start(queue_scan_loop, daemon)
        # The first scan after the deadline finds every sample dirty and rescans at
        # once until no more than 25% of a sample is dirty: most channels are done
        # within that one interval, the rest as random samples reach them.
        await trio.sleep(1.15)
        timed_out = sum(c.timeout_count for c in daemon.list)
        assert timed_out >= 0.4 * 1000  # without rescans one interval would find ~100
        assert all(c.deferred_count == 1 for c in daemon.list)
        await trio.sleep(25)
        assert all(c.in_flight_count == 0 for c in daemon.list)
        assert sum(c.timeout_count for c in daemon.list) == 1000
        assert all(c.deferred_count == 0 and c.depth == 6 for c in daemon.list)
        nursery.cancel_scope.cancel()


async def test_idle_channels_are_sampled_not_swept(autojump_clock):
    """With nothing dirty the loop does one sample of 20 per interval, not all channels."""
    daemon = Daemon(Options())
    daemon.add_channels(100)
    calls = []
    for channel in daemon.list:
        original = channel.process_in_flight
        channel.process_in_flight = lambda now, o=original, c=channel: calls.append(c) or o(now)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue_scan_loop, daemon)
        await trio.sleep(1.05)
        nursery.cancel_scope.cancel()
    assert len(calls) == 10 * 20


async def test_many_real_channels_time_out_over_tcp(tmp_path):
    async with running_nsqd(tmp_path, queue_scan_interval=0.05) as nsqd:
        conns = []
        for i in range(24):
            conn = await NSQConnection.open(tcp_port(nsqd))
            await conn.identify(msg_timeout=1000)
            await conn.sub("t", f"c{i}")
            await conn.command("RDY 1")
            conns.append(conn)
        await conns[0].pub("t", b"x")
        firsts = [await c.read_message() for c in conns]
        assert all(m.attempts == 1 for m in firsts)
        start = trio.current_time()
        seconds = [await c.read_message(timeout=3) for c in conns]
        assert all(m.attempts == 2 for m in seconds)
        assert trio.current_time() - start < 2.0
        assert nsqd.queue_scan_pool.size == pool_size_for(24, 4) == 4
