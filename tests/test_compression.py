"""The snappy and deflate streams alone, over an in-memory transport: pacing and bounds."""

import snappy
import trio
import trio.testing

import os
import threading
import zlib

from nsqd.compression import STEP_CHUNKS, THREAD_BYTES, DeflateStream, SnappyStream

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


async def test_a_big_deflate_write_is_compressed_off_the_event_loop_and_in_order(monkeypatch):
    """A 1 MiB fill of messages that do not compress took 40 ms of the event loop; big writes
    go to a worker thread, and writes small and big still arrive whole and in order."""
    threads = []
    deflate = DeflateStream._deflate

    def spy(self, data):
        threads.append(threading.current_thread() is threading.main_thread())
        return deflate(self, data)

    monkeypatch.setattr(DeflateStream, "_deflate", spy)
    send, receive = trio.testing.memory_stream_pair()
    stream = DeflateStream(send, 6)
    writes = [b"small", os.urandom(4 * THREAD_BYTES), b"tail"]
    got = bytearray()
    inflate = zlib.decompressobj(-zlib.MAX_WBITS)
    async with trio.open_nursery() as nursery:
        async def read_all():
            while len(got) < sum(map(len, writes)):
                got.extend(inflate.decompress(await receive.receive_some(1 << 20)))
        nursery.start_soon(read_all)
        for data in writes:
            await stream.send_all(data)
    assert bytes(got) == b"".join(writes)
    assert threads == [True, False, True]
