"""A link endpoint (spec 2.6): attach/detach, link credit and transfers.

Flow control follows spec 2.6.7. The receiver decides ``link-credit`` (set,
not added) and ``drain``; the sender owns ``delivery-count`` (RFC-1982) and
``available``. A sender receiving a flow sets::

    link-credit(snd) := delivery-count(rcv) + link-credit(rcv) - delivery-count(snd)

and a drained sender advances delivery-count by its unused credit, sets
credit 0 and reports with a flow. Each transfer moves delivery-count on by
one and uses one credit on both ends.

Outgoing single-frame transfers are written from pre-encoded pieces (only the
frame size, delivery-id and tag change), straight into the connection's
output list, so a batch costs a few list appends per message.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from . import codec, serial
from .framing import FRAME_HEAD
from .performatives import (
    RCV_FIRST, RCV_SECOND, RECEIVER, SENDER, SND_MIXED, SND_SETTLED, Attach, Detach, Disposition, Error, Transfer,
)

if TYPE_CHECKING:
    from .session import Session

_U32 = struct.Struct(">I")
_SETTLED_TAIL = (b"\x43\x42", b"\x43\x41")  # message-format 0, settled false/true


class Link:
    def __init__(self, session: Session, name: str, role: bool, handle: int) -> None:
        self.session = session
        self.name = name
        #: our role: SENDER (False) or RECEIVER (True)
        self.role = role
        self.handle = handle
        self.remote_handle: int | None = None
        self.remote_attach: Attach | None = None
        self.source: Any = None
        self.target: Any = None
        self.snd_settle_mode = SND_MIXED
        self.rcv_settle_mode = RCV_FIRST
        self.delivery_count = 0
        #: the delivery-count a sender announced in its attach
        self.initial_delivery_count = 0
        self.credit = 0
        self.drain = False
        #: sender: a drain asked for since our last flow, which it is owed once the credit is used
        #: up, by transfers too (go-amqp's and the Azure SDKs' drain wait for that flow)
        self.drain_owed = False
        self.available = 0
        #: receiving links: deliveries above this many payload bytes arrive with payload None (0: no limit)
        self.max_message_size = 0
        self.attach_sent = self.attach_received = False
        self.detach_sent = self.detach_received = False
        #: our detach, held until our attach answers the peer's (spec 2.6.3: no detach before it)
        self.held_detach: Detach | None = None
        # an incoming delivery spread over several frames
        self.partial: list[bytes] | None = None
        self.partial_size = 0
        #: the bytes of it kept (counted in the connection's ``partial_bytes``)
        self.partial_held = 0
        #: the unfinished delivery found no room in the shared budget: its bytes are not kept
        self.partial_unkept = False
        self.partial_head: tuple[int, bytes, bool] = (0, b"", False)
        self._transfer_head: dict[int, bytes] = {}

    def __repr__(self) -> str:
        return f"<Link {self.name!r} {'receiver' if self.role else 'sender'} handle={self.handle}>"

    @property
    def is_sender(self) -> bool:
        return self.role is SENDER

    @property
    def attached(self) -> bool:
        return self.attach_sent and self.attach_received and not (self.detach_sent or self.detach_received)

    @property
    def over(self) -> bool:
        """Detached (by us, or by the peer and answered), or gone with its session or connection:
        an attach the application has yet to answer needs no daemon work (see :meth:`refuse`)."""
        session = self.session
        return self.detach_sent or session.end_sent or session.connection.close_sent

    @property
    def sends_settled(self) -> bool:
        return self.snd_settle_mode == SND_SETTLED

    # ------------------------------------------------------------ attach
    def attach(self, source: Any = None, target: Any = None, *, snd_settle_mode: int = SND_MIXED,
               rcv_settle_mode: int = RCV_FIRST) -> None:
        """Send our attach: to start a link, or to answer the peer's (``LinkAttaching``)."""
        self.source = source
        self.target = target
        self.snd_settle_mode = snd_settle_mode
        self.rcv_settle_mode = rcv_settle_mode
        self.initial_delivery_count = self.delivery_count
        self.attach_sent = True
        self.session.send(Attach(
            self.name, self.handle, self.role, snd_settle_mode, rcv_settle_mode, source, target,
            initial_delivery_count=self.delivery_count if self.role is SENDER else None,
        ))
        if self.held_detach is not None:
            self._send_detach()

    def refuse(self, error: Error | None) -> None:
        """Answer the peer's attach with a null node, then detach with ``error`` (spec 2.6.3; a
        link detached already sends the detach it holds)."""
        remote = self.remote_attach
        if self.role is SENDER:  # the peer wants to receive from a source we do not have
            self.attach(None, remote.target)
        else:
            self.attach(remote.source, None)
        self.detach(error)

    def detach(self, error: Error | None = None, closed: bool = True) -> None:
        """Detach the link; before our attach answered the peer's, the detach waits for it."""
        if self.detach_sent:
            return
        self.detach_sent = True
        self.held_detach = Detach(self.handle, closed, error)
        if self.attach_sent:
            self._send_detach()

    def _send_detach(self) -> None:
        detach, self.held_detach = self.held_detach, None
        self.session.send_link_frame(self, detach)
        self.session.link_detached(self)

    # -------------------------------------------------------------- flow
    def flow(self, credit: int | None = None, *, drain: bool | None = None, echo: bool = False) -> None:
        """Receiver: set the credit (not add to it) and drain mode, and tell the sender."""
        if credit is not None:
            self.credit = credit
        if drain is not None:
            self.drain = drain
        self.send_flow(echo=echo)

    def send_flow(self, echo: bool = False) -> None:
        """Our link state (and the session's) in a flow frame; a sender reports ``available``."""
        self.drain_owed = False
        self.session.send_flow(self, echo)

    def apply_flow(self, delivery_count: int | None, credit: int | None, drain: bool,
                   available: int | None) -> None:
        """The peer's link state from a flow frame (spec 2.6.7).

        The sender's delivery-count is authoritative: a receiver's count ahead of
        ours, or a sender's count gone backwards, adds no credit. Credit is any
        uint, so it is added to the (small, signed) distance between the counts
        rather than taken as a serial number (2**31 and more would wrap).
        """
        if self.role is SENDER:
            if credit is None:
                return
            rcv_count = self.initial_delivery_count if delivery_count is None else delivery_count
            in_flight = min(serial.diff(rcv_count, self.delivery_count), 0)
            self.credit = max(credit + in_flight, 0)
            self.drain = drain
            self.drain_owed = drain
        else:
            if delivery_count is not None:
                used = max(serial.diff(delivery_count, self.delivery_count), 0)  # a drain used this much
                self.delivery_count = delivery_count
                self.credit = max(self.credit - used, 0)
            if available is not None:
                self.available = available

    def complete_drain(self) -> None:
        """Sender out of messages in drain mode: use up the credit and say so."""
        self.delivery_count = serial.add(self.delivery_count, self.credit)
        self.credit = 0
        self.send_flow()

    # ---------------------------------------------------------- transfers
    def send_transfers(self, tags: list[bytes], payloads: list[bytes], settled: bool) -> int:
        """Send one delivery per (tag, payload); returns the first delivery-id.

        The caller keeps within the link credit; frames beyond the session's
        outgoing window wait in the session until the peer widens it.
        """
        session = self.session
        first = did = session.next_delivery_id
        channel = session.channel
        tail = _SETTLED_TAIL[settled]
        limit = session.connection.peer_max_frame_size
        heads = self._transfer_head
        pack_head = FRAME_HEAD.pack
        pack_u32 = _U32.pack
        window = session.remote_incoming_window
        pending = session.pending
        connection = session.connection
        out = connection.output
        sent = held = 0
        for tag, payload in zip(tags, payloads):
            head = heads.get(len(tag))
            if head is None:
                head = heads[len(tag)] = self._encode_transfer_head(len(tag))
            size = len(head) + len(tag) + len(payload) + 16
            if size <= limit:
                parts = (pack_head(size, 2, 0, channel), head, pack_u32(did), b"\xa0", bytes((len(tag),)), tag,
                         tail, payload)
                if sent < window and not pending:
                    out.extend(parts)
                    sent += 1
                else:
                    frame = b"".join(parts)
                    pending.append(frame)
                    held += len(frame)
            else:
                for frame in self._split_transfer(did, tag, settled, payload, limit):
                    if sent < window and not pending:
                        out.append(frame)
                        sent += 1
                    else:
                        pending.append(frame)
                        held += len(frame)
            did = (did + 1) & serial.MASK
        session.next_delivery_id = did
        session.frames_sent(sent)
        connection.window_held += held
        n = len(tags)
        self.delivery_count = serial.add(self.delivery_count, n)
        self.credit -= n
        if not settled:
            session.track_outgoing(self, first, tags)
        return first

    def _encode_transfer_head(self, tag_len: int) -> bytes:
        """``transfer`` up to the delivery-id value: descriptor, list header, handle."""
        handle = codec.encode(codec.UInt(self.handle))
        size = 1 + len(handle) + 5 + 2 + tag_len + 2
        return b"\x00\x53\x14\xc0" + bytes((size, 5)) + handle + b"\x70"

    def _split_transfer(self, did: int, tag: bytes, settled: bool, payload: bytes, limit: int) -> list[bytes]:
        """A message bigger than the peer's max-frame-size, as several transfer frames."""
        channel = self.session.channel

        def frame(perf: bytes, chunk: bytes) -> bytes:
            return FRAME_HEAD.pack(8 + len(perf) + len(chunk), 2, 0, channel) + perf + chunk

        perf = Transfer(self.handle, did, tag, 0, settled, True).encode_amqp()
        room = limit - 8 - len(perf)
        frames = [frame(perf, payload[:room])]
        pos = room
        more = Transfer(self.handle, more=True).encode_amqp()
        last = Transfer(self.handle).encode_amqp()
        while len(payload) - pos > limit - 8 - len(last):
            room = limit - 8 - len(more)
            frames.append(frame(more, payload[pos:pos + room]))
            pos += room
        frames.append(frame(last, payload[pos:]))
        return frames

    # -------------------------------------------------------- settlement
    def settle(self, delivery_ids: list[int], state: Any) -> None:
        """Receiver: give incoming deliveries ``state``, one disposition per run of ids.

        Under rcv-settle-mode first they are settled with it; under second the
        disposition leaves them unsettled, for the sender to settle (spec 2.8.3).
        """
        if not delivery_ids:
            return
        send = self.session.send
        settled = self.rcv_settle_mode != RCV_SECOND
        first = prev = delivery_ids[0]
        for did in delivery_ids[1:]:
            if did != (prev + 1) & serial.MASK:
                send(Disposition(RECEIVER, first, prev, settled, state))
                first = did
            prev = did
        send(Disposition(RECEIVER, first, prev, settled, state))
