"""The AMQP 1.0 connection engine, sans-I/O: bytes in, events out; calls out, bytes out.

:meth:`Connection.receive_data` parses what arrived (protocol headers, SASL,
frames), updates connection, session and link state, answers what the spec
leaves no choice about (headers, SASL, open, begin, end, close, detach
replies) and returns :mod:`events` for the rest. Whatever the application
and the engine send is appended to :attr:`Connection.output`; the I/O layer
writes it and reads :attr:`Connection.finished` to know when to hang up.

A peer that breaks the protocol gets ``close`` (or ``end`` for a session
rule, ``detach`` for a link rule) with an error condition; nothing it sends
makes ``receive_data`` raise.

The same engine serves both ends: the gateway runs it as the server, tests
and the load generator as a client.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

from . import codec
from .codec import DecodeError
from .errors import (
    CONNECTION_FORCED, DECODE_ERROR, FRAME_SIZE_TOO_SMALL, FRAMING_ERROR, ILLEGAL_STATE, INVALID_FIELD, NOT_ALLOWED,
    RESOURCE_LIMIT_EXCEEDED, UNAUTHORIZED_ACCESS, ConnectionFault, SessionFault,
)
from .events import ConnectionClosed, ConnectionOpened, SaslLogin, SessionBegun, SessionEnded
from .framing import (
    AMQP_HEADER, EMPTY_FRAME, FRAME_HEAD, MIN_MAX_FRAME_SIZE, PROTOCOL_AMQP, PROTOCOL_SASL, SASL_HEADER,
    SASL_MAX_FRAME_SIZE, TYPE_AMQP,
    TYPE_SASL, FrameReader, Header, encode_frame,
)
from .performatives import (
    SASL_OK, SASL_SYS_PERM, SASL_SYS_TEMP, Attach, Begin, Close, Detach, Disposition, End, Error, Flow, Open, SaslInit, SaslMechanisms,
    SaslOutcome, fit,
)
from .sasl import SaslClient, SaslServer
from .session import Session

DEFAULT_MAX_FRAME_SIZE = 128 * 1024
DEFAULT_CHANNEL_MAX = 255
#: payload bytes of unfinished multi-frame deliveries one connection may hold over all its links:
#: each link holds at most one, but a connection may have 256 sessions of 256 links
MAX_PARTIAL_BYTES = 8 * 1024 * 1024
#: delivery ids a disposition goes through that cost about as much as a frame
IDS_PER_FRAME = 64
#: shortest idle-time-out we keep to (spec 2.4.5 lets a peer refuse one it cannot support): each
#: connection costs an empty frame every half of it, and at 100 ms 500 connections took half a CPU;
#: Qpid Proton announces half its heartbeat, so 500 ms takes a client's 1 s heartbeat
MIN_PEER_IDLE_TIMEOUT_MS = 500

_OPEN, _BEGIN, _ATTACH, _FLOW, _TRANSFER, _DISPOSITION, _DETACH, _END, _CLOSE = range(0x10, 0x19)
_PERFORMATIVES = {_OPEN: Open, _BEGIN: Begin, _ATTACH: Attach, _FLOW: Flow, _DISPOSITION: Disposition,
                  _DETACH: Detach, _END: End, _CLOSE: Close}
_BY_NAME = {codec.Symbol(cls.NAME): code for code, cls in _PERFORMATIVES.items()}
_BY_NAME[codec.Symbol("amqp:transfer:list")] = _TRANSFER

_U32 = struct.Struct(">I")
_UINT0 = codec.UInt(0)
_SIMPLE = {0x40: None, 0x41: True, 0x42: False, 0x43: _UINT0}


def _transfer_fields(body: bytes) -> tuple[list, int] | None:
    """The fields of a transfer in the usual compact encoding (up to ``more``), read inline.

    This is the per-message path of publishing; anything unusual (more fields,
    other encodings) returns None and goes through the generic decoder.
    """
    if len(body) < 6 or body[3] != 0xC0 or body[5] > 6:
        return None
    end = 5 + body[4]
    if end > len(body):
        return None
    fields = []
    pos = 6
    try:
        for _ in range(body[5]):
            c = body[pos]
            if c in _SIMPLE:
                fields.append(_SIMPLE[c])
                pos += 1
            elif c == 0x52:
                fields.append(codec.UInt(body[pos + 1]))
                pos += 2
            elif c == 0x70:
                fields.append(codec.UInt(_U32.unpack_from(body, pos + 1)[0]))
                pos += 5
            elif c == 0xA0:
                n = body[pos + 1]
                fields.append(body[pos + 2:pos + 2 + n])
                pos += 2 + n
            else:
                return None
    except (IndexError, struct.error):
        return None
    return (fields, end) if pos == end else None


# where the byte stream is
_AWAIT_HEADER = 0
_SASL = 1
_AMQP = 2


class PartialBudget(Protocol):
    """Bytes shared by every connection (the daemon's body budget); never waits."""

    capacity: int

    def try_take(self, size: int) -> bool: ...

    def give_back(self, size: int) -> None: ...


class Connection:
    def __init__(self, *, client: bool, container_id: str, sasl: SaslServer | SaslClient | None = None,
                 sasl_required: bool = False, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                 channel_max: int = DEFAULT_CHANNEL_MAX, idle_timeout: float | None = None,
                 hostname: str | None = None, properties: dict | None = None,
                 refuse: Error | None = None, step_frames: int = 0,
                 max_partial_bytes: int = MAX_PARTIAL_BYTES, partial_budget: PartialBudget | None = None,
                 free_partial_bytes: int = 0) -> None:
        self.client = client
        self.container_id = container_id
        self.sasl = sasl
        self.sasl_required = sasl_required
        self.max_frame_size = max_frame_size
        self.channel_max = channel_max
        #: the idle-time-out we announce in open (the I/O layer closes after twice as long without a frame)
        self.idle_timeout = idle_timeout
        self.hostname = hostname
        self.properties = properties
        #: server: answer the AMQP header with open and, at once, close with this error (spec 2.4.1)
        self.refuse = refuse
        #: most frames one :meth:`receive_data` handles (0: every complete one)
        self.step_frames = step_frames
        #: delivery ids that dispositions went through since the last frame was counted: every
        #: IDS_PER_FRAME count as one more frame against ``step_frames`` (128 dispositions over
        #: ranges of 2,500 held the event loop for 60-130 ms a step)
        self.ids_examined = 0
        #: payload bytes of incoming deliveries spread over several frames, over all links, and
        #: the most we hold (past it: close with resource-limit-exceeded; 0: no limit)
        self.partial_bytes = 0
        self.max_partial_bytes = max_partial_bytes
        #: memory shared with other connections: what this one holds past ``free_partial_bytes`` is
        #: taken from it, and a delivery that finds no room there is not kept (see :meth:`hold_partial`)
        self.partial_budget = partial_budget
        self.free_partial_bytes = free_partial_bytes
        #: bytes taken from ``partial_budget``
        self.partial_reserved = 0
        #: links with an unfinished delivery, the one that has waited longest for its end first,
        #: each with the :attr:`now` of that delivery's first frame
        self.unfinished: dict = {}
        #: the I/O layer's clock (seconds) for the bytes being received: when deliveries start
        self.now = 0.0
        #: complete frames are left: call ``receive_data(b"")`` to go on
        self.more = False
        #: AMQP frames received other than empty ones (heartbeats), which change nothing
        self.frames_received = 0
        self._frames = None
        self.output: list[bytes] = []
        #: bytes of transfer frames waiting in the sessions for the peer's windows (Session.pending)
        self.window_held = 0
        #: set by the I/O layer while a send to the peer waits (its consumers' Consumer.write_blocked)
        self.write_blocked = False
        #: frames up to 512 bytes until our open announces more (spec 2.4.1), SASL frames included
        self.reader = FrameReader(MIN_MAX_FRAME_SIZE)
        self.remote_open: Open | None = None
        self.peer_max_frame_size = MIN_MAX_FRAME_SIZE
        self.peer_channel_max = 0
        #: seconds within which the peer wants to hear from us (None: it does not care)
        self.peer_idle_timeout: float | None = None
        self.open_sent = self.open_received = False
        self.close_sent = self.close_received = False
        #: nothing more will be read: the I/O layer may close once :attr:`output` is written
        self.finished = False
        self.sessions: dict[int, Session] = {}
        self._remote_sessions: dict[int, Session] = {}
        #: the peer's channels whose session it ended: their late frames are ignored (at most channel-max)
        self._ended_channels: set[int] = set()
        self._stage = _AWAIT_HEADER
        self._sasl_done = False
        #: server: a sasl-outcome went out (a fault during SASL otherwise gets one, sys-perm)
        self._outcome_sent = False
        self._want_open = False
        if client:
            self.output.append(SASL_HEADER if sasl is not None else AMQP_HEADER)

    # ------------------------------------------------------------ partials
    def hold_partial(self, size: int) -> bool:
        """Count ``size`` more bytes kept for unfinished deliveries; False, with nothing counted,
        when the shared budget has no room for them.

        Never waits: reading on (the other links' frames share the socket) is what lets the
        deliveries already held finish and give their bytes back.
        """
        total = self.partial_bytes + size
        need = total - self.free_partial_bytes - self.partial_reserved
        budget = self.partial_budget
        if need > 0 and budget is not None:
            if budget.capacity and need > budget.capacity or not budget.try_take(need):
                return False
            self.partial_reserved += need
        self.partial_bytes = total
        return True

    def drop_partial(self, size: int) -> None:
        """``size`` bytes of unfinished deliveries are no longer kept; the shared budget gets back what they took."""
        self.partial_bytes -= size
        excess = self.partial_reserved - max(self.partial_bytes - self.free_partial_bytes, 0)
        if excess > 0:
            self.partial_reserved -= excess
            self.partial_budget.give_back(excess)

    @property
    def oldest_unfinished(self) -> float | None:
        """When the unfinished delivery that has waited longest for its end started (None: none has)."""
        return next(iter(self.unfinished.values()), None)

    def release_partials(self) -> None:
        """The connection is over: everything it took from the shared budget goes back."""
        if self.partial_reserved:
            self.partial_budget.give_back(self.partial_reserved)
            self.partial_reserved = 0

    # ------------------------------------------------------------------ I/O
    def data_to_send(self) -> bytes:
        data = b"".join(self.output)
        self.output.clear()
        return data

    def heartbeat(self) -> None:
        """An empty frame: keeps the peer's idle timer from expiring."""
        self.output.append(EMPTY_FRAME)

    def send_performative(self, channel: int, performative: Any) -> None:
        """A frame of one performative, made to fit the peer's max-frame-size (see
        :func:`performatives.fit`); one that cannot be closes the connection."""
        body = performative.encode_amqp()
        if len(body) + 8 > self.peer_max_frame_size:
            performative = fit(performative, self.peer_max_frame_size - 8)
            if performative is None:
                self.close(Error(FRAME_SIZE_TOO_SMALL, f"a frame for max-frame-size {self.peer_max_frame_size}"))
                return
            body = performative.encode_amqp()
        self.send_frame(channel, body)

    def send_frame(self, channel: int, body: bytes) -> None:
        """A frame; nothing follows our close (spec 2.4.3), such as the answer to an attach that
        arrived with the peer's close or with a frame that closed the connection."""
        if not self.close_sent:
            self.output.append(FRAME_HEAD.pack(len(body) + 8, 2, TYPE_AMQP, channel) + body)

    def receive_data(self, data: bytes) -> list:
        """Handle what arrived; returns the events. With :attr:`step_frames` set, at most that
        many frames are handled and :attr:`more` says whether to call again (with ``b""``)."""
        events: list = []
        if self.finished:
            return events
        frames = self._frames
        if frames is None or data:
            if frames is not None:
                raise RuntimeError("receive_data() with new data while frames are left (see more)")
            frames = self.reader.feed(data)
        step = self.step_frames
        budget = step
        self._frames = None
        try:
            for item in frames:
                if type(item) is Header:
                    self._on_header(item, events)
                elif self._stage == _AMQP and item[0] == TYPE_AMQP:
                    self._on_frame(item[1], item[2], events)
                elif self._stage == _SASL and item[0] == TYPE_SASL:
                    self._on_sasl(item[2], events)
                else:
                    raise ConnectionFault(FRAMING_ERROR, f"unexpected frame of type {item[0]}")
                if self.finished:
                    break
                budget -= 1 + self.ids_examined // IDS_PER_FRAME
                self.ids_examined = 0
                if step and budget <= 0:
                    self._frames = frames
                    break
        except ConnectionFault as fault:
            self._fail(fault.error, events)
        except DecodeError as exc:
            self._fail(Error(DECODE_ERROR, str(exc)), events)
        if self.finished:
            self._frames = None
        else:
            for session in self._remote_sessions.values():
                session.keep_window_open()
        self.more = self._frames is not None
        return events

    def _fail(self, error: Error, events: list) -> None:
        self.close(error)
        self.finished = True
        events.append(ConnectionClosed(error, False))

    # -------------------------------------------------------------- headers
    def _on_header(self, header: Header, events: list) -> None:
        protocol = header.protocol if header.valid else -1
        if self.client:
            self._client_header(protocol)
            return
        if protocol == PROTOCOL_SASL and self.sasl is not None and not self._sasl_done:
            self.output.append(SASL_HEADER)
            self.send_sasl(self.sasl.offer())
            self._stage = _SASL
            self.reader.max_frame_size = SASL_MAX_FRAME_SIZE
        elif protocol == PROTOCOL_AMQP and (self._sasl_done or not self.sasl_required):
            self.output.append(AMQP_HEADER)
            self._stage = _AMQP
            if self.refuse is not None:
                self._fail(self.refuse, events)
        else:
            # spec 2.2: answer with the header we do support, then hang up
            self.output.append(SASL_HEADER if self.sasl is not None and not self._sasl_done else AMQP_HEADER)
            self._fail(Error(FRAMING_ERROR, f"unsupported protocol header {header.raw!r}"), events)

    def _client_header(self, protocol: int) -> None:
        expected = PROTOCOL_SASL if self.sasl is not None and not self._sasl_done else PROTOCOL_AMQP
        if protocol != expected:
            raise ConnectionFault(FRAMING_ERROR, f"server answered with protocol {protocol}")
        self._stage = _SASL if protocol == PROTOCOL_SASL else _AMQP
        if self._stage == _SASL:
            self.reader.max_frame_size = SASL_MAX_FRAME_SIZE
        if self._stage == _AMQP and self._want_open:
            self._send_open()

    # ----------------------------------------------------------------- SASL
    def send_sasl(self, frame: Any) -> None:
        self.output.append(encode_frame(0, frame.encode_amqp(), TYPE_SASL))

    def _on_sasl(self, body: bytes, events: list) -> None:
        frame, _ = codec.decode(body)
        sasl = self.sasl
        if isinstance(sasl, SaslServer) and isinstance(frame, SaslInit):
            outcome = sasl.init(frame)
            if outcome is None:  # the application checks the credentials, maybe with I/O
                self.reader.paused = True
                events.append(SaslLogin(*sasl.pending))
            else:
                self._sasl_outcome(outcome, events)
            return
        elif isinstance(sasl, SaslClient) and isinstance(frame, SaslMechanisms):
            init = sasl.init(frame, self.hostname)
            if init is None:
                self._fail(Error(UNAUTHORIZED_ACCESS, f"server does not offer {sasl.mechanism}"), events)
                return
            self.send_sasl(init)
            return
        elif isinstance(sasl, SaslClient) and isinstance(frame, SaslOutcome):
            if frame.code != SASL_OK:
                self._fail(Error(UNAUTHORIZED_ACCESS, f"SASL outcome {frame.code}"), events)
                return
            self.output.append(AMQP_HEADER)
            self._sasl_finished()
        else:
            raise ConnectionFault(FRAMING_ERROR, f"unexpected SASL frame {type(frame).__name__}")

    def sasl_verdict(self, ok: bool) -> list:
        """Server: answer the login of a ``SaslLogin`` event, then read on; returns the events."""
        events: list = []
        self.reader.paused = False
        self._sasl_outcome(self.sasl.verdict(ok), events)
        return events + self.receive_data(b"")

    def _sasl_outcome(self, outcome: SaslOutcome, events: list) -> None:
        self.send_sasl(outcome)
        self._outcome_sent = True
        if outcome.code == SASL_OK:
            self._sasl_finished()
        else:
            self._fail(Error(UNAUTHORIZED_ACCESS, "SASL authentication failed"), events)

    def _sasl_finished(self) -> None:
        self._sasl_done = True
        self._stage = _AWAIT_HEADER
        self.reader.expect_header = True
        self.reader.max_frame_size = MIN_MAX_FRAME_SIZE

    # ----------------------------------------------------------- open/close
    def open(self) -> None:
        """Client: open the connection (sent as soon as the headers allow)."""
        self._want_open = True
        if self._stage == _AMQP and not self.open_sent:
            self._send_open()

    def _send_open(self) -> None:
        self.open_sent = True
        self.reader.max_frame_size = self.max_frame_size
        idle = int(self.idle_timeout * 1000) if self.idle_timeout else None
        self.send_frame(0, Open(self.container_id, self.hostname, self.max_frame_size, self.channel_max, idle,
                                properties=self.properties).encode_amqp())

    def close(self, error: Error | None = None) -> None:
        """Close the connection, with an open first if we sent none (spec 2.4.1).

        Before the AMQP header exchange (a refused header, SASL) there is no
        connection to close: the I/O layer hangs up (spec 2.2, 5.3.2), after a
        server's ``sasl-outcome`` if the SASL exchange ends before its outcome:
        ``sys-temp`` when the daemon stops, ``sys-perm`` for a fault (the
        client learns why, not only that).
        """
        if self.close_sent:
            return
        if self._stage != _AMQP:
            if self._stage == _SASL and not self.client and not self._outcome_sent:
                forced = error is not None and error.condition == CONNECTION_FORCED
                self.send_sasl(SaslOutcome(SASL_SYS_TEMP if forced else SASL_SYS_PERM))
                self._outcome_sent = True
            self.finished = True
            return
        if not self.open_sent:
            self._send_open()
        self.send_performative(0, Close(error))
        self.close_sent = True
        if self.close_received:
            self.finished = True

    # --------------------------------------------------------------- frames
    def _on_frame(self, channel: int, body: bytes, events: list) -> None:
        if not body:
            return  # a heartbeat
        self.frames_received += 1
        if channel > self.channel_max and self.open_sent:
            # spec 2.7.1: a channel number beyond our channel-max closes the connection with framing-error
            raise ConnectionFault(FRAMING_ERROR, f"channel {channel} exceeds channel-max {self.channel_max}")
        if len(body) < 4 or body[0] != 0:
            raise ConnectionFault(DECODE_ERROR, "frame body is not a described performative")
        if body[1] == 0x53:
            code = body[2]
            fast = _transfer_fields(body) if code == _TRANSFER else None
            fields, end = fast if fast is not None else codec.decode(body, 3)
        else:
            descriptor, pos = codec.decode(body, 1)
            if type(descriptor) is codec.ULong:
                code = descriptor
            else:
                code = _BY_NAME.get(descriptor, -1) if isinstance(descriptor, str) else -1
            fields, end = codec.decode(body, pos)
        if not isinstance(fields, list):
            raise ConnectionFault(DECODE_ERROR, "performative is not a list")
        if self.close_sent:
            if code == _CLOSE:
                self._on_close(Close.from_value(fields), events)
            return
        if code == _TRANSFER:
            session = self._session(channel)
            if session is not None:
                try:
                    session.on_transfer(fields, body[end:], events)
                except SessionFault as fault:
                    self._end_session(session, fault.error, events)
            return
        cls = _PERFORMATIVES.get(code)
        if cls is None:
            raise ConnectionFault(DECODE_ERROR, f"unknown performative {code!r}")
        if end != len(body):
            raise ConnectionFault(DECODE_ERROR, f"{cls.__name__} frame carries a payload")
        performative = cls.from_value(fields)
        if code == _OPEN:
            self._on_open(performative, events)
            return
        if not self.open_received:
            raise ConnectionFault(ILLEGAL_STATE, f"{cls.__name__} before open")
        if code == _CLOSE:
            self._on_close(performative, events)
        elif code == _BEGIN:
            self._on_begin(channel, performative, events)
        elif code == _END:
            self._on_end(channel, performative, events)
        else:
            session = self._session(channel)
            if session is None:
                return
            try:
                if code == _FLOW:
                    session.on_flow(performative, events)
                elif code == _DISPOSITION:
                    session.on_disposition(performative, events)
                elif code == _ATTACH:
                    session.on_attach(performative, events)
                else:
                    session.on_detach(performative, events)
            except SessionFault as fault:
                self._end_session(session, fault.error, events)

    def _session(self, channel: int) -> Session | None:
        """The session on the peer's ``channel``; None if either side ended it and its frames are ignored.

        A frame on a channel whose session the peer ended is ignored too: rhea sends its
        credit window's flow after its own end, and that must not close every other session.
        """
        session = self._remote_sessions.get(channel)
        if session is None:
            if channel in self._ended_channels:
                return None
            raise ConnectionFault(ILLEGAL_STATE, f"frame on channel {channel} without a session")
        return None if session.end_sent else session

    def forget_sessions(self) -> None:
        """The connection is over: drop its sessions and their links, which point back at them and
        at this connection (cycles a full collection would otherwise have to find)."""
        for session in self.sessions.values():
            session.forget_links()
        self.sessions.clear()
        self._remote_sessions.clear()
        self.unfinished.clear()

    def _on_open(self, open_: Open, events: list) -> None:
        if self.open_received:
            raise ConnectionFault(ILLEGAL_STATE, "second open")
        self.open_received = True
        self.remote_open = open_
        if open_.idle_time_out is not None and 0 < open_.idle_time_out < MIN_PEER_IDLE_TIMEOUT_MS:
            raise ConnectionFault(RESOURCE_LIMIT_EXCEEDED, f"idle-time-out {open_.idle_time_out} ms is below "
                                                           f"the {MIN_PEER_IDLE_TIMEOUT_MS} ms we support")
        if open_.max_frame_size < MIN_MAX_FRAME_SIZE:  # as Qpid Proton and RabbitMQ answer it
            raise ConnectionFault(FRAMING_ERROR, f"max-frame-size {open_.max_frame_size} is below the "
                                                 f"{MIN_MAX_FRAME_SIZE} every peer must take (spec 2.7.1)")
        self.peer_max_frame_size = open_.max_frame_size
        self.peer_channel_max = open_.channel_max
        self.peer_idle_timeout = open_.idle_time_out / 1000 if open_.idle_time_out else None
        if not self.open_sent:
            self._send_open()
        events.append(ConnectionOpened(open_))

    def _on_close(self, close: Close, events: list) -> None:
        self.close_received = True
        first = not self.close_sent
        self.close()
        self.finished = True
        if first:
            events.append(ConnectionClosed(close.error, True))

    def _on_begin(self, channel: int, begin: Begin, events: list) -> None:
        if channel in self._remote_sessions:
            raise ConnectionFault(NOT_ALLOWED, f"channel {channel} already has a session")
        self._ended_channels.discard(channel)
        if begin.remote_channel is None:
            session = self._new_session()
            session.remote_channel = channel
            session.on_begin(begin)
            session.begin()
        else:
            session = self.sessions.get(begin.remote_channel)
            if session is None or session.begin_received:
                # spec 2.7.2: remote-channel is set only in the answer to a begin we sent
                raise ConnectionFault(INVALID_FIELD, f"begin answers unknown channel {begin.remote_channel}")
            session.remote_channel = channel
            session.on_begin(begin)
        self._remote_sessions[channel] = session
        events.append(SessionBegun(session))

    def _on_end(self, channel: int, end: End, events: list) -> None:
        session = self._remote_sessions.pop(channel, None)
        if session is None:
            raise ConnectionFault(ILLEGAL_STATE, f"end on channel {channel} without a session")
        self._ended_channels.add(channel)
        first = not session.end_sent
        session.on_end()
        session.end()
        self.sessions.pop(session.channel, None)
        if first:
            events.append(SessionEnded(session, end.error, True))

    def _end_session(self, session: Session, error: Error, events: list) -> None:
        session.end(error)
        events.append(SessionEnded(session, error, False))

    # ------------------------------------------------------------- sessions
    def begin(self) -> Session:
        """Start a session (client side); it is usable once ``SessionBegun`` arrives."""
        session = self._new_session()
        session.begin()
        return session

    def _new_session(self) -> Session:
        for channel in range(min(self.channel_max, self.peer_channel_max) + 1):
            if channel not in self.sessions:
                session = self.sessions[channel] = Session(self, channel)
                return session
        raise ConnectionFault(NOT_ALLOWED, "no free channel for a session")
