"""TCP protocol V2 as Go nsqd's protocol_v2.go answers it: the order of its checks, its texts,
and when it closes the connection."""

from .support import NSQConnection, running_nsqd, tcp_port

#: ceil(2**64 / 1e6): as a Duration of milliseconds it wraps to 448,384 ns
WRAPPING_MS = 18446744073710


async def test_dpub_timeout_that_wraps_into_range_is_a_short_delay(tmp_path):
    """nsqd checks DPUB's Duration, which wraps at 64 bits, and defers by that Duration."""
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.identify()
        await conn.command(f"DPUB t {WRAPPING_MS}", b"x")
        await conn.expect_response()
        await conn.sub("t", "c")
        await conn.command("RDY 1")
        msg = await conn.read_message(timeout=2)
        assert msg.body == b"x"
