"""Absurd numbers, JSON and command lines on NSQ protocol V2: each gets nsqd's own error
frame, after every response owed before it, and never a traceback in the log."""

from __future__ import annotations

import json
import struct

import pytest
import trio
from structlog.testing import capture_logs

from .support import FRAME_ERROR, FRAME_RESPONSE, NSQConnection, running_nsqd, tcp_port

OK = (FRAME_RESPONSE, b"OK")
HUGE = b"9" * 5000  # past Python's int() digit limit; Go's ByteToBase10 wraps it to 2**64 - 1
PUB_OK = b"PUB owed\n" + struct.pack(">i", 1) + b"x"  # a command whose OK must arrive before the error
MID = b"0123456789abcdef"


def body(data: bytes) -> bytes:
    return struct.pack(">i", len(data)) + data


@pytest.fixture
def logs():
    """Every log event of the test; none may be a connection that failed with a traceback."""
    with capture_logs() as events:
        yield events
    failures = [e for e in events if e["event"] in ("connection failed", "AMQP connection failed")]
    assert not failures, failures


async def frames_until_closed(port: int, data: bytes) -> list[tuple[int, bytes]]:
    """Send ``data`` after the magic; every frame until the daemon hangs up."""
    conn = await NSQConnection.open(port)
    await conn.send(data)
    frames = []
    with trio.fail_after(5):
        while True:
            try:
                frames.append(await conn.read_frame())
            except (EOFError, trio.BrokenResourceError):
                return frames


FATAL = [
    # ---- numbers of any length: Go's uint64 wrap-around, never a crash
    ("RDY 5000 digits", b"SUB t c\nRDY " + HUGE + b"\n",
     [OK, (FRAME_ERROR, b"E_INVALID RDY count -1 out of range 0-2500")]),
    ("RDY that wraps past int64", b"SUB t c\nRDY 9223372036854775808\n",
     [OK, (FRAME_ERROR, b"E_INVALID RDY count -9223372036854775808 out of range 0-2500")]),
    ("RDY negative", b"SUB t c\nRDY -1\n", [OK, (FRAME_ERROR, b"E_INVALID RDY could not parse count -1")]),
    ("DPUB 5000 digits, no body needed", PUB_OK + b"DPUB t " + HUGE + b"\n",
     [OK, (FRAME_ERROR, b"E_INVALID DPUB timeout 18446744073709551615 out of range 0-3600000")]),
    ("DPUB negative", PUB_OK + b"DPUB t -5\n", [OK, (FRAME_ERROR, b"E_INVALID DPUB could not parse timeout -5")]),
    ("TOUCH 5000 digits", b"SUB t c\nTOUCH " + HUGE + b"\n", [OK, (FRAME_ERROR, b"E_INVALID invalid message ID")]),
    ("REQ without a timeout", b"SUB t c\nREQ " + MID + b"\n",
     [OK, (FRAME_ERROR, b"E_INVALID REQ insufficient number of params")]),
    # ---- body commands whose line is wrong are answered at once, not after a body
    ("PUB without a topic", PUB_OK + b"PUB\n", [OK, (FRAME_ERROR, b"E_INVALID PUB insufficient number of parameters")]),
    ("MPUB without a topic", PUB_OK + b"MPUB\n",
     [OK, (FRAME_ERROR, b"E_INVALID MPUB insufficient number of parameters")]),
    ("DPUB without a timeout", PUB_OK + b"DPUB t\n",
     [OK, (FRAME_ERROR, b"E_INVALID DPUB insufficient number of parameters")]),
    ("PUB with a bad topic", PUB_OK + b"PUB a/b\n", [OK, (FRAME_ERROR, b'E_BAD_TOPIC PUB topic name "a/b" is not valid')]),
    ("PUB with two spaces", PUB_OK + b"PUB  t\n", [OK, (FRAME_ERROR, b'E_BAD_TOPIC PUB topic name "" is not valid')]),
    # names echoed as Go's %q writes them (strconv.Quote), from their bytes
    ("PUB with a NUL in the topic", PUB_OK + b"PUB t\x00x\n",
     [OK, (FRAME_ERROR, b'E_BAD_TOPIC PUB topic name "t\\x00x" is not valid')]),
    ("PUB with a byte that is not UTF-8", PUB_OK + b"PUB a\xffb\n",
     [OK, (FRAME_ERROR, b'E_BAD_TOPIC PUB topic name "a\\xffb" is not valid')]),
    ("SUB with a tab and a no-break space", PUB_OK + b"SUB t a\tb\xc2\xa0c\n",
     [OK, (FRAME_ERROR, b'E_BAD_CHANNEL SUB channel name "a\\tb\\u00a0c" is not valid')]),
    ("AUTH with a parameter", PUB_OK + b"AUTH secret\n", [OK, (FRAME_ERROR, b"E_INVALID AUTH invalid number of parameters")]),
    # ---- sizes: negative, zero, near 2**31
    ("MPUB count -1", PUB_OK + b"MPUB t\n" + body(struct.pack(">i", -1)),
     [OK, (FRAME_ERROR, b"E_BAD_BODY MPUB invalid message count -1")]),
    ("MPUB count 2**31-1", PUB_OK + b"MPUB t\n" + body(struct.pack(">i", 2**31 - 1)),
     [OK, (FRAME_ERROR, b"E_BAD_BODY MPUB invalid message count 2147483647")]),
    ("MPUB message size -1", PUB_OK + b"MPUB t\n" + body(struct.pack(">ii", 1, -1)),
     [OK, (FRAME_ERROR, b"E_BAD_MESSAGE MPUB invalid message(0) body size -1")]),
    ("PUB size -1", PUB_OK + b"PUB t\n" + struct.pack(">i", -1),
     [OK, (FRAME_ERROR, b"E_BAD_MESSAGE PUB invalid message body size -1")]),
    ("PUB size 0", PUB_OK + b"PUB t\n" + struct.pack(">i", 0),
     [OK, (FRAME_ERROR, b"E_BAD_MESSAGE PUB invalid message body size 0")]),
    ("PUB size 2**31-1", PUB_OK + b"PUB t\n" + struct.pack(">i", 2**31 - 1),
     [OK, (FRAME_ERROR, b"E_BAD_MESSAGE PUB message too big 2147483647 > 1048576")]),
    ("MPUB size 2**31-1", PUB_OK + b"MPUB t\n" + struct.pack(">i", 2**31 - 1),
     [OK, (FRAME_ERROR, b"E_BAD_BODY MPUB body too big 2147483647 > 5242880")]),
    ("IDENTIFY size -1", PUB_OK + b"IDENTIFY\n" + struct.pack(">i", -1),
     [OK, (FRAME_ERROR, b"E_BAD_BODY IDENTIFY invalid body size -1")]),
    ("IDENTIFY over 64 KiB", PUB_OK + b"IDENTIFY\n" + struct.pack(">i", 200_000),
     [OK, (FRAME_ERROR, b"E_BAD_BODY IDENTIFY body too big 200000 > 65536")]),
    # ---- lines
    ("empty line", PUB_OK + b"\n", [OK, (FRAME_ERROR, b"E_INVALID invalid command ")]),
    ("two carriage returns", PUB_OK + b"NOP\r\r\n", [OK, (FRAME_ERROR, b"E_INVALID invalid command NOP\r")]),
    ("a line over 16 KiB", PUB_OK + b"X" * 20_000, [OK]),  # nsqd's read fails: no answer
    ("SUB with two spaces", PUB_OK + b"SUB t  c\n", [OK, (FRAME_ERROR, b'E_BAD_CHANNEL SUB channel name "" is not valid')]),
]


@pytest.mark.parametrize("data,expected", [case[1:] for case in FATAL], ids=[case[0] for case in FATAL])
async def test_fatal_input_gets_nsqds_error_after_what_was_owed(tmp_path, logs, data, expected):
    async with running_nsqd(tmp_path) as nsqd:
        assert await frames_until_closed(tcp_port(nsqd), data) == expected


BAD_IDENTIFY = [
    ("Infinity", b'{"heartbeat_interval": Infinity}'),
    ("-Infinity", b'{"msg_timeout": -Infinity}'),
    ("NaN", b'{"sample_rate": NaN}'),
    ("NaN in an unknown field", b'{"whatever": NaN}'),
    ("1e400", b'{"heartbeat_interval": 1e400}'),
    ("a fraction for an int", b'{"heartbeat_interval": 1500.5}'),
    ("an exponent for an int", b'{"msg_timeout": 2e3}'),
    ("30 digits", b'{"output_buffer_size": 123456789012345678901234567890}'),
    ("5000 digits", b'{"output_buffer_size": ' + HUGE + b"}"),
    ("sample rate past int32", b'{"sample_rate": 2147483648}'),
    ("a string for an int", b'{"heartbeat_interval": "1000"}'),
    ("true for an int", b'{"heartbeat_interval": true}'),
    ("a number for a string", b'{"client_id": 5}'),
    ("a string for a bool", b'{"feature_negotiation": "yes"}'),
    ("30,000-deep array", b"[" * 30_000 + b"]" * 30_000),
    ("deep in an unknown field", b'{"x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"),
    ("an array", b"[1, 2]"),
    ("a bare number", b"5"),
    ("bytes that are not UTF-8 outside strings", b'{"client_id": "a"\xff}'),
    ("a byte order mark", b'\xef\xbb\xbf{}'),
]


@pytest.mark.parametrize("payload", [case[1] for case in BAD_IDENTIFY], ids=[case[0] for case in BAD_IDENTIFY])
async def test_identify_json_go_cannot_decode_fails_cleanly(tmp_path, logs, payload):
    async with running_nsqd(tmp_path) as nsqd:
        frames = await frames_until_closed(tcp_port(nsqd), PUB_OK + b"IDENTIFY\n" + body(payload))
        assert frames == [OK, (FRAME_ERROR, b"E_BAD_BODY IDENTIFY failed to decode JSON body")]


@pytest.mark.parametrize("payload,client_id", [
    (b"null", ""),                                             # Go: null decodes to the zero struct
    (b'{"client_id": "a\xffb"}', "a\ufffdb"),                  # Go: invalid UTF-8 in a string is U+FFFD
    (b'{"client_id": "c", "unknown": [1e400, {"deep": [[[1]]]}]}', "c"),  # unknown fields are ignored
    (b'{"client_id": "d", "heartbeat_interval": null}', "d"),  # null is the zero value
])
async def test_identify_json_go_accepts_is_accepted(tmp_path, logs, payload, client_id):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("IDENTIFY", payload)
        await conn.expect_response(b"OK")
        assert next(iter(nsqd.clients.values())).client_id == client_id
        await conn.pub("t", b"still open")


async def test_req_and_lreq_with_5000_digits_clamp_as_nsqd_does(tmp_path, logs):
    async with running_nsqd(tmp_path, max_req_timeout=10.0) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.mpub("t", [b"a", b"b"])
        sub = await NSQConnection.open(tcp_port(nsqd))
        await sub.identify(leases=True)
        await sub.sub("t", "c")
        await sub.command("RDY 1")
        msg = await sub.read_message()
        await sub.command("RDY 0")
        # 2**64 - 1 ms is -1 ms as Go's Duration: clamped to 0, requeued at once
        await sub.command(b"REQ " + msg.id + b" " + HUGE)
        await sub.command(b"LEASE L")
        assert json.loads((await sub.read_non_heartbeat())[1])["lease"] == "L"
        channel = nsqd.topics["t"].channels["c"]
        assert channel.deferred_count == 0 and channel.in_flight_count == 0
        await sub.command("RDY 1")
        leased = await sub.read_message()
        await sub.command(b"LREQ L " + HUGE)
        kind, data = await sub.read_non_heartbeat()
        assert (kind, json.loads(data)) == (FRAME_RESPONSE, {"lease": "L", "count": 1})
        assert channel.deferred_count == 0   # requeued at once
        await sub.command(b"LEASE M")   # its current lease ended: it takes messages again under a new one
        assert json.loads((await sub.read_non_heartbeat())[1])["lease"] == "M"
        again = await sub.read_message(timeout=2)
        assert again.id == leased.id and channel.deferred_count == 0


async def test_rdy_with_a_number_that_wraps_into_range_is_taken_as_go_takes_it(tmp_path, logs):
    async with running_nsqd(tmp_path) as nsqd:
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.mpub("t", [b"a", b"b"])
        sub = await NSQConnection.open(tcp_port(nsqd))
        await sub.sub("t", "c")
        await sub.command("RDY 18446744073709551617")  # 2**64 + 1: RDY 1 in Go's uint64
        assert (await sub.read_message()).body == b"a"
        with trio.move_on_after(0.3):
            await sub.read_message()
            raise AssertionError("more than one message in flight")


async def test_a_bad_client_between_good_ones_leaves_them_alone(tmp_path, logs):
    async with running_nsqd(tmp_path) as nsqd:
        good = await NSQConnection.open(tcp_port(nsqd))
        await good.sub("t", "c")
        await good.command("RDY 10")
        for data, _ in [case[1:] for case in FATAL[:5]]:
            await frames_until_closed(tcp_port(nsqd), data)
        pub = await NSQConnection.open(tcp_port(nsqd))
        await pub.pub("t", b"after the storm")
        assert (await good.read_message()).body == b"after the storm"
