"""NSQ messages as AMQP messages and back.

Consuming, each NSQ message becomes::

    [header: delivery-count = failed deliveries]   only when there were any
    properties: message-id = the NSQ id (16 hex chars, a string),
                creation-time = the NSQ timestamp in milliseconds
    data: the NSQ body

built from pre-encoded pieces around the id, timestamp and body. The header's
delivery-count counts failed deliveries (modified with delivery-failed,
timeouts, NSQ REQ), not NSQ attempts: a ``released`` message is redelivered
with the same count.

Publishing, the NSQ body is the message's data sections joined, or its
amqp-value when that is binary or a string (UTF-8). Every other section
(header, annotations, properties, application-properties, footer) is
dropped: an NSQ message has only a body.
"""

from __future__ import annotations

import struct

from nsqd import message

from .sections import Header

_TS = struct.Struct(">q")
_U32 = struct.Struct(">I")
# properties list of 10 fields: message-id (str8 of 16), 8 nulls, creation-time
_PROPERTIES_HEAD = b"\x00\x53\x73\xc0\x24\x0a\xa1\x10"
_PROPERTIES_MIDDLE = b"\x40" * 8 + b"\x83"
_DATA8 = b"\x00\x53\x75\xa0"
_DATA32 = b"\x00\x53\x75\xb0"


def encode_delivery(frame: bytes, failed: int = 0) -> bytes:
    """The AMQP message payload for an NSQ message frame."""
    body = frame[message.FRAME_OVERHEAD:]
    n = len(body)
    data_head = _DATA8 + bytes((n,)) if n < 256 else _DATA32 + _U32.pack(n)
    parts = [_PROPERTIES_HEAD, frame[18:34], _PROPERTIES_MIDDLE,
             _TS.pack(_TS.unpack_from(frame, 8)[0] // 1_000_000), data_head, body]
    if failed:
        parts.insert(0, Header(delivery_count=failed).encode_amqp())
    return b"".join(parts)
