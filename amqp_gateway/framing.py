"""AMQP 1.0 framing (spec 2.3, 5.3.1): protocol headers and frames, split across reads.

A frame is ``size(4) doff(1) type(1) channel(2)``, an extended header of
``doff * 4 - 8`` bytes (ignored) and a body; a frame with an empty body is a
heartbeat. :class:`FrameReader` turns bytes into :class:`Header` and frame
items. It never copies a whole read: complete frames are sliced out of the
bytes they arrived in, and only an incomplete tail is kept, in a bytearray
that grows until its frame is whole (so a peer dribbling one byte at a time
costs linear, not quadratic, work).
"""

from __future__ import annotations

import struct
from typing import Iterator

from .errors import FRAMING_ERROR, ConnectionFault

PROTOCOL_AMQP = 0
PROTOCOL_SASL = 3
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"

TYPE_AMQP = 0
TYPE_SASL = 1

#: the largest frame either side may send before open has been exchanged
MIN_MAX_FRAME_SIZE = 512
#: the largest SASL frame we read: a PLAIN password may be a long token (a JWT for the auth server),
#: which 512 bytes shut out; AMQP claims-based security allows more, and RabbitMQ and Qpid Broker-J
#: read SASL frames up to 8 KiB too
SASL_MAX_FRAME_SIZE = 8192
EMPTY_FRAME = b"\x00\x00\x00\x08\x02\x00\x00\x00"

FRAME_HEAD = struct.Struct(">IBBH")


class Header:
    """A protocol header: ``AMQP`` + protocol id + version major, minor, revision."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    @property
    def protocol(self) -> int:
        return self.raw[4]

    @property
    def valid(self) -> bool:
        return self.raw[:4] == b"AMQP" and self.raw[5:] == b"\x01\x00\x00"


def encode_frame(channel: int, body: bytes, frame_type: int = TYPE_AMQP) -> bytes:
    return FRAME_HEAD.pack(len(body) + 8, 2, frame_type, channel) + body


class FrameReader:
    """Bytes in, ``Header`` or ``(type, channel, body)`` items out.

    Set :attr:`expect_header` when the next thing on the wire is a protocol
    header (at the start and after a SASL exchange). Set :attr:`paused` while
    what follows cannot be read yet (a SASL outcome is being decided, and
    whether a header comes next depends on it): the rest is kept for the next
    :meth:`feed`. :attr:`max_frame_size` bounds incoming frames; a bigger one
    is a framing error.
    """

    def __init__(self, max_frame_size: int = MIN_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self.expect_header = True
        self.paused = False
        self._partial = bytearray()
        self._need = 0

    def feed(self, data: bytes) -> Iterator[Header | tuple[int, int, bytes]]:
        """Every complete item in what has arrived so far (a generator: it
        reads :attr:`expect_header` and :attr:`paused` afresh before each item)."""
        if self._partial:
            self._partial += data
            if len(self._partial) < self._need:
                return
            data = bytes(self._partial)
            self._partial.clear()
        pos = 0
        end = len(data)
        unpack = FRAME_HEAD.unpack_from
        while pos < end:
            if self.paused:
                self._keep(data, pos, 8)
                return
            if self.expect_header:
                if end - pos < 8:
                    self._keep(data, pos, 8)
                    return
                self.expect_header = False
                yield Header(data[pos:pos + 8])
                pos += 8
                continue
            if end - pos < 8:
                self._keep(data, pos, 8)
                return
            size, doff, frame_type, channel = unpack(data, pos)
            if size > self.max_frame_size:
                raise ConnectionFault(FRAMING_ERROR, f"frame of {size} bytes exceeds max-frame-size "
                                                     f"{self.max_frame_size}")
            if doff < 2 or size < doff * 4:
                raise ConnectionFault(FRAMING_ERROR, f"bad frame header (size {size}, doff {doff})")
            if end - pos < size:
                self._keep(data, pos, size)
                return
            yield frame_type, channel, data[pos + doff * 4:pos + size]
            pos += size

    def _keep(self, data: bytes, pos: int, need: int) -> None:
        self._partial += data[pos:]
        self._need = need
