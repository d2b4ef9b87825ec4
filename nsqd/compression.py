"""Compressed byte streams for the protocol's ``deflate`` and ``snappy`` upgrades.

Both wrap another Trio stream (the socket, or TLS over it, since TLS comes
first as in nsqd). Every ``send_all`` is flushed so a frame is never held
back. Decompression output per call is bounded, so a small compressed input
cannot expand into unbounded memory.
"""

from __future__ import annotations

import zlib

import snappy
import trio

#: most decompressed bytes returned per receive
MAX_EXPANSION = 1024 * 1024


class DeflateStream(trio.abc.Stream):
    """Raw deflate (no zlib header), as nsqd and its clients speak it."""

    def __init__(self, transport: trio.abc.Stream, level: int) -> None:
        self.transport = transport
        self._compress = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        self._decompress = zlib.decompressobj(-zlib.MAX_WBITS)

    async def send_all(self, data) -> None:
        c = self._compress
        await self.transport.send_all(c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH))

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        d = self._decompress
        while True:
            if d.unconsumed_tail:
                out = d.decompress(d.unconsumed_tail, MAX_EXPANSION)
            else:
                data = await self.transport.receive_some(max_bytes)
                if not data:
                    return b""
                try:
                    out = d.decompress(data, MAX_EXPANSION)
                except zlib.error as exc:
                    raise trio.BrokenResourceError(f"bad deflate stream: {exc}") from None
            if out:
                return out

    async def aclose(self) -> None:
        await self.transport.aclose()


class SnappyStream(trio.abc.Stream):
    """The snappy framing format (stream identifier, checksummed chunks)."""

    def __init__(self, transport: trio.abc.Stream) -> None:
        self.transport = transport
        self._compressor = snappy.StreamCompressor()
        self._decompressor = snappy.StreamDecompressor()

    async def send_all(self, data) -> None:
        await self.transport.send_all(self._compressor.add_chunk(bytes(data)))

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        while True:
            data = await self.transport.receive_some(max_bytes)
            if not data:
                return b""
            try:
                out = self._decompressor.decompress(data)
            except snappy.UncompressError as exc:
                raise trio.BrokenResourceError(f"bad snappy stream: {exc}") from None
            if out:
                return out

    async def aclose(self) -> None:
        await self.transport.aclose()
