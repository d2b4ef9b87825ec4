"""AMQP framing: protocol headers and frames, however the bytes are split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amqp_gateway.errors import FRAMING_ERROR, ConnectionFault
from amqp_gateway.framing import AMQP_HEADER, EMPTY_FRAME, SASL_HEADER, FrameReader, Header, encode_frame
from amqp_gateway.performatives import Open

STREAM = (AMQP_HEADER + encode_frame(0, Open("c").encode_amqp()) + EMPTY_FRAME
          + encode_frame(7, b"x" * 1000)
          # a frame with a 4-byte extended header (doff 3) that readers must skip
          + b"\x00\x00\x00\x0f\x03\x00\x00\x02" + b"EXTH" + b"abc")
EXPECTED = [AMQP_HEADER, (0, 0, Open("c").encode_amqp()), (0, 0, b""), (0, 7, b"x" * 1000), (0, 2, b"abc")]


def _items(reader: FrameReader, chunks) -> list:
    out = []
    for chunk in chunks:
        for item in reader.feed(chunk):
            out.append(item.raw if isinstance(item, Header) else item)
    return out


def test_whole_stream_in_one_read():
    assert _items(FrameReader(4096), [STREAM]) == EXPECTED


def test_stream_fed_one_byte_at_a_time():
    assert _items(FrameReader(4096), [STREAM[i:i + 1] for i in range(len(STREAM))]) == EXPECTED


@given(st.lists(st.integers(1, len(STREAM)), max_size=20))
@settings(max_examples=200, deadline=None)
def test_stream_split_anywhere(cuts):
    cuts = sorted(set(cuts))
    chunks = [STREAM[a:b] for a, b in zip([0] + cuts, cuts + [len(STREAM)]) if a < b]
    assert _items(FrameReader(4096), chunks) == EXPECTED


def test_a_header_is_expected_again_after_sasl():
    reader = FrameReader(4096)
    frame = encode_frame(0, b"\x00\x53\x44\x45", 1)
    data = SASL_HEADER + frame + AMQP_HEADER
    out = []
    for item in reader.feed(data):
        out.append(item)
        if not isinstance(item, Header):
            reader.expect_header = True
    assert [type(i) for i in out] == [Header, tuple, Header]
    assert out[0].protocol == 3 and out[2].protocol == 0 and out[2].valid


def test_frame_larger_than_max_frame_size_is_a_framing_error():
    reader = FrameReader(512)
    reader.expect_header = False
    with pytest.raises(ConnectionFault) as caught:
        list(reader.feed(encode_frame(0, b"x" * 600)[:20]))
    assert caught.value.error.condition == FRAMING_ERROR


@pytest.mark.parametrize("head", [b"\x00\x00\x00\x08\x01\x00\x00\x00", b"\x00\x00\x00\x04\x02\x00\x00\x00",
                                  b"\x00\x00\x00\x0c\x04\x00\x00\x00"])
def test_bad_frame_headers(head):
    reader = FrameReader(4096)
    reader.expect_header = False
    with pytest.raises(ConnectionFault):
        list(reader.feed(head + b"\x00" * 16))


def test_dribbled_large_frame_is_not_rescanned():
    """A frame arriving byte by byte is only assembled once it is whole."""
    reader = FrameReader(1 << 20)
    reader.expect_header = False
    frame = encode_frame(1, b"y" * 100_000)
    for i in range(len(frame) - 1):
        assert list(reader.feed(frame[i:i + 1])) == []
    assert list(reader.feed(frame[-1:])) == [(0, 1, b"y" * 100_000)]
