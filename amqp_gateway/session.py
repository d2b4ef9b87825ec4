"""A session endpoint (spec 2.5): windows, delivery ids, and the link frames.

Session flow control counts transfer frames. We keep our incoming window
open (``INCOMING_WINDOW`` frames, refreshed with a flow once half is used):
the gateway slows publishers per link with link credit, never per session,
so a slow topic cannot stall the other links of a session. Our outgoing
transfers respect the peer's incoming window; frames beyond it wait in
:attr:`Session.pending` until a flow widens the window. Their bytes, over
all sessions, are the connection's ``window_held``, which the gateway
counts against its fill rounds: a peer that keeps its windows shut holds
one round of messages, not one per session. The flows and the detach of a
link we send on queue up behind them: sent earlier, a detach would leave
them on an unattached handle and a flow would count transfers the peer has
not seen. Credit we grant the peer never waits.

Deliveries we send unsettled are remembered by delivery-id until the peer
settles them; a disposition for a range ``first..last`` is resolved against
that map in one pass and reported per link.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from . import serial
from .codec import UInt
from .errors import (
    DECODE_ERROR, FRAMING_ERROR, HANDLE_IN_USE, INVALID_FIELD, NOT_ALLOWED, RESOURCE_LIMIT_EXCEEDED,
    TRANSFER_LIMIT_EXCEEDED, UNATTACHED_HANDLE, WINDOW_VIOLATION, ConnectionFault, SessionFault,
)
from .events import (
    NO_ROOM, LinkAttached, LinkAttaching, LinkDetached, LinkFlow, NoRoom, SessionFlow, Settled, Transfers,
)
from .link import Link
from .performatives import (
    RECEIVER, SENDER, TERMINAL_OUTCOMES, Attach, Begin, Detach, Disposition, End, Error, Flow,
)

if TYPE_CHECKING:
    from .connection import Connection

#: transfer frames we let the peer send before it must wait for our next flow
INCOMING_WINDOW = 2048
OUTGOING_WINDOW = 0x7FFFFFFF
#: handles per session (0 .. HANDLE_MAX)
HANDLE_MAX = 255


class Session:
    def __init__(self, connection: Connection, channel: int) -> None:
        self.connection = connection
        self.channel = channel
        self.remote_channel: int | None = None
        self.begin_sent = self.begin_received = False
        self.end_sent = self.end_received = False
        # session flow control
        self.next_outgoing_id = 0
        self.incoming_window = INCOMING_WINDOW
        self.next_incoming_id = 0
        self.remote_incoming_window = 0
        self.remote_handle_max = HANDLE_MAX
        #: transfer frames beyond the peer's window; a 1-tuple holds a link's flow or detach that follows them
        self.pending: deque[bytes | tuple[Any]] = deque()
        # links; ours that wait for the peer's attach are also found by (name, role)
        self._awaiting: dict[tuple[str, bool], Link] = {}
        self.by_handle: dict[int, Link] = {}
        self.by_remote_handle: dict[int, Link] = {}
        # deliveries
        self.next_delivery_id = 0
        self.unsettled: dict[int, tuple[Link, bytes]] = {}

    def forget_links(self) -> None:
        """The connection is over: drop the links (each points back at this session)."""
        self._awaiting.clear()
        self.by_handle.clear()
        self.by_remote_handle.clear()
        self.unsettled.clear()

    def __repr__(self) -> str:
        return f"<Session channel={self.channel} remote={self.remote_channel}>"

    @property
    def outgoing_room(self) -> int:
        """Transfer frames we may still send before the peer's window closes."""
        return 0 if self.pending else self.remote_incoming_window

    # --------------------------------------------------------------- output
    def send(self, performative: Any, payload: bytes = b"") -> None:
        """A frame on this session; nothing follows our end (spec 2.5.5), such as the answer to an
        attach that arrived with the peer's end or a frame that ended the session."""
        if self.end_sent:
            return
        if payload:
            self.connection.send_frame(self.channel, performative.encode_amqp() + payload)
        else:
            self.connection.send_performative(self.channel, performative)

    def begin(self) -> None:
        self.begin_sent = True
        self.send(Begin(self.remote_channel, self.next_outgoing_id, self.incoming_window, OUTGOING_WINDOW,
                        HANDLE_MAX))

    def end(self, error: Error | None = None) -> None:
        if self.end_sent:
            return
        self._drop_pending()
        self.send(End(error))
        self.end_sent = True

    def send_link_frame(self, link: Link, performative: Any) -> None:
        """A link's flow or detach: after the transfers still waiting for the peer's window if the
        link is a sender (a receiving link's credit never waits for the other direction)."""
        if self.pending and link.role is SENDER:
            self.pending.append((performative,))
        else:
            self.send(performative)

    def send_flow(self, link: Link | None = None, echo: bool = False) -> None:
        flow = Flow(self.next_incoming_id, self.incoming_window, self.next_outgoing_id, OUTGOING_WINDOW,
                    echo=echo)
        if link is not None:
            flow.handle = link.handle
            flow.delivery_count = link.delivery_count
            flow.link_credit = link.credit
            flow.drain = link.drain
            if link.role is SENDER:
                flow.available = link.available
            self.send_link_frame(link, flow)
            return
        self.send(flow)

    def frames_sent(self, count: int) -> None:
        self.next_outgoing_id = serial.add(self.next_outgoing_id, count)
        self.remote_incoming_window -= count

    def track_outgoing(self, link: Link, first: int, tags: list[bytes]) -> None:
        if first + len(tags) <= serial.MASK:
            self.unsettled.update(zip(range(first, first + len(tags)), [(link, tag) for tag in tags]))
        else:
            for i, tag in enumerate(tags):
                self.unsettled[serial.add(first, i)] = (link, tag)

    def forget_unsettled(self, link: Link, keep) -> None:
        """Drop ``link``'s unsettled deliveries whose tag ``keep(tag)`` rejects (the
        application gave up on them, so the peer's late settlement can be ignored)."""
        self.unsettled = {did: entry for did, entry in self.unsettled.items()
                          if entry[0] is not link or keep(entry[1])}

    def _send_pending(self) -> None:
        pending = self.pending
        connection = self.connection
        out = connection.output
        sent = 0
        while pending:
            frame = pending[0]
            if type(frame) is tuple:  # a link frame: the window does not count it
                self.frames_sent(sent)
                sent = 0
                self.send(self._link_frame(frame[0]))
            elif sent < self.remote_incoming_window:
                out.append(frame)
                connection.window_held -= len(frame)
                sent += 1
            else:
                break
            pending.popleft()
        self.frames_sent(sent)

    def _drop_pending(self) -> None:
        self.connection.window_held -= sum(len(frame) for frame in self.pending if type(frame) is not tuple)
        self.pending.clear()

    def _link_frame(self, performative: Any) -> Any:
        """A queued link frame; a flow carries the session's state as it is now, not when it was queued."""
        if type(performative) is Flow:
            performative.next_incoming_id = self.next_incoming_id
            performative.incoming_window = self.incoming_window
            performative.next_outgoing_id = self.next_outgoing_id
        return performative

    def keep_window_open(self) -> None:
        """Refresh our incoming window once half of it is used."""
        if self.incoming_window < INCOMING_WINDOW // 2 and self.begin_sent and not self.end_sent:
            self.incoming_window = INCOMING_WINDOW
            self.send_flow()

    # ---------------------------------------------------------------- links
    def attach(self, name: str, role: bool) -> Link:
        """A new link we start: call ``link.attach(...)`` on the result."""
        if (name, role) in self._awaiting:
            raise ValueError(f"link {name!r} is already being attached")
        link = self._new_link(name, role)
        self._awaiting[(name, role)] = link
        return link

    def _new_link(self, name: str, role: bool) -> Link:
        link = Link(self, name, role, self._free_handle())
        self.by_handle[link.handle] = link
        return link

    def _free_handle(self) -> int:
        """The lowest handle not in use, nor named by a detach still queued behind transfers
        (an attach that reused it would reach the peer before that detach)."""
        queued = {item[0].handle for item in self.pending if type(item) is tuple and type(item[0]) is Detach}
        for handle in range(min(HANDLE_MAX, self.remote_handle_max) + 1):
            if handle not in self.by_handle and handle not in queued:
                return handle
        raise SessionFault(NOT_ALLOWED, "no free link handle")

    def link_detached(self, link: Link) -> None:
        """Forget a link's deliveries once we detached it (its handle stays until the peer answers)."""
        if self.unsettled:
            for did in [d for d, (owner, _) in self.unsettled.items() if owner is link]:
                del self.unsettled[did]
        self._drop_partial(link)
        if link.detach_received:
            self._release(link)

    def _drop_partial(self, link: Link) -> None:
        """The link's unfinished delivery is done with (complete, aborted, or the link gone)."""
        self._forgo_partial(link)
        link.partial = None
        link.partial_unkept = False
        self.connection.unfinished.pop(link, None)

    def _forgo_partial(self, link: Link) -> None:
        """Give back the bytes kept of the link's unfinished delivery."""
        if link.partial_held:
            self.connection.drop_partial(link.partial_held)
            link.partial_held = 0

    def _release(self, link: Link) -> None:
        if self._awaiting.get((link.name, link.role)) is link:
            del self._awaiting[(link.name, link.role)]
        self.by_handle.pop(link.handle, None)
        if link.remote_handle is not None and self.by_remote_handle.get(link.remote_handle) is link:
            del self.by_remote_handle[link.remote_handle]

    # ---------------------------------------------------------------- input
    def on_begin(self, begin: Begin) -> None:
        self.begin_received = True
        self.next_incoming_id = begin.next_outgoing_id
        self.remote_incoming_window = begin.incoming_window
        self.remote_handle_max = begin.handle_max

    def on_attach(self, attach: Attach, events: list) -> None:
        handle = attach.handle
        if handle > HANDLE_MAX:
            # spec 2.7.2: a handle beyond the handle-max we announced closes the connection with framing-error
            raise ConnectionFault(FRAMING_ERROR, f"handle {handle} exceeds handle-max {HANDLE_MAX}")
        if handle in self.by_remote_handle:
            raise SessionFault(HANDLE_IN_USE, f"handle {handle} is already attached")
        role = not attach.role
        if attach.role is SENDER and attach.initial_delivery_count is None:
            raise SessionFault(INVALID_FIELD, "a sender's attach must carry initial-delivery-count")
        # a peer's attach with the name of a live link is tolerated (clients name links after
        # their address): links are told apart by handle
        link = self._awaiting.pop((attach.name, role), None)
        answer = link is not None
        if link is None:
            link = self._new_link(attach.name, role)
        link.remote_attach = attach
        link.remote_handle = handle
        link.attach_received = True
        self.by_remote_handle[handle] = link
        if role is RECEIVER:
            link.delivery_count = attach.initial_delivery_count
        events.append(LinkAttached(link) if answer else LinkAttaching(link))

    def on_detach(self, detach: Detach, events: list) -> None:
        link = self.by_remote_handle.get(detach.handle)
        if link is None:
            raise SessionFault(UNATTACHED_HANDLE, f"detach of unattached handle {detach.handle}")
        link.detach_received = True
        if link.detach_sent:
            if link.held_detach is None:  # else released once our attach and detach went out
                self._release(link)
            return
        link.detach(closed=detach.closed)
        events.append(LinkDetached(link, detach.error, True))

    def on_flow(self, flow: Flow, events: list) -> None:
        next_incoming = 0 if flow.next_incoming_id is None else flow.next_incoming_id
        # spec 2.5.6: remote-incoming-window := next-incoming-id(flow) + incoming-window(flow) - next-outgoing-id
        self.remote_incoming_window = serial.diff(serial.add(next_incoming, flow.incoming_window),
                                                  self.next_outgoing_id)
        if self.pending:
            self._send_pending()
        if flow.handle is None:
            if flow.echo:
                self.send_flow()
            events.append(SessionFlow(self))
            return
        link = self.by_remote_handle.get(flow.handle)
        if link is None:
            raise SessionFault(UNATTACHED_HANDLE, f"flow for unattached handle {flow.handle}")
        if link.detach_sent:
            return
        link.apply_flow(flow.delivery_count, flow.link_credit, flow.drain, flow.available)
        events.append(LinkFlow(link, flow.drain, flow.echo))

    def on_transfer(self, fields: list, payload: bytes, events: list) -> None:
        """One transfer frame, given as its raw field list (the hot path skips the dataclass)."""
        if self.incoming_window <= 0:
            raise SessionFault(WINDOW_VIOLATION, "transfer beyond the incoming window")
        self.incoming_window -= 1
        self.next_incoming_id = (self.next_incoming_id + 1) & serial.MASK
        n = len(fields)
        handle = fields[0] if n else None
        if type(handle) is not UInt:
            raise SessionFault(DECODE_ERROR, "transfer without a uint handle")
        link = self.by_remote_handle.get(handle)
        if link is None:
            raise SessionFault(UNATTACHED_HANDLE, f"transfer on unattached handle {handle}")
        if link.detach_sent:
            return
        if link.role is not RECEIVER:
            raise SessionFault(NOT_ALLOWED, "transfer on a link where we are the sender")
        more = n > 5 and fields[5] is True
        aborted = n > 9 and fields[9] is True
        partial = link.partial
        if partial is None:
            did = fields[1] if n > 1 else None
            tag = fields[2] if n > 2 else None
            if type(did) is not UInt or type(tag) is not bytes:
                raise SessionFault(INVALID_FIELD, "first transfer of a delivery without delivery-id or tag")
            if link.credit <= 0:
                self.fail_link(link, Error(TRANSFER_LIMIT_EXCEEDED, "transfer without link credit"), events)
                return
            link.credit -= 1
            link.delivery_count = (link.delivery_count + 1) & serial.MASK
            settled = n > 4 and fields[4] is True
            if not more:
                if aborted:
                    return
                limit = link.max_message_size
                if limit and len(payload) > limit:
                    payload = None
                last = events[-1] if events else None
                if type(last) is Transfers and last.link is link:
                    last.deliveries.append((did, tag, settled, payload))
                else:
                    events.append(Transfers(link, [(did, tag, settled, payload)]))
                return
            link.partial = partial = []
            link.partial_size = 0
            link.partial_head = (did, tag, settled)
            self.connection.unfinished[link] = self.connection.now
        else:
            did = fields[1] if n > 1 else None
            if did is not None and did != link.partial_head[0]:
                # spec 2.7.5: a continuation's delivery-id, when set, is the first transfer's
                raise ConnectionFault(INVALID_FIELD, f"continuation transfer with delivery-id {did}, "
                                                     f"not {link.partial_head[0]}")
            if n > 4 and fields[4] is True:
                did, tag, _ = link.partial_head
                link.partial_head = (did, tag, True)
        if aborted:
            self._drop_partial(link)
            return
        link.partial_size += len(payload)
        limit = link.max_message_size
        if (not limit or link.partial_size <= limit) and not link.partial_unkept:
            connection = self.connection
            if connection.hold_partial(len(payload)):
                partial.append(payload)
                link.partial_held += len(payload)
                if connection.max_partial_bytes and connection.partial_bytes > connection.max_partial_bytes:
                    raise ConnectionFault(RESOURCE_LIMIT_EXCEEDED, (
                        f"unfinished multi-frame deliveries hold more than {connection.max_partial_bytes} bytes "
                        f"over this connection's links"))
            else:  # the daemon's memory for them is taken: refused once complete, nothing kept meanwhile
                self._forgo_partial(link)
                partial.clear()
                link.partial_unkept = True
        if more:
            return
        unkept = link.partial_unkept
        self._drop_partial(link)
        did, tag, settled = link.partial_head
        if unkept:
            body: bytes | NoRoom | None = NO_ROOM
        else:
            body = None if limit and link.partial_size > limit else b"".join(partial)
        events.append(Transfers(link, [(did, tag, settled, body)]))

    def on_disposition(self, disposition: Disposition, events: list) -> None:
        if disposition.role is not RECEIVER:
            return  # the peer settles deliveries it sent us: we settle those ourselves at once
        first = disposition.first
        last = first if disposition.last is None else disposition.last
        state = disposition.state
        settled = disposition.settled
        final = settled or isinstance(state, TERMINAL_OUTCOMES)
        if not final:
            return
        unsettled = self.unsettled
        count = serial.diff(last, first) + 1
        if count <= 0:
            return
        if count <= len(unsettled):
            ids = [(first + i) & serial.MASK for i in range(count)]
        else:
            ids = [d for d in unsettled if serial.diff(d, first) >= 0 and serial.diff(last, d) >= 0]
        self.connection.ids_examined += min(count, len(unsettled))
        by_link: dict[Link, list[bytes]] = {}
        pop = unsettled.pop
        for did in ids:
            entry = pop(did, None)
            if entry is not None:
                tags = by_link.get(entry[0])
                if tags is None:
                    by_link[entry[0]] = [entry[1]]
                else:
                    tags.append(entry[1])
        if not settled:
            self.send(Disposition(SENDER, first, last, True, state))
        for link, tags in by_link.items():
            events.append(Settled(link, tags, state, settled))

    def on_end(self) -> None:
        """The peer ended the session: every link is gone with it."""
        for link in self.by_remote_handle.values():
            self._drop_partial(link)
        self.end_received = True
        self._awaiting.clear()
        self.by_handle.clear()
        self.by_remote_handle.clear()
        self.unsettled.clear()
        self._drop_pending()

    def fail_link(self, link: Link, error: Error, events: list) -> None:
        """The peer broke a link rule: detach that link only."""
        link.detach(error)
        events.append(LinkDetached(link, error, False))
