"""NSQ messages as AMQP messages and back.

Consuming, each NSQ message becomes::

    [header: first-acquirer = (NSQ attempts == 1 and never released),
             delivery-count = failed deliveries]   when either differs from the default
    properties: message-id = the NSQ id (16 hex chars, a string),
                creation-time = the NSQ timestamp in milliseconds
    data: the NSQ body

built from pre-encoded pieces around the id, timestamp and body. The header's
first-acquirer (spec 3.2.1) is true on a message's first delivery and false
on every later one; an absent header means first-acquirer false and
delivery-count 0, so a redelivery that failed nothing carries none. The
delivery-count counts failed deliveries (modified with delivery-failed,
timeouts, NSQ REQ), not NSQ attempts: a ``released`` message is redelivered
with the same count. A release does not count an NSQ attempt either; the
channel remembers that the message was acquired, so it comes again with
first-acquirer false.

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
_DATA8_HEADS = [_DATA8 + bytes((n,)) for n in range(256)]
_FIRST_ACQUIRER_HEADER = Header(first_acquirer=True).encode_amqp()
_FIRST_HEAD = _FIRST_ACQUIRER_HEADER + _PROPERTIES_HEAD
_BODY = message.FRAME_OVERHEAD


def encode_delivery(frame: bytes, failed: int = 0, released: bool = False) -> bytes:
    """The AMQP message payload for an NSQ message frame (``released``: it was acquired before)."""
    n = len(frame) - _BODY
    first = frame[17] == 1 and frame[16] == 0 and not released  # the frame's attempts (offset 16) are 1
    if failed:
        head = Header(first_acquirer=first, delivery_count=failed).encode_amqp() + _PROPERTIES_HEAD
    else:
        head = _FIRST_HEAD if first else _PROPERTIES_HEAD
    return b"".join((head, frame[18:34], _PROPERTIES_MIDDLE, _TS.pack(_TS.unpack_from(frame, 8)[0] // 1_000_000),
                     _DATA8_HEADS[n] if n < 256 else _DATA32 + _U32.pack(n), frame[_BODY:]))
