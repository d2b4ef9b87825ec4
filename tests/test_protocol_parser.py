"""The sans-I/O V2 parser: bytes in, commands out, no sockets."""

import struct

import pytest
from hypothesis import given, strategies as st

from nsqd.mpub import BadBatch, split_mpub
from nsqd.protocol_v2 import (
    FIN_BATCH, FINS_PER_COMMAND, MAX_LINE, PARSE_ERROR, SKIPPED, STEP_COMMANDS, V2Parser, go_base10, go_int64,
    go_millis_ns,
)

MID = b"0123456789abcdef"


def new_parser(max_msg=1024, max_body=4096) -> V2Parser:
    return V2Parser(max_msg, max_body, max_req_timeout_ms=3_600_000)


def drain(parser: V2Parser) -> list:
    """Every complete command, step after step, as the I/O layer takes them."""
    commands = parser.commands()
    while parser.more:
        commands += parser.commands()
    return commands


def parse_all(data: bytes, max_msg=1024, max_body=4096, step=None):
    parser = new_parser(max_msg, max_body)
    commands = []
    if step is None:
        parser.receive_data(data)
        commands += drain(parser)
    else:
        for i in range(0, len(data), step):
            parser.receive_data(data[i:i + step])
            commands += drain(parser)
    return parser, commands


def flatten(commands):
    """Expand FIN batches so results compare independently of batching."""
    out = []
    for name, params, body in commands:
        if name is FIN_BATCH:
            out += [(b"FIN", [b"FIN", i], None) for i in params]
        else:
            out.append((name, params, body))
    return out


def test_line_commands_and_crlf():
    _, cmds = parse_all(b"NOP\nRDY 10\r\nSUB topic chan\n")
    assert cmds == [(b"NOP", [b"NOP"], None), (b"RDY", [b"RDY", b"10"], None),
                    (b"SUB", [b"SUB", b"topic", b"chan"], None)]


def test_consecutive_fins_are_batched_in_order():
    ids = [b"%016x" % i for i in range(5)]
    data = b"".join(b"FIN " + i + b"\n" for i in ids[:3]) + b"RDY 1\n" + b"".join(
        b"FIN " + i + b"\n" for i in ids[3:])
    _, cmds = parse_all(data)
    assert [c[0] for c in cmds] == [FIN_BATCH, b"RDY", FIN_BATCH]
    assert cmds[0][1] == ids[:3] and cmds[2][1] == ids[3:]


def test_malformed_fin_goes_through_the_generic_path():
    _, cmds = parse_all(b"FIN short\nFIN\n")
    assert cmds == [(b"FIN", [b"FIN", b"short"], None), (b"FIN", [b"FIN"], None)]


def test_body_commands_wait_for_the_whole_body():
    data = b"PUB t\n" + struct.pack(">i", 5) + b"hello" + b"NOP\n"
    parser, cmds = parse_all(data[:-8])
    assert cmds == []
    parser.receive_data(data[-8:])
    assert parser.commands() == [(b"PUB", [b"PUB", b"t"], b"hello"), (b"NOP", [b"NOP"], None)]
    assert parser.buffered == 0


def test_identify_body_and_mpub_body_are_raw():
    mpub_body = struct.pack(">i", 1) + struct.pack(">i", 2) + b"hi"
    data = (b"IDENTIFY\n" + struct.pack(">i", 2) + b"{}"
            + b"MPUB t\n" + struct.pack(">i", len(mpub_body)) + mpub_body)
    _, cmds = parse_all(data)
    assert cmds == [(b"IDENTIFY", [b"IDENTIFY"], b"{}"), (b"MPUB", [b"MPUB", b"t"], mpub_body)]


@pytest.mark.parametrize("cmd,size,code,text", [
    (b"PUB t", 0, "E_BAD_MESSAGE", "PUB invalid message body size 0"),
    (b"PUB t", -3, "E_BAD_MESSAGE", "PUB invalid message body size -3"),
    (b"PUB t", 1025, "E_BAD_MESSAGE", "PUB message too big 1025 > 1024"),
    (b"DPUB t 10", 2000, "E_BAD_MESSAGE", "DPUB message too big 2000 > 1024"),
    (b"MPUB t", 4097, "E_BAD_BODY", "MPUB body too big 4097 > 4096"),
    (b"MPUB t", 0, "E_BAD_BODY", "MPUB invalid body size 0"),
    (b"IDENTIFY", 5000, "E_BAD_BODY", "IDENTIFY body too big 5000 > 4096"),
])
def test_body_size_limits_fail_before_the_body_arrives(cmd, size, code, text):
    parser, cmds = parse_all(cmd + b"\n" + struct.pack(">i", size))
    assert cmds == [(PARSE_ERROR, [code, text], None)]
    parser.receive_data(b"NOP\n")
    assert parser.commands() == []  # nothing is parsed after a framing error


def test_overlong_line_is_an_error_even_when_its_newline_came_in_the_same_read():
    _, cmds = parse_all(b"NOP\n" + b"X" * MAX_LINE + b"\n")
    assert cmds == [(b"NOP", [b"NOP"], None),
                    (PARSE_ERROR, [None, f"command line longer than {MAX_LINE - 1} bytes"], None)]


def test_a_line_that_fits_nsqds_buffer_with_its_newline_is_parsed():
    _, cmds = parse_all(b"NOP " + b"X" * (MAX_LINE - 5) + b"\n")
    assert [name for name, _, _ in cmds] == [b"NOP"]


def test_overlong_line_is_an_error_not_a_buffer():
    parser, cmds = parse_all(b"X" * MAX_LINE)
    assert cmds[0][0] is PARSE_ERROR and cmds[0][1][0] is None
    assert parser.buffered == 0


def test_partial_fin_is_kept_until_complete():
    parser, cmds = parse_all(b"FIN " + MID[:8])
    assert cmds == []
    parser.receive_data(MID[8:] + b"\n")
    assert parser.commands() == [(FIN_BATCH, [MID], None)]


command_strategy = st.one_of(
    st.builds(lambda i: b"FIN %016x\n" % i, st.integers(0, 2**63)),
    st.builds(lambda n: b"RDY %d\n" % n, st.integers(0, 10000)),
    st.just(b"NOP\n"),
    st.builds(lambda body: b"PUB topic\n" + struct.pack(">i", len(body)) + body,
              st.binary(min_size=1, max_size=300)),
    st.builds(lambda body: b"IDENTIFY\n" + struct.pack(">i", len(body)) + body,
              st.binary(min_size=1, max_size=50)),
)


@given(st.lists(command_strategy, max_size=30), st.integers(1, 64))
def test_any_split_of_the_stream_gives_the_same_commands(stream, step):
    data = b"".join(stream)
    _, whole = parse_all(data)
    _, pieces = parse_all(data, step=step)
    assert flatten(pieces) == flatten(whole)
    assert len(flatten(whole)) == len(stream)


@given(st.binary(max_size=2000))
def test_garbage_never_raises(data):
    parser = new_parser()
    parser.receive_data(data)
    for name, params, _ in drain(parser):
        assert isinstance(name, bytes) and isinstance(params, list)


def test_a_call_returns_a_bounded_step_of_commands():
    parser = new_parser()
    parser.receive_data(b"NOP\n" * 1000)
    first = parser.commands()
    assert len(first) == STEP_COMMANDS and parser.more
    assert len(first) + len(drain(parser)) == 1000 and not parser.more


def test_each_fin_of_a_run_counts_against_the_step():
    step_fins = STEP_COMMANDS * FINS_PER_COMMAND
    parser = new_parser()
    parser.receive_data(b"".join(b"FIN %016x\n" % i for i in range(step_fins + 1000)))
    (name, ids, _), = parser.commands()
    assert name is FIN_BATCH and len(ids) == step_fins and parser.more
    assert sum(len(c[1]) for c in drain(parser)) == 1000


def test_fins_and_other_commands_share_one_step():
    parser = new_parser()
    parser.receive_data(b"NOP\n" * (STEP_COMMANDS - 1) + b"".join(b"FIN %016x\n" % i for i in range(100)))
    first = parser.commands()
    assert len(first) == STEP_COMMANDS and parser.more
    assert first[-1][0] is FIN_BATCH and len(first[-1][1]) == FINS_PER_COMMAND


@pytest.mark.parametrize("line,error", [
    (b"PUB\n", ["E_INVALID", "PUB insufficient number of parameters"]),
    (b"MPUB\n", ["E_INVALID", "MPUB insufficient number of parameters"]),
    (b"DPUB t\n", ["E_INVALID", "DPUB insufficient number of parameters"]),
    (b"DPUB t 3600001\n", ["E_INVALID", "DPUB timeout 3600001 out of range 0-3600000"]),
    (b"DPUB t 1x\n", ["E_INVALID", "DPUB could not parse timeout 1x"]),
    (b"PUB a:b\n", ["E_BAD_TOPIC", 'PUB topic name "a:b" is not valid']),
    (b"AUTH x\n", ["E_INVALID", "AUTH invalid number of parameters"]),
])
def test_a_body_commands_line_is_checked_before_its_body_arrives(line, error):
    _, cmds = parse_all(line)  # no size, no body: nsqd answers anyway
    assert cmds == [(PARSE_ERROR, error, None)]


@pytest.mark.parametrize("digits,value", [
    (b"", 0),
    (b"18446744073709551615", 2**64 - 1),
    (b"18446744073709551617", 1),
    (b"9" * 5000, 2**64 - 1),
    (b"1" + b"0" * 5000, 0),
])
def test_numbers_wrap_at_64_bits_as_gos_byte_to_base10(digits, value):
    assert go_base10(digits, "RDY could not parse count") == value


def test_go_int64_and_millisecond_durations_overflow_as_go_does():
    assert go_int64(2**64 - 1) == -1
    assert go_millis_ns(2**64 - 1) == -1_000_000
    assert go_millis_ns(9_223_372_036_855) == -9_223_372_036_854_551_616  # past int64 nanoseconds


def _mpub_body(bodies, count=None):
    return struct.pack(">i", len(bodies) if count is None else count) + b"".join(
        struct.pack(">i", len(b)) + b for b in bodies)


@given(st.lists(st.binary(min_size=1, max_size=12), min_size=1, max_size=30))
def test_split_mpub_returns_every_body_whatever_the_sizes(bodies):
    assert [bytes(b) for b in split_mpub(_mpub_body(bodies), 100, 10_000)] == bodies


def test_split_mpub_checks_every_size_even_when_the_total_looks_uniform():
    # three sizes 2, 1, 3 fill exactly as much as three of size 2 would
    assert [bytes(b) for b in split_mpub(_mpub_body([b"ab", b"c", b"def"]), 100, 10_000)] == [b"ab", b"c", b"def"]
    with pytest.raises(BadBatch, match="MPUB message too big 101 > 100"):
        split_mpub(_mpub_body([b"a" * 50, b"b" * 101, b"c"]), 100, 10_000)
    with pytest.raises(BadBatch, match="MPUB body has 1 bytes after its 3 messages"):
        split_mpub(_mpub_body([b"ab"] * 3) + b"x", 100, 10_000)
    with pytest.raises(BadBatch, match="MPUB message too big 200 > 100"):
        split_mpub(_mpub_body([b"x" * 200] * 4), 100, 10_000)  # uniform but too big: the careful path's error


def test_a_skipped_body_is_dropped_as_it_arrives_and_answered_in_its_place():
    """The daemon had no memory for the body: it is read on and dropped, never buffered, and the
    commands after it parse as usual."""
    p = new_parser(max_body=10_000)
    body = struct.pack(">i", 2) + struct.pack(">i", 3000) + b"a" * 3000 + struct.pack(">i", 3000) + b"b" * 3000
    data = b"MPUB t\n" + struct.pack(">i", len(body)) + body + b"NOP\n"
    p.receive_data(data[:1000])
    assert p.commands() == [] and p.awaiting == 11 + len(body)
    p.skip_awaited()
    assert (p.buffered, p.awaiting) == (0, 0)
    for start in range(1000, len(data), 700):
        p.receive_data(data[start:start + 700])
        assert p.buffered <= 4  # nothing of the body is kept
        if start + 700 < len(data) - 4:
            assert p.commands() == []
    assert p.commands() == [(SKIPPED, [b"MPUB"], None), (b"NOP", [b"NOP"], None)]
