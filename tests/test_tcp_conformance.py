"""TCP protocol V2 as Go nsqd's protocol_v2.go answers it: the order of its checks, its texts,
and when it closes the connection."""

import struct
from contextlib import asynccontextmanager

import pytest
import trio

from .support import FRAME_ERROR, NSQConnection, free_port, running_nsqd, tcp_port
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


CUT_SHORT = [
    (b"PUB t\n\x00\x00", "E_BAD_MESSAGE PUB failed to read message body size"),
    (b"PUB t\n\x00\x00\x00\x0aabc", "E_BAD_MESSAGE PUB failed to read message body"),
    (b"DPUB t 10\n\x00\x00\x00\x0aabc", "E_BAD_MESSAGE DPUB failed to read message body"),
    (b"IDENTIFY\n\x00\x00\x00", "E_BAD_BODY IDENTIFY failed to read body size"),
    (b"IDENTIFY\n\x00\x00\x00\x10{\"a\"", "E_BAD_BODY IDENTIFY failed to read body"),
    (b"AUTH\n\x00\x00\x00\x10sec", "E_BAD_BODY AUTH failed to read body"),
    (b"MPUB t\n\x00\x00", "E_BAD_BODY MPUB failed to read body size"),
    (b"MPUB t\n\x00\x00\x00\x20\x00\x00", "E_BAD_BODY MPUB failed to read message count"),
    (b"MPUB t\n\x00\x00\x00\x20\x00\x00\x00\x00", "E_BAD_BODY MPUB invalid message count 0"),
    (b"MPUB t\n\x00\x00\x00\x20\x00\x00\x00\x02", "E_BAD_MESSAGE MPUB failed to read message(0) body size"),
    (b"MPUB t\n\x00\x00\x00\x20\x00\x00\x00\x02\x00\x00\x00\x01a\x00\x00",
     "E_BAD_MESSAGE MPUB failed to read message(1) body size"),
    (b"MPUB t\n\x00\x00\x00\x20\x00\x00\x00\x02\x00\x00\x00\x01a\x00\x00\x00\x00",
     "E_BAD_MESSAGE MPUB invalid message(1) body size 0"),
    (b"MPUB t\n\x00\x00\x00\x20\x00\x00\x00\x02\x00\x00\x00\x01a\x00\x00\x00\x05ab",
     "E_BAD_MESSAGE MPUB failed to read message body"),
]


@pytest.mark.parametrize("data,error", CUT_SHORT, ids=[e.split(" ", 1)[1] for _, e in CUT_SHORT])
@pytest.mark.parametrize("how", ["half-close", "read deadline"])
async def test_a_body_cut_short_gets_the_error_nsqd_sends_for_what_it_failed_to_read(tmp_path, data, error, how):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        if how == "read deadline":
            await conn.identify(heartbeat_interval=1000)
        await conn.send(data)
        if how == "half-close":
            await conn.stream.send_eof()
        while True:  # heartbeats go unanswered: a NOP would be read as the body's next bytes
            kind, frame = await conn.read_frame(timeout=5)
            if frame != b"_heartbeat_":
                break
        assert (kind, frame) == (FRAME_ERROR, error.encode())
        assert (await conn.stream.receive_some(100)) == b""
        assert "t" not in nsqd.topics


async def test_identify_keys_match_their_fields_in_any_letter_case_as_gos_json_does(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("IDENTIFY", b'{"FEATURE_NEGOTIATION":true,"HEARTBEAT_INTERVAL":5}')
        await conn.expect_error("E_BAD_BODY IDENTIFY heartbeat interval (5) is invalid")
        await conn.expect_closed()
        conn = await NSQConnection.open(tcp_port(nsqd))
        # the exact name wins over a folded one; the last key given for a field wins; null changes nothing
        answer = await conn.identify(**{"Feature_Negotiation": True, "client_id": "exact", "CLIENT_ID": "folded",
                                        "Msg_Timeout": 5000, "msg_timeout": 6000, "MSG_TIMEOUT": None})
        assert answer["msg_timeout"] == 6000
        (client,) = nsqd.clients.values()
        assert client.client_id == "folded"


@pytest.mark.parametrize("body", [b'{"topology_zone":5}', b'{"leases":1}', b'{"Topology_Region":[1]}'])
async def test_identify_fields_nsqd_130_lacks_are_ignored_whatever_their_type(tmp_path, body):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("IDENTIFY", body)
        await conn.expect_response(b"OK")


async def test_error_texts_give_the_clients_bytes_back_as_they_came(tmp_path):
    """nsqd formats the command's raw bytes into its error texts, valid UTF-8 or not."""
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.send(b"FIN 0123456789abcde\xff\nRDY \xfe1\n")
        assert await conn.read_frame() == (FRAME_ERROR, b"E_FIN_FAILED FIN 0123456789abcde\xff failed ID not in flight")
        assert await conn.read_frame() == (FRAME_ERROR, b"E_INVALID RDY could not parse count \xfe1")
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.send(b"\xff\xfeX\n")
        assert await conn.read_frame() == (FRAME_ERROR, b"E_INVALID invalid command \xff\xfeX")
