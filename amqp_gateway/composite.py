"""Composite types: described lists whose fields are declared once.

A composite class lists its fields with :func:`amqp_field` (the AMQP type, the
spec default, whether it is mandatory or ``multiple``) and is decorated with
:func:`composite`, which makes it a slotted dataclass, registers its
descriptor with the codec and gives it ``encode_amqp`` and ``from_value``.

Encoding writes ``null`` for fields equal to their default and trims trailing
nulls, as the spec allows. Decoding checks every field's type, so a frame
with a string where a handle belongs is a :class:`~codec.DecodeError`, never a
``TypeError`` deep inside the gateway.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from . import codec
from .codec import Array, DecodeError, Symbol

_UNSIGNED_MAX = {"ubyte": 0xFF, "ushort": 0xFFFF, "uint": 0xFFFFFFFF, "ulong": 0xFFFFFFFFFFFFFFFF}
_UNSIGNED_ENC = {
    "ubyte": lambda v: codec.encode(codec.UByte(v)),
    "ushort": lambda v: codec.encode(codec.UShort(v)),
    "uint": lambda v: codec.encode(codec.UInt(v)),
    "ulong": lambda v: codec.encode(codec.ULong(v)),
}


def _check_unsigned(kind: str) -> Callable[[Any], Any]:
    top = _UNSIGNED_MAX[kind]

    def check(v):
        if type(v) is bool or not isinstance(v, int) or not 0 <= v <= top:
            raise DecodeError(f"expected {kind}, got {v!r}")
        return v

    return check


def _check_type(kind: str, *types: type) -> Callable[[Any], Any]:
    def check(v):
        if not isinstance(v, types):
            raise DecodeError(f"expected {kind}, got {type(v).__name__}")
        return v

    return check


def _check_symbol(v):
    """A symbol, or a string that could be one (some clients send symbols as strings): ASCII only,
    since whatever is taken may be echoed back encoded as a symbol."""
    if type(v) is Symbol:
        return v
    if not isinstance(v, str) or not v.isascii():
        raise DecodeError(f"expected symbol, got {type(v).__name__} {v!r:.40}")
    return Symbol(v)


def _check_symbols(v):
    """A ``multiple`` symbol field: one symbol or an array of them."""
    if isinstance(v, str):
        return (_check_symbol(v),)
    items = v.items if isinstance(v, Array) else v
    if not isinstance(items, list):
        raise DecodeError(f"expected symbols, got {type(v).__name__}")
    return tuple(_check_symbol(item) for item in items)


def _encode_symbols(v) -> bytes:
    if isinstance(v, str):
        return codec.encode(Symbol(v))
    return codec.encode(Array.of_symbols(v))


_CHECK: dict[str, Callable[[Any], Any]] = {
    **{kind: _check_unsigned(kind) for kind in _UNSIGNED_MAX},
    "boolean": _check_type("boolean", bool),
    "string": _check_type("string", str),
    "symbol": _check_symbol,
    "symbols": _check_symbols,
    "binary": _check_type("binary", bytes),
    "timestamp": _check_type("timestamp", int),
    "map": _check_type("map", dict),
    "list": _check_type("list", list),
    "*": lambda v: v,
}

_ENCODE: dict[str, Callable[[Any], bytes]] = {
    **_UNSIGNED_ENC,
    "boolean": codec.encode,
    "string": codec.encode,
    "symbol": lambda v: codec.encode(Symbol(v)),
    "symbols": _encode_symbols,
    "binary": codec.encode,
    "timestamp": lambda v: codec.encode(codec.Timestamp(v)),
    "map": codec.encode_map,
    "list": codec.encode_list,
    "*": codec.encode,
}


def composite_kind(kind: str, cls: type) -> None:
    """Let fields be declared of the composite type ``cls`` (``kind``, as the spec names it): a
    field the code reads as a ``cls`` holds one or nothing, anything else there is a decode error."""
    _CHECK[kind] = _check_type(kind, cls)
    _ENCODE[kind] = codec.encode


def amqp_field(kind: str, default: Any = None, mandatory: bool = False) -> Any:
    """Declare a field: its AMQP type (see ``_CHECK``), spec default, mandatory flag."""
    if kind not in _CHECK:
        raise ValueError(f"unknown field type {kind}")
    return dataclasses.field(default=default, metadata={"kind": kind, "mandatory": mandatory})


def composite(code: int, name: str):
    """Class decorator: a described-list composite type with descriptor ``code``/``name``."""

    def wrap(cls):
        cls = dataclasses.dataclass(slots=True)(cls)
        specs = tuple(
            (f.name, f.metadata["kind"], f.default, f.metadata["mandatory"]) for f in dataclasses.fields(cls)
        )
        checks = tuple((_CHECK[kind], default, mandatory, fname) for fname, kind, default, mandatory in specs)
        head = b"\x00\x53" + bytes([code])

        def encode_amqp(self) -> bytes:
            parts = []
            last = 0
            for fname, kind, default, mandatory in specs:
                value = getattr(self, fname)
                if value is None:
                    if mandatory:
                        raise ValueError(f"{cls.__name__}.{fname} is mandatory")
                    parts.append(b"\x40")
                elif value == default and not mandatory:
                    parts.append(b"\x40")
                else:
                    parts.append(_ENCODE[kind](value))
                    last = len(parts)
            del parts[last:]
            if not parts:
                return head + b"\x45"
            body = b"".join(parts)
            if len(body) + 1 < 256 and len(parts) < 256:
                return head + b"\xc0" + bytes((len(body) + 1, len(parts))) + body
            return head + b"\xd0" + (len(body) + 4).to_bytes(4, "big") + len(parts).to_bytes(4, "big") + body

        def from_value(value):
            if not isinstance(value, list):
                raise DecodeError(f"{cls.__name__} must be a list, got {type(value).__name__}")
            args = []
            for (check, default, mandatory, fname), raw in zip(checks, value):
                if raw is None:
                    if mandatory:
                        raise DecodeError(f"{cls.__name__}.{fname} is mandatory")
                    args.append(default)
                else:
                    args.append(check(raw))
            for check, default, mandatory, fname in checks[len(value):]:
                if mandatory:
                    raise DecodeError(f"{cls.__name__}.{fname} is mandatory")
                args.append(default)
            return cls(*args)

        cls.CODE = code
        cls.NAME = name
        cls.encode_amqp = encode_amqp
        cls.from_value = staticmethod(from_value)
        codec.register(code, name, from_value)
        return cls

    return wrap
