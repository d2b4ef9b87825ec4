"""The AMQP 1.0 type codec, composite types and message sections."""

from __future__ import annotations

import struct
import uuid

import proton
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amqp_gateway import codec, performatives as p, sections
from amqp_gateway.codec import (
    Array, Byte, Char, DecodeError, Decimal32, Decimal64, Decimal128, Described, Float, Int, Short, Symbol,
    Timestamp, UByte, UInt, ULong, UShort, decode, decode_all, encode, skip,
)
from amqp_gateway.mapping import encode_delivery
from nsqd import message

# ------------------------------------------------------------ known bytes
KNOWN = [
    (None, "40"),
    (True, "41"),
    (False, "42"),
    (UByte(255), "50ff"),
    (UShort(0x0102), "600102"),
    (UInt(0), "43"),
    (UInt(5), "5205"),
    (UInt(0x10000), "7000010000"),
    (ULong(0), "44"),
    (ULong(0x10), "5310"),
    (ULong(2**40), "800000010000000000"),
    (Byte(-1), "51ff"),
    (Short(-2), "61fffe"),
    (Int(-1), "54ff"),
    (Int(1000), "71000003e8"),
    (-128, "5580"),
    (2**40, "810000010000000000"),
    (Float(1.0), "723f800000"),
    (1.0, "823ff0000000000000"),
    (Timestamp(1_700_000_000_000), "830000018bcfe56800"),
    (Char("A"), "7300000041"),
    (uuid.UUID(int=1), "98" + "00" * 15 + "01"),
    (b"\x01\x02\x03", "a003010203"),
    ("hello", "a10568656c6c6f"),
    (Symbol("amqp"), "a304616d7170"),
    ([], "45"),
    ([True, False], "c003024142"),
    ({Symbol("k"): 1}, "c1060 2a3016b5501".replace(" ", "")),
    (Array(0xA3, [Symbol("a"), Symbol("bc")]), "e00702a301610262 63".replace(" ", "")),
    (Described(Symbol("x:y"), UInt(0)), "00a303783a7943"),
]


@pytest.mark.parametrize("value, hex_bytes", KNOWN)
def test_known_encodings(value, hex_bytes):
    raw = bytes.fromhex(hex_bytes)
    assert encode(value) == raw
    decoded, end = decode(raw)
    assert end == len(raw)
    assert decoded == value and type(decoded) is type(value)


@pytest.mark.parametrize("hex_bytes, value", [
    ("5601", True),                        # boolean with a value byte
    ("7000000005", UInt(5)),              # a wide uint where a small one would do
    ("8000000000000000ff", ULong(255)),
    ("b000000002abcd", b"\xab\xcd"),      # vbin32
    ("b100000001 78".replace(" ", ""), "x"),  # str32
    ("d00000000600000002 4142".replace(" ", ""), [True, False]),  # list32
    ("f0000000070000000252 0102".replace(" ", ""), Array(0x52, [UInt(1), UInt(2)])),
])
def test_every_form_of_a_type_decodes(hex_bytes, value):
    decoded, _ = decode(bytes.fromhex(hex_bytes))
    assert decoded == value and type(decoded) is type(value)


def test_proton_encodings_decode_to_equal_values():
    # bytes python-qpid-proton's Data.encode() produced for a list of every type
    raw = bytes.fromhex(
        "d000000096000000154041500760012c700001117080000001000000000051fd61fed471fffeee9081ffffff0000000000"
        "723fc0000082400200000000000083000000000012d68773000000e99800000000000000000000000000000005a00362696e"
        "a103737472a30373796dd10000000a00000002a3016ba10176f00000001200000002005501b30000000161000000016200"
        "a303783a795505")
    value, end = decode(raw)
    assert end == len(raw)
    assert value == [
        None, True, UByte(7), UShort(300), UInt(70000), ULong(2**40), Byte(-3), Short(-300), Int(-70000), -2**40,
        Float(1.5), 2.25, Timestamp(1234567), Char("é"), uuid.UUID(int=5), b"bin", "str", Symbol("sym"),
        {Symbol("k"): "v"}, Array(0xB3, [Symbol("a"), Symbol("b")], ULong(1)), Described(Symbol("x:y"), 5),
    ]


def test_our_encodings_decode_in_proton():
    value = [UInt(7), Symbol("s"), "text", b"\x00\x01", {Symbol("k"): [True, None]}, Timestamp(5),
             Array.of_symbols(["a", "b"])]
    data = proton.Data()
    data.decode(encode(value))
    assert data.get_object() == [7, "s", "text", b"\x00\x01", {"k": [True, None]}, 5,
                                 proton.Array(proton.UNDESCRIBED, proton.Data.SYMBOL, "a", "b")]


# ------------------------------------------------------------ round trips
_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(0, 2**8 - 1).map(UByte), st.integers(0, 2**16 - 1).map(UShort),
    st.integers(0, 2**32 - 1).map(UInt), st.integers(0, 2**64 - 1).map(ULong),
    st.integers(-2**7, 2**7 - 1).map(Byte), st.integers(-2**15, 2**15 - 1).map(Short),
    st.integers(-2**31, 2**31 - 1).map(Int), st.integers(-2**63, 2**63 - 1),
    st.floats(allow_nan=False, width=32).map(Float), st.floats(allow_nan=False),
    st.integers(-2**63, 2**63 - 1).map(Timestamp), st.characters().map(Char),
    st.uuids(), st.binary(max_size=300), st.text(max_size=300),
    st.text(alphabet=st.characters(max_codepoint=127), max_size=300).map(Symbol),
    st.binary(min_size=4, max_size=4).map(Decimal32), st.binary(min_size=8, max_size=8).map(Decimal64),
    st.binary(min_size=16, max_size=16).map(Decimal128),
)
_keys = st.one_of(st.text(max_size=20), st.text(alphabet="abcxyz", max_size=20).map(Symbol),
                  st.integers(0, 2**32 - 1).map(UInt), st.integers(-2**63, 2**63 - 1))
_arrays = st.one_of(
    st.lists(st.text(alphabet="abc", max_size=300).map(Symbol), max_size=5).map(
        lambda items: Array(0xB3 if any(len(s) > 255 for s in items) else 0xA3, items)),
    st.lists(st.integers(0, 2**32 - 1).map(UInt), max_size=40).map(lambda items: Array(0x70, items)),
    st.lists(st.integers(-2**63, 2**63 - 1), max_size=40).map(lambda items: Array(0x81, items)),
)
_values = st.recursive(
    st.one_of(_scalars, _arrays),
    lambda children: st.one_of(
        st.lists(children, max_size=8),
        st.dictionaries(_keys, children, max_size=6),
        st.builds(Described, st.text(alphabet="xyz:", min_size=1, max_size=8).map(lambda s: Symbol("t:" + s)),
                  children),
    ),
    max_leaves=30,
)


@given(_values)
@settings(max_examples=300, deadline=None)
def test_round_trip_keeps_value_and_type(value):
    raw = encode(value)
    decoded, end = decode(raw)
    assert end == len(raw)
    assert decoded == value
    assert type(decoded) is type(value)
    assert skip(raw, 0) == len(raw)
    assert encode(decoded) == raw


@given(st.binary(max_size=200))
@settings(max_examples=2000, deadline=None)
def test_garbage_raises_only_decode_error(data):
    try:
        decode_all(data)
    except DecodeError:
        pass
    try:
        sections.decode_message(data)
    except DecodeError:
        pass
    try:
        sections.message_body(data)
    except DecodeError:
        pass


@given(_values, st.data())
@settings(max_examples=300, deadline=None)
def test_corrupted_encodings_raise_only_decode_error(value, data):
    raw = bytearray(encode(value))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for candidate in (bytes(raw), bytes(raw[:cut])):
        try:
            decode_all(candidate)
        except DecodeError:
            pass


@pytest.mark.parametrize("hex_bytes, code", [
    ("e0020141", 0x56),                   # array of booleans written with true (0x41)
    ("e0020142", 0x56),                   # ... and with false (0x42)
    ("e0020145", 0xC0),                   # array of empty lists (0x45)
    ("e00401c00100", 0xC0),               # array of lists
    ("e00401c10100", 0xC1),               # array of maps
    ("e00601e0030156 01", 0xE0),          # array of arrays of booleans
    ("f00000000f 00000001 f0 00000006 00000001 56 00", 0xF0),  # the same, 32-bit forms
    ("e0060100a301784 1", 0x56),          # array of described booleans
])
def test_every_array_the_decoder_accepts_encodes_again(hex_bytes, code):
    value, _ = decode(bytes.fromhex(hex_bytes.replace(" ", "")))
    again, _ = decode(encode(value))
    assert (again.code, again.items, again.descriptor) == (code, value.items, value.descriptor)


def test_array_elements_too_big_for_the_8_bit_form_take_the_32_bit_one():
    value = Array(0xE0, [Array(0xA0, [b"x" * 300]), Array(0xA0, [])])
    again, _ = decode(encode(value))
    assert again.code == 0xF0 and again.items[0].code == 0xB0 and again.items[0].items == [b"x" * 300]


@given(st.binary(max_size=60))
@settings(max_examples=3000, deadline=None)
def test_whatever_decodes_encodes_again(data):
    # arrays mostly: an array header in front makes fuzzed bytes arrays of odd element types
    for candidate in (data, b"\xe0" + data, b"\xe0" + bytes([len(data) + 1]) + b"\x01" + data):
        try:
            value, _ = decode(candidate)
        except DecodeError:
            continue
        decode(encode(value))


@pytest.mark.parametrize("hex_bytes", [
    "",                       # nothing
    "ff",                     # no such constructor
    "a105616263",             # string shorter than its size
    "a102c328",               # invalid UTF-8
    "a302c3a9",               # non-ASCII symbol
    "c00501 41",              # list whose size runs past the buffer
    "c0030541 42",            # list count larger than its size
    "c1030141 42",            # map with an odd number of items
    "c1050245 4141",          # map with an unhashable (list) key
    "e0040243 4141",          # array of zero-width elements claiming more than its size
    "5602",                   # boolean byte other than 0 or 1
    "7300110000",             # char beyond Unicode
    "c0" + "0201" * 1 + "c0" * 3000,  # nesting too deep or truncated
])
def test_malformed_values(hex_bytes):
    with pytest.raises(DecodeError):
        decode(bytes.fromhex(hex_bytes.replace(" ", "")))


def test_deep_nesting_is_a_decode_error_not_a_crash():
    depth = 5000
    raw = b"\xd0" + b"".join(struct.pack(">II", 4 + 9 * (depth - i - 1) + 1, 1) + b"\xd0" for i in range(depth))
    with pytest.raises(DecodeError):
        decode(raw)


# ------------------------------------------------------------ composites
def test_performative_round_trip_and_compact_defaults():
    attach = p.Attach("link", 3, p.RECEIVER, p.SND_SETTLED, source=p.Source("/topics/t/channels/c"),
                      target=p.Target(), initial_delivery_count=None, properties={Symbol("k"): "v"})
    raw = attach.encode_amqp()
    assert raw.startswith(b"\x00\x53\x12\xc0")
    decoded, _ = decode(raw)
    assert decoded == attach
    assert decoded.rcv_settle_mode == p.RCV_FIRST and decoded.max_message_size is None
    # defaults are written as null and trailing nulls are trimmed
    assert p.Close().encode_amqp() == bytes.fromhex("00531845")
    assert p.Flow(0, 10, 0, 10, drain=False).encode_amqp() == bytes.fromhex("005313c0070443520a43520a")


def test_performatives_decode_from_symbolic_descriptors():
    raw = b"\x00\xa3\x0famqp:begin:list" + codec.encode_list([None, UInt(0), UInt(10), UInt(20)])
    begin, _ = decode(raw)
    assert begin == p.Begin(None, 0, 10, 20)


@pytest.mark.parametrize("fields, problem", [
    ([], "mandatory"),                                        # container-id missing
    (["c", None, "big"], "expected uint"),                    # max-frame-size as a string
    (["c", None, UInt(512), UInt(70000)], "expected ushort"),  # channel-max out of range
    (["c", None, None, None, None, UInt(5)], "expected symbol"),  # locales not symbols
    (["c", None, None, None, None, "\u00e9"], "expected symbol"),  # a string that cannot be a symbol
    (["c", None, None, None, None, None, None, None, "\u0462"], "expected symbol"),  # offered capabilities
])
def test_composite_fields_are_type_checked(fields, problem):
    raw = b"\x00\x53\x10" + codec.encode_list(fields)
    with pytest.raises(DecodeError, match=problem):
        decode(raw)


def test_multiple_symbol_fields_accept_one_symbol_or_an_array():
    single, _ = decode(b"\x00\x53\x10" + codec.encode_list(["c", None, None, None, None, Symbol("en")]))
    many, _ = decode(p.Open("c", outgoing_locales=("en", "fr")).encode_amqp())
    assert single.outgoing_locales == ("en",)
    assert many.outgoing_locales == ("en", "fr")


@pytest.mark.parametrize("text", ["\u00e9", "\u0462", "amqp:not-found"])
def test_a_string_where_a_symbol_belongs_must_be_ascii(text):
    # whatever a composite takes as a symbol may be echoed back encoded as one (a disposition's
    # state, an attach's source): a non-ASCII string taken raised UnicodeEncodeError then
    placeholder = Symbol("X" * len(text.encode()))  # a symbol the size of the string, replaced by it
    raw = p.Rejected(p.Error(placeholder)).encode_amqp().replace(encode(placeholder), encode(text))
    assert encode(text)[0] == 0xA1  # a string, not a symbol
    if not text.isascii():
        with pytest.raises(DecodeError, match="expected symbol"):
            decode(raw)
        return
    rejected, _ = decode(raw)  # an ASCII string is taken as the symbol it spells
    assert type(rejected.error.condition) is Symbol
    assert decode(rejected.encode_amqp())[0] == rejected


def test_outcomes_and_errors():
    rejected = p.Rejected(p.Error("amqp:not-found", "gone", {Symbol("x"): 1}))
    assert decode(rejected.encode_amqp())[0] == rejected
    assert decode(p.Accepted().encode_amqp())[0] == p.Accepted()
    modified = p.Modified(delivery_failed=True)
    assert decode(modified.encode_amqp())[0] == modified


# ------------------------------------------------------------ messages
def _section(code: int, value) -> bytes:
    return b"\x00\x53" + bytes([code]) + encode(value)


@pytest.mark.parametrize("payload, body", [
    (_section(0x75, b"abc"), b"abc"),
    (_section(0x75, b"ab") + _section(0x75, b"c"), b"abc"),
    (_section(0x75, b"x" * 300), b"x" * 300),
    (_section(0x77, b"bin"), b"bin"),
    (_section(0x77, "text é"), "text é".encode()),
    # every other section is skipped
    (sections.Header(durable=True).encode_amqp() + _section(0x72, {Symbol("a"): 1})
     + sections.Properties(message_id="m", subject="s").encode_amqp() + _section(0x74, {"k": "v"})
     + _section(0x75, b"body") + _section(0x78, {"f": 1}), b"body"),
    # proton's default message: empty header and properties lists, amqp-value binary
    (bytes.fromhex("0053704500537345005377a00568656c6c6f"), b"hello"),
    # a section with a ulong descriptor takes the slow path
    (b"\x00\x80" + (0x75).to_bytes(8, "big") + encode(b"long"), b"long"),
])
def test_message_body(payload, body):
    assert sections.message_body(payload)[0] == body


@pytest.mark.parametrize("payload", [
    b"",                                        # no body
    _section(0x70, []),                         # header only
    _section(0x76, [1, 2]),                     # amqp-sequence
    _section(0x77, UInt(5)),                    # an amqp-value that is not binary or text
    _section(0x75, b"abc")[:-1],                # truncated
    b"\x00\x53\x99\x45",                        # unknown section
    b"\x41",                                    # not a section
])
def test_message_body_refuses(payload):
    with pytest.raises(DecodeError):
        sections.message_body(payload)


def test_message_round_trip():
    msg = sections.Message(
        header=sections.Header(delivery_count=3), message_annotations={Symbol("x-opt"): 1},
        properties=sections.Properties(message_id="id", creation_time=5),
        application_properties={"k": "v"}, body=[sections.Data(b"a"), sections.Data(b"b")],
        footer={Symbol("f"): 2})
    assert sections.decode_message(sections.encode_message(msg)) == msg


def test_nsq_message_as_amqp_message():
    frame = message.encode_frame(b"0123456789abcdef", b"payload", 1_700_000_000_123_456_789, attempts=3)
    plain = sections.decode_message(encode_delivery(frame))
    assert plain.header is None
    assert plain.properties.message_id == "0123456789abcdef"
    assert plain.properties.creation_time == 1_700_000_000_123
    assert plain.body == [sections.Data(b"payload")]
    failed = sections.decode_message(encode_delivery(frame, failed=2))
    assert failed.header.delivery_count == 2
    assert failed.header.first_acquirer is False
    big = sections.decode_message(encode_delivery(message.encode_frame(b"0123456789abcdef", b"y" * 1000, 0)))
    assert big.body == [sections.Data(b"y" * 1000)]


@pytest.mark.parametrize("payload, durable", [
    (sections.Header(durable=True).encode_amqp() + _section(0x75, b"x"), True),
    (sections.Header(durable=False, priority=9).encode_amqp() + _section(0x75, b"x"), False),
    (bytes.fromhex("0053704500537345005377a00568656c6c6f"), False),  # an empty header list
    (_section(0x75, b"x"), False),
    (b"\x00\x80" + (0x70).to_bytes(8, "big") + encode([True]) + _section(0x75, b"x"), True),  # slow path
])
def test_message_body_tells_a_durable_message(payload, durable):
    assert sections.message_body(payload) == (b"x" if durable or payload[-1:] == b"x" else b"hello", durable)


@pytest.mark.parametrize(("attempts", "failed", "header"), [
    (1, 0, sections.Header(first_acquirer=True)),        # a first delivery says so (spec 3.2.1)
    (1, 1, sections.Header(first_acquirer=True, delivery_count=1)),
    (2, 0, None),                                        # absent: first-acquirer false, delivery-count 0
    (2, 1, sections.Header(first_acquirer=False, delivery_count=1)),
    (300, 0, None),                                      # attempts 0x012c: only the whole field counts
    (257, 3, sections.Header(first_acquirer=False, delivery_count=3)),
])
def test_first_acquirer_only_on_a_first_delivery(attempts, failed, header):
    frame = message.encode_frame(b"0123456789abcdef", b"b", 0, attempts=attempts)
    decoded = sections.decode_message(encode_delivery(frame, failed))
    assert decoded.header == header
    assert decoded.body == [sections.Data(b"b")]
