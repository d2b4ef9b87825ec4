"""The AMQP 1.0 message format (spec 3.2): sections and whole messages.

A bare message is a sequence of sections: header, delivery-annotations,
message-annotations, properties, application-properties, a body (data
sections, amqp-sequence sections or one amqp-value), footer.
:func:`encode_message` and :func:`decode_message` build and read whole
messages; :func:`message_body` finds only the body (and whether the
header asks for a durable message), skipping every other section without
decoding it (the gateway's publish path).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from . import codec
from .codec import DecodeError
from .composite import amqp_field, composite

HEADER = 0x70
DELIVERY_ANNOTATIONS = 0x71
MESSAGE_ANNOTATIONS = 0x72
PROPERTIES = 0x73
APPLICATION_PROPERTIES = 0x74
DATA = 0x75
AMQP_SEQUENCE = 0x76
AMQP_VALUE = 0x77
FOOTER = 0x78


@composite(HEADER, "amqp:header:list")
class Header:
    durable: bool = amqp_field("boolean", False)
    priority: int = amqp_field("ubyte", 4)
    ttl: int | None = amqp_field("uint")
    first_acquirer: bool = amqp_field("boolean", False)
    delivery_count: int = amqp_field("uint", 0)


@composite(PROPERTIES, "amqp:properties:list")
class Properties:
    message_id: Any = amqp_field("*")
    user_id: bytes | None = amqp_field("binary")
    to: Any = amqp_field("*")
    subject: str | None = amqp_field("string")
    reply_to: Any = amqp_field("*")
    correlation_id: Any = amqp_field("*")
    content_type: str | None = amqp_field("symbol")
    content_encoding: str | None = amqp_field("symbol")
    absolute_expiry_time: int | None = amqp_field("timestamp")
    creation_time: int | None = amqp_field("timestamp")
    group_id: str | None = amqp_field("string")
    group_sequence: int | None = amqp_field("uint")
    reply_to_group_id: str | None = amqp_field("string")


class _Restricted:
    """A section that is one described value (a map, binary, list or any value)."""

    __slots__ = ("value",)
    CODE = 0
    KIND: type | tuple[type, ...] = object

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.value == other.value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"

    def encode_amqp(self) -> bytes:
        return b"\x00\x53" + bytes([self.CODE]) + codec.encode(self.value)

    @classmethod
    def from_value(cls, value: Any):
        if not isinstance(value, cls.KIND):
            raise DecodeError(f"{cls.__name__} section holds a {type(value).__name__}")
        return cls(value)


def _restricted(code: int, name: str, kind) -> type:
    cls = type(name.split(":")[1].title().replace("-", ""), (_Restricted,), {"__slots__": (), "CODE": code,
                                                                           "KIND": kind})
    codec.register(code, name, cls.from_value)
    return cls


DeliveryAnnotations = _restricted(DELIVERY_ANNOTATIONS, "amqp:delivery-annotations:map", dict)
MessageAnnotations = _restricted(MESSAGE_ANNOTATIONS, "amqp:message-annotations:map", dict)
ApplicationProperties = _restricted(APPLICATION_PROPERTIES, "amqp:application-properties:map", dict)
Data = _restricted(DATA, "amqp:data:binary", bytes)
AmqpSequence = _restricted(AMQP_SEQUENCE, "amqp:amqp-sequence:list", list)
AmqpValue = _restricted(AMQP_VALUE, "amqp:amqp-value:*", object)
Footer = _restricted(FOOTER, "amqp:footer:map", dict)


@dataclass
class Message:
    """A whole message; ``body`` is a list of Data or AmqpSequence sections, or one AmqpValue."""

    header: Header | None = None
    delivery_annotations: dict | None = None
    message_annotations: dict | None = None
    properties: Properties | None = None
    application_properties: dict | None = None
    body: list = field(default_factory=list)
    footer: dict | None = None


def encode_message(msg: Message) -> bytes:
    parts = []
    if msg.header is not None:
        parts.append(msg.header.encode_amqp())
    if msg.delivery_annotations is not None:
        parts.append(DeliveryAnnotations(msg.delivery_annotations).encode_amqp())
    if msg.message_annotations is not None:
        parts.append(MessageAnnotations(msg.message_annotations).encode_amqp())
    if msg.properties is not None:
        parts.append(msg.properties.encode_amqp())
    if msg.application_properties is not None:
        parts.append(ApplicationProperties(msg.application_properties).encode_amqp())
    parts.extend(section.encode_amqp() for section in msg.body)
    if msg.footer is not None:
        parts.append(Footer(msg.footer).encode_amqp())
    return b"".join(parts)


_SLOTS = {
    Header: "header", DeliveryAnnotations: "delivery_annotations", MessageAnnotations: "message_annotations",
    Properties: "properties", ApplicationProperties: "application_properties", Footer: "footer",
}


def decode_message(payload: bytes) -> Message:
    """Every section of a message; raises :class:`DecodeError` on anything malformed."""
    msg = Message()
    for section in codec.decode_all(payload):
        slot = _SLOTS.get(type(section))
        if slot is not None:
            setattr(msg, slot, section.value if isinstance(section, _Restricted) else section)
        elif isinstance(section, (Data, AmqpSequence, AmqpValue)):
            msg.body.append(section)
        else:
            raise DecodeError(f"not a message section: {section!r}")
    return msg


_U32 = struct.Struct(">I")


def message_body(payload: bytes) -> tuple[bytes, bool]:
    """The body bytes of a message (its data sections joined, or a binary or string
    amqp-value) and whether its header says ``durable``.

    Other sections are skipped undecoded. Raises :class:`DecodeError` for a
    malformed message, a body of another type (amqp-sequence, a non-binary
    value) or a message without a body.
    """
    try:
        data, value, durable = _scan_body(payload)
    except (IndexError, struct.error):
        raise DecodeError("truncated message") from None
    except _Unusual:
        msg = decode_message(payload)
        data = [s.value for s in msg.body if isinstance(s, Data)]
        value = next((s.value for s in msg.body if isinstance(s, AmqpValue)), None)
        durable = msg.header is not None and bool(msg.header.durable)
    if data:
        return (data[0] if len(data) == 1 else b"".join(data)), durable
    if isinstance(value, bytes):
        return value, durable
    if isinstance(value, str):
        return value.encode(), durable
    raise DecodeError("the message body must be data sections or a binary or string amqp-value")


class _Unusual(Exception):
    """A section encoded in a form the fast scan does not handle (a long descriptor)."""


def _scan_body(payload: bytes) -> tuple[list[bytes], Any, bool]:
    pos = 0
    end = len(payload)
    data: list[bytes] = []
    value = None
    durable = False
    while pos < end:
        if payload[pos] != 0:
            raise DecodeError("message section is not a described value")
        if payload[pos + 1] != 0x53:
            raise _Unusual
        code = payload[pos + 2]
        pos += 3
        if code == DATA:
            kind = payload[pos]
            if kind == 0xA0:
                n = payload[pos + 1]
                start = pos + 2
            elif kind == 0xB0:
                n = _U32.unpack_from(payload, pos + 1)[0]
                start = pos + 5
            else:
                raise DecodeError("data section does not hold binary")
            pos = start + n
            if pos > end:
                raise DecodeError("data section runs past the message")
            data.append(payload[start:pos])
        elif code == AMQP_VALUE:
            value, pos = codec.decode(payload, pos)
        elif code == HEADER:
            fields, pos = codec.decode(payload, pos)
            durable = isinstance(fields, list) and bool(fields) and fields[0] is True
        elif HEADER < code <= FOOTER:
            pos = codec.skip(payload, pos)
        else:
            raise DecodeError(f"unknown message section 0x{code:02x}")
    return data, value, durable
