"""The snappy and deflate streams alone, over an in-memory transport: pacing and bounds."""

import snappy
import trio
import trio.testing

from nsqd.compression import STEP_CHUNKS, SnappyStream

STREAM_ID = b"\xff\x06\x00\x00sNaPpY"
PADDING = b"\xfe\x00\x00\x00"


def test_a_snappy_step_ends_after_step_chunks_even_when_they_hold_nothing():
    """Padding, skippable and empty chunks cost time too: a read's worth held the loop 80-100 ms."""
    stream = SnappyStream(trio.testing.MemorySendStream())
    stream._buffer += STREAM_ID + PADDING * (3 * STEP_CHUNKS)
    assert stream._decode() == b""
    left = len(stream._buffer) // len(PADDING)
    assert 2 * STEP_CHUNKS - 1 <= left < 3 * STEP_CHUNKS


async def test_padding_between_data_is_worked_through_across_checkpoints():
    send, receive = trio.testing.memory_stream_pair()
    stream = SnappyStream(receive)
    data = snappy.StreamCompressor().add_chunk(b"hello")
    await send.send_all(STREAM_ID + PADDING * (5 * STEP_CHUNKS) + data[len(STREAM_ID):])
    with trio.fail_after(5):
        assert await stream.receive_some(65536) == b"hello"
