"""The AMQP 1.0 type system (spec part 1): Python values to bytes and back.

Decoded values keep their AMQP type, so ``decode(encode(v)) == v`` with the
same Python type: plain ``None``, ``bool``, ``int`` (long), ``float``
(double), ``str`` (string), ``bytes`` (binary), ``list`` and ``dict`` stand
for themselves; every other AMQP type has a small wrapper (:class:`UInt`,
:class:`Symbol`, :class:`Timestamp`, ...). Encoding picks the most compact
form of a type (``uint0``, ``smalluint``, ``str8`` ...); decoding accepts
every form.

Described types whose descriptor is registered (performatives, outcomes,
message sections: see :mod:`performatives` and :mod:`sections`) decode to
their classes; any other described value decodes to :class:`Described`.
Garbage never raises anything but :class:`DecodeError`, and values nest at
most ``MAX_NESTING`` deep (performatives need a handful of levels), so a
deeply nested value is a decode error up front rather than a Python
recursion limit hit later, wherever the value is used or encoded again.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any, Callable


class DecodeError(ValueError):
    """Bytes that are not a valid AMQP encoding (``amqp:decode-error``)."""


#: deepest nesting of lists, maps, arrays and described values we decode
MAX_NESTING = 64
_TOO_DEEP = f"values nested deeper than {MAX_NESTING}"
#: how deep the value being decoded is (decoding is synchronous: one counter will do)
_depth = 0


# ---------------------------------------------------------------- wrappers
class UByte(int):
    __slots__ = ()


class UShort(int):
    __slots__ = ()


class UInt(int):
    __slots__ = ()


class ULong(int):
    __slots__ = ()


class Byte(int):
    __slots__ = ()


class Short(int):
    __slots__ = ()


class Int(int):
    __slots__ = ()


class Timestamp(int):
    """Milliseconds since the Unix epoch."""

    __slots__ = ()


class Float(float):
    """A 32-bit float (a plain ``float`` is a double)."""

    __slots__ = ()


class Char(str):
    """One Unicode code point, sent as UTF-32."""

    __slots__ = ()


class Symbol(str):
    """An ASCII symbolic constant (``amqp:accepted:list``, capability names)."""

    __slots__ = ()


class Decimal32(bytes):
    """IEEE 754 decimal32, kept as its 4 raw bytes."""


class Decimal64(bytes):
    """IEEE 754 decimal64, kept as its 8 raw bytes."""


class Decimal128(bytes):
    """IEEE 754 decimal128, kept as its 16 raw bytes."""


class Described:
    """A described value whose descriptor we do not know."""

    __slots__ = ("descriptor", "value")

    def __init__(self, descriptor: Any, value: Any) -> None:
        self.descriptor = descriptor
        self.value = value

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Described) and self.descriptor == other.descriptor
                and self.value == other.value)

    def __repr__(self) -> str:
        return f"Described({self.descriptor!r}, {self.value!r})"


class Array:
    """An AMQP array: items sharing one element constructor ``code``.

    ``descriptor`` is set for arrays of described values (the items are then
    the undescribed values).
    """

    __slots__ = ("code", "items", "descriptor")

    def __init__(self, code: int, items: list, descriptor: Any = None) -> None:
        self.code = code
        self.items = list(items)
        self.descriptor = descriptor

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Array) and self.code == other.code and self.items == other.items
                and self.descriptor == other.descriptor)

    def __repr__(self) -> str:
        return f"Array(0x{self.code:02x}, {self.items!r}, {self.descriptor!r})"

    @classmethod
    def of_symbols(cls, symbols) -> Array:
        items = [Symbol(s) for s in symbols]
        return cls(0xB3 if any(len(s) > 255 for s in items) else 0xA3, items)


# ------------------------------------------------------------------ codes
NULL = 0x40
TRUE = 0x41
FALSE = 0x42
DESCRIBED = 0x00

_B = struct.Struct(">B")
_BB = struct.Struct(">BB")
_H = struct.Struct(">H")
_I = struct.Struct(">I")
_II = struct.Struct(">II")
_Q = struct.Struct(">Q")
_b = struct.Struct(">b")
_h = struct.Struct(">h")
_i = struct.Struct(">i")
_q = struct.Struct(">q")
_f = struct.Struct(">f")
_d = struct.Struct(">d")

# ================================================================= encoding
# Each body encoder writes a value without its constructor; arrays reuse them.


_BODY: dict[int, Callable[[Any], bytes]] = {
    NULL: lambda v: b"",
    0x56: lambda v: b"\x01" if v else b"\x00",
    0x50: _B.pack, 0x60: _H.pack, 0x70: _I.pack, 0x52: _B.pack, 0x43: lambda v: b"",
    0x80: _Q.pack, 0x53: _B.pack, 0x44: lambda v: b"",
    0x51: _b.pack, 0x61: _h.pack, 0x71: _i.pack, 0x54: _b.pack,
    0x81: _q.pack, 0x55: _b.pack,
    0x72: _f.pack, 0x82: _d.pack,
    0x74: bytes, 0x84: bytes, 0x94: bytes,
    0x73: lambda v: _I.pack(ord(v)),
    0x83: _q.pack,
    0x98: lambda v: v.bytes,
    0xA0: lambda v: _B.pack(len(v)) + v, 0xB0: lambda v: _I.pack(len(v)) + v,
    0xA1: lambda v: _sized8(v.encode()), 0xB1: lambda v: _sized32(v.encode()),
    0xA3: lambda v: _sized8(v.encode("ascii")), 0xB3: lambda v: _sized32(v.encode("ascii")),
}


def _sized8(raw: bytes) -> bytes:
    return _B.pack(len(raw)) + raw


def _sized32(raw: bytes) -> bytes:
    return _I.pack(len(raw)) + raw


def _enc_null(v) -> bytes:
    return b"\x40"


def _enc_bool(v) -> bytes:
    return b"\x41" if v else b"\x42"


def _enc_unsigned(full: int, small: int | None, zero: int | None, st: struct.Struct):
    full_b = bytes([full])

    def enc(v: int) -> bytes:
        if v == 0 and zero is not None:
            return bytes([zero])
        if small is not None and v < 256:
            return bytes([small, v])
        return full_b + st.pack(v)

    return enc


def _enc_signed(full: int, small: int | None, st: struct.Struct):
    full_b = bytes([full])

    def enc(v: int) -> bytes:
        if small is not None and -128 <= v <= 127:
            return bytes([small]) + _b.pack(v)
        return full_b + st.pack(v)

    return enc


def _enc_binary(v: bytes) -> bytes:
    n = len(v)
    return (b"\xa0" + _B.pack(n) if n < 256 else b"\xb0" + _I.pack(n)) + v


def _enc_string(v: str) -> bytes:
    raw = v.encode()
    n = len(raw)
    return (b"\xa1" + _B.pack(n) if n < 256 else b"\xb1" + _I.pack(n)) + raw


def _enc_symbol(v: str) -> bytes:
    raw = v.encode("ascii")
    n = len(raw)
    return (b"\xa3" + _B.pack(n) if n < 256 else b"\xb3" + _I.pack(n)) + raw


def _compound(items: bytes, count: int, code8: int, code32: int) -> bytes:
    if len(items) + 1 < 256 and count < 256:
        return bytes([code8]) + _BB.pack(len(items) + 1, count) + items
    return bytes([code32]) + _II.pack(len(items) + 4, count) + items


def encode_list(v) -> bytes:
    if not v:
        return b"\x45"
    return _compound(b"".join([encode(x) for x in v]), len(v), 0xC0, 0xD0)


def encode_map(v: dict) -> bytes:
    parts = []
    for key, value in v.items():
        parts.append(encode(key))
        parts.append(encode(value))
    return _compound(b"".join(parts), len(parts), 0xC1, 0xD1)


#: element constructors that write no bytes per value (spec 1.6.2, 1.6.22) are written in the
#: form that does, so every array the decoder accepts can be encoded again
_WITH_BODY = {TRUE: 0x56, FALSE: 0x56, 0x45: 0xC0}
#: the 32-bit form of a variable-width constructor, for arrays with an element too big for the 8-bit one
_WIDE = {0xA0: 0xB0, 0xA1: 0xB1, 0xA3: 0xB3, 0xC0: 0xD0, 0xC1: 0xD1, 0xE0: 0xF0}


def _enc_array(v: Array) -> bytes:
    content, count = _array_content(v)
    return _compound(content, count, 0xE0, 0xF0)


def _array_content(v: Array) -> tuple[bytes, int]:
    """An array's element constructor and element bodies, and its count."""
    code = _WITH_BODY.get(v.code, v.code)
    try:
        items = b"".join([_element_body(code)(x) for x in v.items])
    except struct.error:  # an element too big for the 8-bit form
        if code not in _WIDE:
            raise
        code = _WIDE[code]
        items = b"".join([_element_body(code)(x) for x in v.items])
    constructor = bytes([code])
    if v.descriptor is not None:
        constructor = b"\x00" + encode(v.descriptor) + constructor
    return constructor + items, len(v.items)


def _element_body(code: int) -> Callable[[Any], bytes]:
    body = _BODY.get(code)
    if body is not None:
        return body
    if code not in (0xC0, 0xD0, 0xC1, 0xD1, 0xE0, 0xF0):
        raise TypeError(f"cannot encode array elements of type 0x{code:02x}")
    return _compound_body(code)


def _compound_body(code: int) -> Callable[[Any], bytes]:
    """Element bodies of arrays of lists, maps or arrays, in the width ``code`` names."""

    def body(x) -> bytes:
        if code in (0xC0, 0xD0):
            encoded = b"".join([encode(i) for i in x])
            count = len(x)
        elif code in (0xC1, 0xD1):
            encoded = b"".join([encode(k) + encode(val) for k, val in x.items()])
            count = 2 * len(x)
        else:
            encoded, count = _array_content(x)
        if code in (0xC0, 0xC1, 0xE0):
            return _BB.pack(len(encoded) + 1, count) + encoded
        return _II.pack(len(encoded) + 4, count) + encoded

    return body


def _enc_described(v: Described) -> bytes:
    return b"\x00" + encode(v.descriptor) + encode(v.value)


_ENCODERS: dict[type, Callable[[Any], bytes]] = {
    type(None): _enc_null,
    bool: _enc_bool,
    UByte: lambda v: b"\x50" + _B.pack(v),
    UShort: lambda v: b"\x60" + _H.pack(v),
    UInt: _enc_unsigned(0x70, 0x52, 0x43, _I),
    ULong: _enc_unsigned(0x80, 0x53, 0x44, _Q),
    Byte: lambda v: b"\x51" + _b.pack(v),
    Short: lambda v: b"\x61" + _h.pack(v),
    Int: _enc_signed(0x71, 0x54, _i),
    int: _enc_signed(0x81, 0x55, _q),
    Float: lambda v: b"\x72" + _f.pack(v),
    float: lambda v: b"\x82" + _d.pack(v),
    Decimal32: lambda v: b"\x74" + v,
    Decimal64: lambda v: b"\x84" + v,
    Decimal128: lambda v: b"\x94" + v,
    Char: lambda v: b"\x73" + _I.pack(ord(v)),
    Timestamp: lambda v: b"\x83" + _q.pack(v),
    uuid.UUID: lambda v: b"\x98" + v.bytes,
    bytes: _enc_binary,
    str: _enc_string,
    Symbol: _enc_symbol,
    list: encode_list,
    tuple: encode_list,
    dict: encode_map,
    Array: _enc_array,
    Described: _enc_described,
}


def encode(value: Any) -> bytes:
    """The AMQP encoding of one value (with its constructor)."""
    enc = _ENCODERS.get(type(value))
    if enc is not None:
        return enc(value)
    encode_amqp = getattr(value, "encode_amqp", None)
    if encode_amqp is None:
        raise TypeError(f"no AMQP encoding for {type(value).__name__}")
    return encode_amqp()


# ================================================================= decoding
# A decoder takes the buffer and the position just after the constructor and
# returns (value, next position). Public entry points turn every low-level
# failure into DecodeError.

Decoder = Callable[[bytes, int], tuple[Any, int]]
_DEC: list[Decoder | None] = [None] * 256

#: described-type factories by descriptor (ULong code and Symbol name)
REGISTRY: dict[Any, Callable[[Any], Any]] = {}


def register(code: int, name: str, factory: Callable[[Any], Any]) -> None:
    REGISTRY[ULong(code)] = factory
    REGISTRY[Symbol(name)] = factory


def _fixed(st: struct.Struct, wrap) -> Decoder:
    size = st.size
    unpack = st.unpack_from

    def dec(buf, pos):
        return wrap(unpack(buf, pos)[0]), pos + size

    return dec


def _const(value) -> Decoder:
    return lambda buf, pos: (value, pos)


def _bool(buf, pos):
    b = buf[pos]
    if b > 1:
        raise DecodeError(f"invalid boolean byte 0x{b:02x}")
    return b == 1, pos + 1


def _take(buf, pos: int, n: int) -> bytes:
    end = pos + n
    if end > len(buf):
        raise DecodeError("value runs past the end of the buffer")
    return buf[pos:end]


def _vbin8(buf, pos):
    n = buf[pos]
    return bytes(_take(buf, pos + 1, n)), pos + 1 + n


def _vbin32(buf, pos):
    n = _I.unpack_from(buf, pos)[0]
    return bytes(_take(buf, pos + 4, n)), pos + 4 + n


def _utf8(raw) -> str:
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError:
        raise DecodeError("string is not valid UTF-8") from None


def _ascii(raw) -> Symbol:
    try:
        return Symbol(bytes(raw).decode("ascii"))
    except UnicodeDecodeError:
        raise DecodeError("symbol is not ASCII") from None


def _str8(buf, pos):
    n = buf[pos]
    return _utf8(_take(buf, pos + 1, n)), pos + 1 + n


def _str32(buf, pos):
    n = _I.unpack_from(buf, pos)[0]
    return _utf8(_take(buf, pos + 4, n)), pos + 4 + n


def _sym8(buf, pos):
    n = buf[pos]
    return _ascii(_take(buf, pos + 1, n)), pos + 1 + n


def _sym32(buf, pos):
    n = _I.unpack_from(buf, pos)[0]
    return _ascii(_take(buf, pos + 4, n)), pos + 4 + n


def _char(buf, pos):
    cp = _I.unpack_from(buf, pos)[0]
    if cp > 0x10FFFF:
        raise DecodeError("char out of the Unicode range")
    return Char(chr(cp)), pos + 4


def _uuid(buf, pos):
    return uuid.UUID(bytes=bytes(_take(buf, pos, 16))), pos + 16


def _raw(n: int, wrap) -> Decoder:
    return lambda buf, pos: (wrap(_take(buf, pos, n)), pos + n)


def _items(buf, pos: int, end: int, count: int) -> list:
    global _depth
    if end > len(buf):
        raise DecodeError("compound value runs past the end of the buffer")
    if count > end - pos:
        raise DecodeError("compound count larger than its size")
    if _depth >= MAX_NESTING:
        raise DecodeError(_TOO_DEEP)
    _depth += 1
    try:
        items = []
        append = items.append
        dec = _DEC
        for _ in range(count):
            d = dec[buf[pos]]
            if d is None:
                raise DecodeError(f"invalid constructor 0x{buf[pos]:02x}")
            value, pos = d(buf, pos + 1)
            append(value)
    finally:
        _depth -= 1
    if pos != end:
        raise DecodeError("compound size does not match its items")
    return items


def _list8(buf, pos):
    size, count = _BB.unpack_from(buf, pos)
    end = pos + 1 + size
    return _items(buf, pos + 2, end, count), end


def _list32(buf, pos):
    size, count = _II.unpack_from(buf, pos)
    end = pos + 4 + size
    return _items(buf, pos + 8, end, count), end


def _to_map(items: list) -> dict:
    if len(items) % 2:
        raise DecodeError("map with an odd number of items")
    try:
        return dict(zip(items[::2], items[1::2]))
    except TypeError:
        raise DecodeError("map key of an unhashable type") from None


def _map8(buf, pos):
    items, end = _list8(buf, pos)
    return _to_map(items), end


def _map32(buf, pos):
    items, end = _list32(buf, pos)
    return _to_map(items), end


def _array_items(buf, pos: int, end: int, count: int) -> Array:
    global _depth
    if end > len(buf):
        raise DecodeError("array runs past the end of the buffer")
    if count > end - pos:
        raise DecodeError("array count larger than its size")
    if _depth >= MAX_NESTING:
        raise DecodeError(_TOO_DEEP)
    _depth += 1
    try:
        descriptor = None
        code = buf[pos]
        pos += 1
        if code == DESCRIBED:
            descriptor, pos = decode_value(buf, pos)
            code = buf[pos]
            pos += 1
        d = _DEC[code]
        if d is None or code == DESCRIBED:
            raise DecodeError(f"invalid array element constructor 0x{code:02x}")
        items = []
        for _ in range(count):
            value, pos = d(buf, pos)
            items.append(value)
    finally:
        _depth -= 1
    if pos != end:
        raise DecodeError("array size does not match its items")
    return Array(code, items, descriptor)


def _array8(buf, pos):
    size, count = _BB.unpack_from(buf, pos)
    end = pos + 1 + size
    return _array_items(buf, pos + 2, end, count), end


def _array32(buf, pos):
    size, count = _II.unpack_from(buf, pos)
    end = pos + 4 + size
    return _array_items(buf, pos + 8, end, count), end


def _described(buf, pos):
    global _depth
    if _depth >= MAX_NESTING:
        raise DecodeError(_TOO_DEEP)
    _depth += 1
    try:
        descriptor, pos = decode_value(buf, pos)
        value, pos = decode_value(buf, pos)
    finally:
        _depth -= 1
    try:
        factory = REGISTRY.get(descriptor)
    except TypeError:  # an unhashable descriptor (a list, a map)
        factory = None
    if factory is None:
        return Described(descriptor, value), pos
    return factory(value), pos


def decode_value(buf, pos: int = 0) -> tuple[Any, int]:
    """One value at ``pos``: ``(value, position after it)``. May raise low-level errors."""
    d = _DEC[buf[pos]]
    if d is None:
        raise DecodeError(f"invalid constructor 0x{buf[pos]:02x}")
    return d(buf, pos + 1)


def decode(buf, pos: int = 0) -> tuple[Any, int]:
    """One value at ``pos``; any malformed input raises :class:`DecodeError`."""
    try:
        return decode_value(buf, pos)
    except DecodeError:
        raise
    except (struct.error, IndexError, RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise DecodeError(f"malformed AMQP value: {exc.__class__.__name__}: {exc}") from None


def decode_all(buf) -> list:
    """Every value in ``buf``, which must hold nothing else."""
    values = []
    pos = 0
    while pos < len(buf):
        value, pos = decode(buf, pos)
        values.append(value)
    return values


for _code, _decoder in {
    NULL: _const(None), TRUE: _const(True), FALSE: _const(False), 0x56: _bool,
    0x50: _fixed(_B, UByte), 0x60: _fixed(_H, UShort), 0x70: _fixed(_I, UInt),
    0x52: _fixed(_B, UInt), 0x43: _const(UInt(0)),
    0x80: _fixed(_Q, ULong), 0x53: _fixed(_B, ULong), 0x44: _const(ULong(0)),
    0x51: _fixed(_b, Byte), 0x61: _fixed(_h, Short), 0x71: _fixed(_i, Int), 0x54: _fixed(_b, Int),
    0x81: _fixed(_q, int), 0x55: _fixed(_b, int),
    0x72: _fixed(_f, Float), 0x82: _fixed(_d, float),
    0x74: _raw(4, Decimal32), 0x84: _raw(8, Decimal64), 0x94: _raw(16, Decimal128),
    0x73: _char, 0x83: _fixed(_q, Timestamp), 0x98: _uuid,
    0xA0: _vbin8, 0xB0: _vbin32, 0xA1: _str8, 0xB1: _str32, 0xA3: _sym8, 0xB3: _sym32,
    0x45: lambda buf, pos: ([], pos), 0xC0: _list8, 0xD0: _list32, 0xC1: _map8, 0xD1: _map32,
    0xE0: _array8, 0xF0: _array32, DESCRIBED: _described,
}.items():
    _DEC[_code] = _decoder

# ==================================================================== skipping
_FIXED_WIDTH = {
    NULL: 0, TRUE: 0, FALSE: 0, 0x43: 0, 0x44: 0, 0x45: 0,
    0x56: 1, 0x50: 1, 0x51: 1, 0x52: 1, 0x53: 1, 0x54: 1, 0x55: 1,
    0x60: 2, 0x61: 2,
    0x70: 4, 0x71: 4, 0x72: 4, 0x73: 4, 0x74: 4,
    0x80: 8, 0x81: 8, 0x82: 8, 0x83: 8, 0x84: 8,
    0x94: 16, 0x98: 16,
}
_SIZE8 = frozenset((0xA0, 0xA1, 0xA3, 0xC0, 0xC1, 0xE0))
_SIZE32 = frozenset((0xB0, 0xB1, 0xB3, 0xD0, 0xD1, 0xF0))


def skip(buf, pos: int, depth: int = 0) -> int:
    """The position after the value at ``pos``, without decoding it."""
    code = buf[pos]
    pos += 1
    width = _FIXED_WIDTH.get(code)
    if width is not None:
        end = pos + width
    elif code in _SIZE8:
        end = pos + 1 + buf[pos]
    elif code in _SIZE32:
        end = pos + 4 + _I.unpack_from(buf, pos)[0]
    elif code == DESCRIBED:
        if depth >= MAX_NESTING:
            raise DecodeError(_TOO_DEEP)
        return skip(buf, skip(buf, pos, depth + 1), depth + 1)
    else:
        raise DecodeError(f"invalid constructor 0x{code:02x}")
    if end > len(buf):
        raise DecodeError("value runs past the end of the buffer")
    return end
