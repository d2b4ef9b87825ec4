"""TCP protocol V2 as Go nsqd's protocol_v2.go answers it: the order of its checks, its texts,
and when it closes the connection."""

import struct
from contextlib import asynccontextmanager

import pytest
import trio

from .support import NSQConnection, free_port, running_nsqd, tcp_port
from .test_parity import AuthServer, ca, certs, grant  # noqa: F401 (ca and certs: fixtures)

#: ceil(2**64 / 1e6): as a Duration of milliseconds it wraps to 448,384 ns
WRAPPING_MS = 18446744073710


async def expect_nothing_then_closed(conn: NSQConnection) -> None:
    """nsqd drops a connection whose read failed without writing an error frame."""
    with trio.fail_after(5):
        try:
            chunk = await conn.stream.receive_some(65536)
        except trio.BrokenResourceError:
            return
    assert chunk == b"", chunk


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


@pytest.mark.parametrize("line,body,name", [
    (b"BOGUS", None, "BOGUS"),
    (b"PUB bad!topic", None, "PUB"),
    (b"PUB t", None, "PUB"),  # answered at once: no body is waited for
    (b"MPUB t", b"\x00\x00\x00\x00", "MPUB"),
    (b"DPUB t notanumber", None, "DPUB"),
    (b"AUTH x", None, "AUTH"),
])
async def test_tls_required_is_checked_before_the_command_is_looked_at(tmp_path, certs, line, body, name):  # noqa: F811
    async with running_nsqd(tmp_path / "d", tls_cert=certs["tls_cert"], tls_key=certs["tls_key"],
                            tls_required=2) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command(line, body)
        await conn.expect_error(f"E_INVALID cannot {name} in current state (TLS required)")
        await conn.expect_closed()


@pytest.mark.parametrize("size", [None, 0, 10_000_000])
async def test_identify_after_sub_is_refused_before_its_body_is_read(tmp_path, size):
    """nsqd checks IDENTIFY's state first and reads no body then."""
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.send(b"IDENTIFY\n" + (b"" if size is None else struct.pack(">i", size)))
        data = await conn.expect_error("E_INVALID")
        assert data == b"E_INVALID cannot IDENTIFY in current state"
        await conn.expect_closed()


async def test_mpub_is_authorized_before_its_body_is_read(tmp_path):
    """nsqd's MPUB (unlike PUB and DPUB) checks auth before it reads the body."""
    async with running_nsqd(tmp_path, auth_http_addresses=[f"127.0.0.1:{free_port()}"]) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.send(b"MPUB t\n")
        await conn.expect_error("E_AUTH_FIRST AUTH required before MPUB")
        await conn.expect_closed()
        other = await NSQConnection.open(tcp_port(nsqd))
        await other.send(b"MPUB t\n" + struct.pack(">i", 0))
        assert await other.expect_error("E_") == b"E_AUTH_FIRST AUTH required before MPUB"


@asynccontextmanager
async def publishing_to_orders(tmp_path):
    """The daemon asking an auth server that grants secret ``s`` publishing to ``orders`` only."""
    server = AuthServer({"s": grant("^orders$", [".*"], ["publish"])})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path, auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            yield nsqd
        nursery.cancel_scope.cancel()


async def test_mpub_to_a_topic_not_granted_is_refused_before_its_body(tmp_path):
    async with publishing_to_orders(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("AUTH", b"s")
        await conn.read_frame()
        await conn.send(b"MPUB other\n")
        await conn.expect_error('E_UNAUTHORIZED AUTH failed for MPUB on "other" ""')
        await conn.expect_closed()


async def test_identify_pipelined_after_sub_sees_the_subscribed_state(tmp_path):
    """Commands sent in one write run in order: the SUB before the IDENTIFY has taken effect."""
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.send(b"SUB t c\nIDENTIFY\n" + struct.pack(">i", 0))
        await conn.expect_response()
        assert await conn.expect_error("E_") == b"E_INVALID cannot IDENTIFY in current state"
        await conn.expect_closed()


async def test_mpub_pipelined_after_auth_is_authorized_by_it(tmp_path):
    """MPUB's authorization is looked at once the AUTH sent before it in the same write is done."""
    async with publishing_to_orders(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.send(b"AUTH\n" + struct.pack(">i", 1) + b"s" + b"MPUB orders\n" + struct.pack(">i", 9)
                        + struct.pack(">ii", 1, 1) + b"x")
        await conn.read_frame()
        await conn.expect_response()
        assert nsqd.topics["orders"].message_count == 1


@pytest.mark.parametrize("length,accepted", [(16383, True), (16384, False)])
async def test_a_command_line_must_fit_nsqds_16_kib_read_buffer(tmp_path, length, accepted):
    """nsqd reads a line with a 16 KiB bufio.Reader, newline included; a longer one is a
    read error: the connection is closed without an error frame."""
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.send(b"NOP " + b"x" * (length - 4) + b"\n")
        if accepted:
            await conn.pub("t", b"still open")
        else:
            await expect_nothing_then_closed(conn)


async def test_a_line_without_newline_past_16_kib_closes_without_a_frame(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.pub("t", b"first")
        await conn.send(b"x" * 20_000)
        await expect_nothing_then_closed(conn)
        assert nsqd.topics["t"].message_count == 1


async def test_identify_with_a_lone_surrogate_escape_reads_it_as_the_replacement_character(tmp_path):
    """Go's JSON decoder turns a lone ``\\ud800`` escape into U+FFFD; the client stays connected, and
    its names can be logged and shown in /stats."""
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("IDENTIFY", b'{"user_agent":"x\\ud800y","client_id":"\\udc00"}')
        await conn.expect_response()
        await conn.pub("t", b"still connected")
        (client,) = nsqd.clients.values()
        assert (client.user_agent, client.client_id) == ("x\ufffdy", "\ufffd")
        assert (client.user_agent + client.client_id).encode("utf-8")
