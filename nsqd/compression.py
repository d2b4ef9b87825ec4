"""Compressed byte streams for the protocol's ``deflate`` and ``snappy`` upgrades.

Both wrap another Trio stream (the socket, or TLS over it, since TLS comes
first as in nsqd). Every ``send_all`` is flushed so a frame is never held
back; a big one is deflated in a worker thread, off the event loop.

Decompression is paced, because a few kilobytes can expand a thousandfold
(a deflated run of NOPs): one ``receive_some`` returns at most
``STEP_OUTPUT`` decompressed bytes, the rest of the input waits, still
compressed, and the next ``receive_some`` is a checkpoint before it expands
another step. The input held back is at most one read of the transport (and
one snappy chunk), so neither memory nor the time between checkpoints
depends on how well the sender's bytes compress; a snappy step also ends
after ``STEP_CHUNKS`` chunks, however little they hold.
"""

from __future__ import annotations

import zlib

import snappy
import trio
from crc32c import crc32c

#: most decompressed bytes one receive returns
STEP_OUTPUT = 256 * 1024
#: most snappy chunks one receive decodes: chunks that give nothing (padding, skippable or empty
#: ones) cost time too, and a read's worth of them held the event loop for 80-100 ms
STEP_CHUNKS = 1024
#: writes larger than this are deflated in a worker thread (zlib lets go of the GIL meanwhile): a
#: deflate consumer's 1 MiB fill of messages that do not compress held the event loop for 40 ms
THREAD_BYTES = 64 * 1024


class CorruptStream(trio.BrokenResourceError):
    """The client's compressed bytes do not decode: nothing more can be read (writing still works)."""

    #: where in the buffered input the bad part begins (snappy: its chunk)
    at = 0


class DeflateStream(trio.abc.Stream):
    """Raw deflate (no zlib header), as nsqd and its clients speak it."""

    def __init__(self, transport: trio.abc.Stream, level: int) -> None:
        self.transport = transport
        self._compress = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        self._decompress = zlib.decompressobj(-zlib.MAX_WBITS)
        #: the stream turned bad: raised once what came before the damage was read
        self._error: CorruptStream | None = None

    async def send_all(self, data) -> None:
        # one send_all at a time (the connection's write turn): the compressor is never shared
        if len(data) > THREAD_BYTES:
            out = await trio.to_thread.run_sync(self._deflate, data)
        else:
            out = self._deflate(data)
        await self.transport.send_all(out)

    def _deflate(self, data) -> bytes:
        c = self._compress
        return c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        while True:
            if self._error is not None:
                raise self._error
            d = self._decompress
            if d.eof:  # the client ended the deflate stream: nothing after it is read (Go: EOF)
                return b""
            if d.unconsumed_tail:
                await trio.lowlevel.checkpoint()
                data = d.unconsumed_tail
            else:
                data = await self.transport.receive_some(max_bytes)
                if not data:
                    return b""
            before = d.copy()  # about 2 µs: what came before damage in the same read is read first
            try:
                out = d.decompress(data, STEP_OUTPUT)
            except zlib.error as exc:
                self._error = CorruptStream(f"bad deflate stream: {exc}")
                out = _good_part(before, data)
            if out:
                return out

    async def aclose(self) -> None:
        await self.transport.aclose()


def _good_part(state, data) -> bytes:
    """What ``data`` gives from ``state`` up to where it turns bad (Go's reader returns that first):
    the longest prefix that decompresses, found by halving (only once, on a stream that failed)."""
    good, bad = 0, len(data)
    while bad - good > 1:
        middle = (good + bad) // 2
        try:
            state.copy().decompress(data[:middle], STEP_OUTPUT)
        except zlib.error:
            bad = middle
        else:
            good = middle
    return state.decompress(data[:good], STEP_OUTPUT) if good else b""


_STREAM_ID = b"sNaPpY"
_MAX_BLOCK = 65536  # uncompressed bytes in one chunk (the framing format's limit)
#: largest chunk we take: a checksum and the worst-case snappy encoding of a full block
_MAX_CHUNK = 4 + 32 + _MAX_BLOCK + _MAX_BLOCK // 6


class SnappyStream(trio.abc.Stream):
    """The snappy framing format (stream identifier, checksummed chunks).

    We decode the framing ourselves, one chunk at a time: a chunk may not
    claim more than ``_MAX_CHUNK`` bytes nor a block more than 64 KiB
    uncompressed, so what we buffer and what one block expands to are bounded
    before anything is allocated. As Go's snappy reader, we require the
    stream identifier first, skip padding and skippable chunks and refuse
    reserved ones and bad checksums.
    """

    def __init__(self, transport: trio.abc.Stream) -> None:
        self.transport = transport
        self._compressor = snappy.StreamCompressor()
        self._buffer = bytearray()
        self._started = False

    async def send_all(self, data) -> None:
        await self.transport.send_all(self._compressor.add_chunk(bytes(data)))

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        while True:
            if self._chunk_ready():
                await trio.lowlevel.checkpoint()
            else:
                data = await self.transport.receive_some(max_bytes)
                if not data:
                    return b""
                self._buffer += data
            out = self._decode()
            if out:
                return out

    def _chunk_ready(self) -> bool:
        buf = self._buffer
        return len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[1:4], "little")

    def _decode(self) -> bytes:
        """Complete chunks from the buffer, up to ``STEP_OUTPUT`` decompressed bytes.

        A bad chunk after good ones is raised on the next call: what came before it is read
        first, as Go's reader returns it (a command it completes still runs, a body it cuts
        short gets its error)."""
        buf = self._buffer
        out: list[bytes] = []
        pos = 0
        try:
            pos = self._decode_into(out)
        except CorruptStream as exc:
            if not out:
                raise
            pos = exc.at
        del buf[:pos]
        return b"".join(out)

    def _decode_into(self, out: list[bytes]) -> int:
        """Decode chunks into ``out``; where the next chunk starts (on a bad one the error says where it began)."""
        buf = self._buffer
        size = 0
        pos = 0
        chunks = 0
        while size < STEP_OUTPUT and chunks < STEP_CHUNKS and len(buf) - pos >= 4:
            chunks += 1
            start = pos
            try:
                kind = buf[pos]
                length = int.from_bytes(buf[pos + 1:pos + 4], "little")
                if length > _MAX_CHUNK:
                    raise _corrupt(f"chunk of {length} bytes")
                end = pos + 4 + length
                if end > len(buf):
                    break
                chunk = bytes(buf[pos + 4:end])
                pos = end
                data = self._chunk_data(kind, length, chunk)
            except CorruptStream as exc:
                exc.at = start
                raise
            if data:
                out.append(data)
                size += len(data)
        return pos

    def _chunk_data(self, kind: int, length: int, chunk: bytes) -> bytes:
        """What one chunk holds (b"" for the stream identifier, padding and skippable chunks)."""
        if kind == 0xFF:
            if chunk != _STREAM_ID:
                raise _corrupt("bad stream identifier")
            self._started = True
            return b""
        if not self._started:
            raise _corrupt("no stream identifier")
        if kind > 0x7F:  # padding and skippable chunks
            return b""
        if kind > 0x01 or length < 4:
            raise _corrupt(f"chunk type 0x{kind:02x}" if kind > 0x01 else "short chunk")
        data = chunk[4:]
        if kind == 0x00:
            if _block_length(data) > _MAX_BLOCK:
                raise _corrupt("block larger than 64 KiB")
            try:
                data = snappy.uncompress(data)
            except snappy.UncompressError as exc:
                raise _corrupt(str(exc) or "bad block") from None
        elif len(data) > _MAX_BLOCK:
            raise _corrupt("block larger than 64 KiB")
        if _masked_crc(data) != int.from_bytes(chunk[:4], "little"):
            raise _corrupt("checksum mismatch")
        return data

    async def aclose(self) -> None:
        await self.transport.aclose()


def _block_length(block: bytes) -> int:
    """The uncompressed length a snappy block starts with (a varint of at most 5 bytes)."""
    n = 0
    for i, byte in enumerate(block[:5]):
        n |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return n
    raise _corrupt("bad block length")


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _corrupt(what: str) -> CorruptStream:
    return CorruptStream(f"bad snappy stream: {what}")
