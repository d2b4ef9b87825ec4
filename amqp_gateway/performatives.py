"""The frame bodies of AMQP 1.0 (spec 2.7, 2.8, 3.4, 3.5, 5.3) as composite types.

Field names follow the spec with ``-`` written ``_``; defaults are the spec's.
Roles are booleans (``SENDER`` False, ``RECEIVER`` True), settle modes small
integers, as on the wire.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .composite import amqp_field, composite, composite_kind

SENDER = False
RECEIVER = True

SND_UNSETTLED = 0
SND_SETTLED = 1
SND_MIXED = 2
RCV_FIRST = 0
RCV_SECOND = 1

SASL_OK = 0
SASL_AUTH = 1
SASL_SYS_PERM = 3
SASL_SYS_TEMP = 4


@composite(0x1D, "amqp:error:list")
class Error:
    condition: str = amqp_field("symbol", mandatory=True)
    description: str | None = amqp_field("string")
    info: dict | None = amqp_field("map")


composite_kind("error", Error)

# ------------------------------------------------------------ performatives
@composite(0x10, "amqp:open:list")
class Open:
    container_id: str = amqp_field("string", mandatory=True)
    hostname: str | None = amqp_field("string")
    max_frame_size: int = amqp_field("uint", 0xFFFFFFFF)
    channel_max: int = amqp_field("ushort", 0xFFFF)
    idle_time_out: int | None = amqp_field("uint")
    outgoing_locales: tuple = amqp_field("symbols", ())
    incoming_locales: tuple = amqp_field("symbols", ())
    offered_capabilities: tuple = amqp_field("symbols", ())
    desired_capabilities: tuple = amqp_field("symbols", ())
    properties: dict | None = amqp_field("map")


@composite(0x11, "amqp:begin:list")
class Begin:
    remote_channel: int | None = amqp_field("ushort")
    next_outgoing_id: int = amqp_field("uint", mandatory=True)
    incoming_window: int = amqp_field("uint", mandatory=True)
    outgoing_window: int = amqp_field("uint", mandatory=True)
    handle_max: int = amqp_field("uint", 0xFFFFFFFF)
    offered_capabilities: tuple = amqp_field("symbols", ())
    desired_capabilities: tuple = amqp_field("symbols", ())
    properties: dict | None = amqp_field("map")


@composite(0x12, "amqp:attach:list")
class Attach:
    name: str = amqp_field("string", mandatory=True)
    handle: int = amqp_field("uint", mandatory=True)
    role: bool = amqp_field("boolean", mandatory=True)
    snd_settle_mode: int = amqp_field("ubyte", SND_MIXED)
    rcv_settle_mode: int = amqp_field("ubyte", RCV_FIRST)
    source: Any = amqp_field("*")
    target: Any = amqp_field("*")
    unsettled: dict | None = amqp_field("map")
    incomplete_unsettled: bool = amqp_field("boolean", False)
    initial_delivery_count: int | None = amqp_field("uint")
    max_message_size: int | None = amqp_field("ulong")
    offered_capabilities: tuple = amqp_field("symbols", ())
    desired_capabilities: tuple = amqp_field("symbols", ())
    properties: dict | None = amqp_field("map")


@composite(0x13, "amqp:flow:list")
class Flow:
    next_incoming_id: int | None = amqp_field("uint")
    incoming_window: int = amqp_field("uint", mandatory=True)
    next_outgoing_id: int = amqp_field("uint", mandatory=True)
    outgoing_window: int = amqp_field("uint", mandatory=True)
    handle: int | None = amqp_field("uint")
    delivery_count: int | None = amqp_field("uint")
    link_credit: int | None = amqp_field("uint")
    available: int | None = amqp_field("uint")
    drain: bool = amqp_field("boolean", False)
    echo: bool = amqp_field("boolean", False)
    properties: dict | None = amqp_field("map")


@composite(0x14, "amqp:transfer:list")
class Transfer:
    handle: int = amqp_field("uint", mandatory=True)
    delivery_id: int | None = amqp_field("uint")
    delivery_tag: bytes | None = amqp_field("binary")
    message_format: int | None = amqp_field("uint")
    settled: bool | None = amqp_field("boolean")
    more: bool = amqp_field("boolean", False)
    rcv_settle_mode: int | None = amqp_field("ubyte")
    state: Any = amqp_field("*")
    resume: bool = amqp_field("boolean", False)
    aborted: bool = amqp_field("boolean", False)
    batchable: bool = amqp_field("boolean", False)


@composite(0x15, "amqp:disposition:list")
class Disposition:
    role: bool = amqp_field("boolean", mandatory=True)
    first: int = amqp_field("uint", mandatory=True)
    last: int | None = amqp_field("uint")
    settled: bool = amqp_field("boolean", False)
    state: Any = amqp_field("*")
    batchable: bool = amqp_field("boolean", False)


@composite(0x16, "amqp:detach:list")
class Detach:
    handle: int = amqp_field("uint", mandatory=True)
    closed: bool = amqp_field("boolean", False)
    error: Error | None = amqp_field("error")


@composite(0x17, "amqp:end:list")
class End:
    error: Error | None = amqp_field("error")


@composite(0x18, "amqp:close:list")
class Close:
    error: Error | None = amqp_field("error")


# ------------------------------------------------------------------- SASL
@composite(0x40, "amqp:sasl-mechanisms:list")
class SaslMechanisms:
    sasl_server_mechanisms: tuple = amqp_field("symbols", mandatory=True)


@composite(0x41, "amqp:sasl-init:list")
class SaslInit:
    mechanism: str = amqp_field("symbol", mandatory=True)
    initial_response: bytes | None = amqp_field("binary")
    hostname: str | None = amqp_field("string")


@composite(0x42, "amqp:sasl-challenge:list")
class SaslChallenge:
    challenge: bytes = amqp_field("binary", mandatory=True)


@composite(0x43, "amqp:sasl-response:list")
class SaslResponse:
    response: bytes = amqp_field("binary", mandatory=True)


@composite(0x44, "amqp:sasl-outcome:list")
class SaslOutcome:
    code: int = amqp_field("ubyte", mandatory=True)
    additional_data: bytes | None = amqp_field("binary")


# --------------------------------------------------------- delivery states
@composite(0x23, "amqp:received:list")
class Received:
    section_number: int = amqp_field("uint", mandatory=True)
    section_offset: int = amqp_field("ulong", mandatory=True)


@composite(0x24, "amqp:accepted:list")
class Accepted:
    pass


@composite(0x25, "amqp:rejected:list")
class Rejected:
    error: Error | None = amqp_field("error")


@composite(0x26, "amqp:released:list")
class Released:
    pass


@composite(0x27, "amqp:modified:list")
class Modified:
    delivery_failed: bool = amqp_field("boolean", False)
    undeliverable_here: bool = amqp_field("boolean", False)
    message_annotations: dict | None = amqp_field("map")


#: outcomes that settle a delivery for good (received is only a progress report)
TERMINAL_OUTCOMES = (Accepted, Rejected, Released, Modified)


# -------------------------------------------------------- source and target
@composite(0x28, "amqp:source:list")
class Source:
    address: Any = amqp_field("*")
    durable: int = amqp_field("uint", 0)
    expiry_policy: str = amqp_field("symbol", "session-end")
    timeout: int = amqp_field("uint", 0)
    dynamic: bool = amqp_field("boolean", False)
    dynamic_node_properties: dict | None = amqp_field("map")
    distribution_mode: str | None = amqp_field("symbol")
    filter: dict | None = amqp_field("map")
    default_outcome: Any = amqp_field("*")
    outcomes: tuple = amqp_field("symbols", ())
    capabilities: tuple = amqp_field("symbols", ())


@composite(0x29, "amqp:target:list")
class Target:
    address: Any = amqp_field("*")
    durable: int = amqp_field("uint", 0)
    expiry_policy: str = amqp_field("symbol", "session-end")
    timeout: int = amqp_field("uint", 0)
    dynamic: bool = amqp_field("boolean", False)
    dynamic_node_properties: dict | None = amqp_field("map")
    capabilities: tuple = amqp_field("symbols", ())


# ------------------------------------------------------------ frame size
def _cut_error(error: Error | None, over: int) -> Error | None:
    """``error`` ``over`` bytes shorter, or more: its description cut, its info left out."""
    if error is None or not error.description:
        return None if error is None else Error(error.condition)
    raw = error.description.encode()
    return Error(error.condition, raw[:max(len(raw) - over - 4, 0)].decode(errors="ignore") or None)


def _over(performative: Any, room: int) -> int:
    return len(performative.encode_amqp()) - room


def _bare(terminus: Any) -> Any:
    """A source or target with its address only."""
    return type(terminus)(terminus.address) if isinstance(terminus, (Source, Target)) else terminus


_Shrink = Callable[[Any, int], Any]
#: how each performative is made smaller, step by step, when it outgrows the peer's max-frame-size
_SHRINK: dict[type, tuple[_Shrink, ...]] = {
    Close: (lambda c, room: Close(_cut_error(c.error, _over(c, room))), lambda c, room: Close()),
    End: (lambda e, room: End(_cut_error(e.error, _over(e, room))), lambda e, room: End()),
    Detach: (lambda d, room: dataclasses.replace(d, error=_cut_error(d.error, _over(d, room))),
             lambda d, room: dataclasses.replace(d, error=None)),
    Disposition: (
        lambda d, room: dataclasses.replace(d, state=Rejected(_cut_error(d.state.error, _over(d, room))))
        if isinstance(d.state, Rejected) else d,
        lambda d, room: dataclasses.replace(d, state=None),
    ),
    Attach: (
        lambda a, room: dataclasses.replace(a, unsettled=None, properties=None, offered_capabilities=(),
                                            desired_capabilities=()),
        lambda a, room: dataclasses.replace(a, source=_bare(a.source), target=_bare(a.target)),
    ),
}


def fit(performative: Any, room: int) -> Any:
    """``performative`` in at most ``room`` bytes (spec 2.7.1: no frame beyond the peer's
    max-frame-size, 512 at the least): error descriptions are cut, what an attach or a
    disposition can do without is left out. None if it still does not fit (an attach
    whose name alone is too long: close, end and detach always fit)."""
    for shrink in _SHRINK.get(type(performative), ()):
        if _over(performative, room) <= 0:
            return performative
        performative = shrink(performative, room)
    return performative if _over(performative, room) <= 0 else None
