"""Publishes that arrive in one pass of the readiness hub, stored as one batch per topic.

Real sockets against the daemon in this process: the test writes to every
connection before it yields, so the hub finds all of them in one poll and
the publishes are staged together (``nsqd/staging.py``).
"""

import socket
import struct

import pytest
import trio
import trio.testing

from .support import FRAME_ERROR, FRAME_RESPONSE, NSQConnection, mpub_body, running_nsqd, tcp_port


def pub(topic: str, body: bytes) -> bytes:
    return f"PUB {topic}\n".encode() + struct.pack(">i", len(body)) + body


def mpub(topic: str, bodies: list[bytes]) -> bytes:
    payload = mpub_body(bodies)
    return f"MPUB {topic}\n".encode() + struct.pack(">i", len(payload)) + payload


async def connections(port: int, count: int) -> list[tuple[socket.socket, NSQConnection]]:
    """Connections whose readers are parked: a plain socket to write to at once, a client to read."""
    opened = []
    for _ in range(count):
        raw = socket.create_connection(("127.0.0.1", port))
        conn = NSQConnection(trio.SocketStream(trio.socket.from_stdlib_socket(raw)))
        await conn.send(b"  V2")
        opened.append((raw, conn))
    for _, conn in opened:
        await conn.send(b"NOP\n")
    await trio.testing.wait_all_tasks_blocked()
    return opened


def send_all_at_once(opened, payloads: list[bytes]) -> None:
    """Every connection's bytes written before the daemon runs again (one poll of the hub)."""
    for (raw, _), data in zip(opened, payloads):
        assert raw.send(data) == len(data)


@pytest.mark.parametrize("durable", [False, True])
async def test_publishes_staged_together_are_stored_whole_and_in_each_publishers_order(tmp_path, durable):
    async with running_nsqd(tmp_path, durable=durable) as nsqd:
        port = tcp_port(nsqd)
        consumer = await NSQConnection.open(port)
        await consumer.sub("t", "c")
        opened = await connections(port, 20)
        send_all_at_once(opened, [pub("t", b"%d-0" % i) + mpub("t", [b"%d-1" % i, b"%d-2" % i]) + pub("t", b"%d-3" % i)
                                  for i in range(20)])
        for _, conn in opened:
            for _ in range(3):
                await conn.expect_response()
        assert nsqd.topics["t"].message_count == 80
        await consumer.command("RDY 100")
        seen: dict[int, list[int]] = {}
        for _ in range(80):
            msg = await consumer.read_message()
            publisher, index = map(int, msg.body.split(b"-"))
            seen.setdefault(publisher, []).append(index)
            await consumer.command(b"FIN " + msg.id)
        assert seen == {i: [0, 1, 2, 3] for i in range(20)}
        producers = sum(client.pub_counts.get("t", 0) for client in nsqd.clients.values())
        assert producers == 80


async def test_a_refused_batch_is_published_again_one_publish_at_a_time(tmp_path):
    """Room for 5: the batch of 7 is refused, then each publish gets the answer it would have got alone."""
    async with running_nsqd(tmp_path, channel_max_messages=5) as nsqd:
        port = tcp_port(nsqd)
        consumer = await NSQConnection.open(port)
        await consumer.sub("t", "c")
        opened = await connections(port, 3)
        send_all_at_once(opened, [mpub("t", [b"a1", b"a2", b"a3"]), mpub("t", [b"b1", b"b2", b"b3"]), pub("t", b"c1")])
        answers = [await conn.read_non_heartbeat() for _, conn in opened]
        assert answers[0] == (FRAME_RESPONSE, b"OK")
        assert answers[1][0] == FRAME_ERROR and answers[1][1].startswith(b"E_MPUB_FAILED MPUB failed topic t is full")
        assert answers[2] == (FRAME_RESPONSE, b"OK")
        channel = nsqd.topics["t"].channels["c"]
        assert channel.depth == 4
        await consumer.command("RDY 10")
        assert [(await consumer.read_message()).body for _ in range(4)] == [b"a1", b"a2", b"a3", b"c1"]


async def test_a_publish_staged_before_a_fatal_error_is_answered_and_stored(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        opened = await connections(tcp_port(nsqd), 2)
        send_all_at_once(opened, [pub("t", b"kept") + b"BOGUS\n", pub("t", b"other")])
        conn = opened[0][1]
        await conn.expect_response()
        await conn.expect_error("E_INVALID")
        await conn.expect_closed()
        await opened[1][1].expect_response()
        assert nsqd.topics["t"].message_count == 2


class _StagingOnly:
    """A batch that only stages (the unit under test never flushes)."""

    open = True

    def __init__(self):
        self.staged = []

    def stage(self, topic_name, bodies):
        self.staged.append((topic_name, bodies))
        return object()


SINGLE_PUB_CASES = [
    (pub("t", b"body"), True),
    (pub("a.b_c-d#ephemeral", b"x" * 300), True),
    (b"PUB t extra\n" + struct.pack(">i", 1) + b"x", False),  # more params: the parser takes the first
    (b"PUB t\r\n" + struct.pack(">i", 1) + b"x", False),  # "\r" before "\n" is cut by the parser
    (pub("bad topic!", b"x"), False),
    (pub("", b"x"), False),
    (pub("t", b"x") + b"NOP\n", False),  # more than one command
    (pub("t", b"x")[:-1], False),  # the body is not all there
    (b"PUB t\n" + struct.pack(">i", 0), False),
    (b"PUB t\n" + struct.pack(">i", -1) + b"x", False),
    (pub("t", b"x" * 1025), False),  # over max_msg_size
    (b"MPUB t\n" + struct.pack(">i", 1) + b"x", False),
    (b"PUB\n" + struct.pack(">i", 1) + b"x", False),
]


@pytest.mark.parametrize("data,staged", SINGLE_PUB_CASES)
async def test_a_single_pub_is_staged_directly_only_when_the_parser_would_stage_it_the_same(tmp_path, data, staged):
    """``stage_single_pub`` against the general path: what it takes, the parser and PUB would stage
    identically; the rest it leaves untouched."""
    from nsqd.client_v2 import ClientV2
    from nsqd.protocol_v2 import ProtocolV2, Unconfirmed

    async with running_nsqd(tmp_path, max_msg_size=1024) as nsqd:
        def protocol():
            batch = _StagingOnly()
            client = ClientV2(nsqd.new_client_id(), "unit", nsqd.options, nsqd.now_ns(), nsqd.topics)
            return ProtocolV2(nsqd, client, batch), batch

        fast, fast_batch = protocol()
        buffer = bytearray(data) + b"\0" * 64  # the shared receive buffer holds older bytes past the read
        assert fast.stage_single_pub(buffer, len(data)) is staged
        general, general_batch = protocol()
        general.receive_data(data, nsqd.now_ns())
        if staged:
            assert fast_batch.staged == general_batch.staged
            assert [type(item) for item in fast.held] == [Unconfirmed]
            assert (fast.held[0].command, fast.held[0].topic) == ("PUB", general.held[0].topic)
            assert fast.parser.parsed == general.parser.parsed == 1
        else:
            assert (fast_batch.staged, fast.held, fast.parser.parsed, fast.parser.buffered) == ([], [], 0, 0)


async def test_a_single_pub_with_auth_or_tls_to_check_goes_the_general_way(tmp_path):
    from nsqd.client_v2 import ClientV2
    from nsqd.protocol_v2 import ProtocolV2

    async with running_nsqd(tmp_path) as nsqd:
        for check in ("auth_enabled", "tls_required"):
            batch = _StagingOnly()
            protocol = ProtocolV2(nsqd, ClientV2(nsqd.new_client_id(), "unit", nsqd.options, nsqd.now_ns(), nsqd.topics), batch)
            setattr(protocol, check, True)  # as --auth-http-address or --tls-required set them
            data = pub("t", b"x")
            assert not protocol.stage_single_pub(bytearray(data), len(data))
            assert (batch.staged, protocol.held) == ([], [])


async def test_a_connection_whose_steps_run_long_takes_fewer_commands_a_step_and_more_again_once_quick(
        tmp_path, monkeypatch):
    """10 clients pipelining 256 PUBs a step (about 9 ms each here) had a single PUB wait 124 ms:
    a step that runs past 2 × STEP_SECONDS halves the next one (down to MIN_STEP_COMMANDS), a
    step under half of it doubles it (up to STEP_COMMANDS)."""
    from nsqd import protocol_v2
    from nsqd.client_v2 import ClientV2
    from nsqd.protocol_v2 import MIN_STEP_COMMANDS, STEP_COMMANDS, ProtocolV2

    async with running_nsqd(tmp_path) as nsqd:
        client = ClientV2(nsqd.new_client_id(), "unit", nsqd.options, nsqd.now_ns(), nsqd.topics)
        protocol = ProtocolV2(nsqd, client)
        monkeypatch.setattr(protocol_v2, "STEP_SECONDS", 1e-12)  # every step runs long
        protocol.receive_data(b"NOP\n" * 2000, nsqd.now_ns())
        sizes = [protocol.parser.parsed]
        while protocol.more and len(sizes) < 7:
            before = protocol.parser.parsed
            protocol.step(nsqd.now_ns())
            sizes.append(protocol.parser.parsed - before)
        assert sizes == [STEP_COMMANDS, 128, 64, 32, MIN_STEP_COMMANDS, MIN_STEP_COMMANDS, MIN_STEP_COMMANDS]
        monkeypatch.setattr(protocol_v2, "STEP_SECONDS", 1e9)  # every step is quick
        sizes = []
        while protocol.more and len(sizes) < 6:
            before = protocol.parser.parsed
            protocol.step(nsqd.now_ns())
            sizes.append(protocol.parser.parsed - before)
        assert sizes == [MIN_STEP_COMMANDS, 32, 64, 128, STEP_COMMANDS, STEP_COMMANDS]
