"""The sans-I/O AMQP engine: a client and a server engine talking in memory."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amqp_gateway import codec, errors, events as ev, performatives as p, serial
from amqp_gateway.connection import Connection
from amqp_gateway.framing import AMQP_HEADER, SASL_HEADER, FrameReader, encode_frame
from amqp_gateway.publisher import TopicLinks
from amqp_gateway.sasl import SaslClient, SaslServer
from amqp_gateway.session import INCOMING_WINDOW


class Pair:
    """A client and a server engine and the events each has seen."""

    def __init__(self, *, client_sasl=None, server_sasl=None, **server_options) -> None:
        self.server = Connection(client=False, container_id="server", sasl=server_sasl, **server_options)
        self.client = Connection(client=True, container_id="client", sasl=client_sasl)
        self.server_events: list = []
        self.client_events: list = []

    def exchange(self) -> None:
        for _ in range(50):
            to_server = self.client.data_to_send()
            if to_server:
                self.server_events += self.server.receive_data(to_server)
            to_client = self.server.data_to_send()
            if to_client:
                self.client_events += self.client.receive_data(to_client)
            if not to_server and not to_client:
                return
        raise AssertionError("the engines never went quiet")

    def take(self, side: str, kind=None) -> list:
        seen = self.server_events if side == "server" else self.client_events
        out = [e for e in seen if kind is None or isinstance(e, kind)]
        seen[:] = [e for e in seen if not (kind is None or isinstance(e, kind))]
        return out

    def open_session(self):
        self.client.open()
        self.exchange()
        session = self.client.begin()
        self.exchange()
        assert session.begin_received
        return session

    def link(self, role: bool = p.SENDER, *, name: str = "l", snd_settle_mode=p.SND_UNSETTLED,
             initial_delivery_count: int = 0):
        """A link from the client, answered by the server; returns (client link, server link)."""
        session = self.client.sessions.get(0) or self.open_session()
        link = session.attach(name, role)
        link.delivery_count = initial_delivery_count
        link.attach(p.Source("/src"), p.Target("/dst"), snd_settle_mode=snd_settle_mode)
        self.exchange()
        (attaching,) = self.take("server", ev.LinkAttaching)
        server_link = attaching.link
        server_link.attach(server_link.remote_attach.source, server_link.remote_attach.target,
                           snd_settle_mode=snd_settle_mode)
        self.exchange()
        assert self.take("client", ev.LinkAttached)
        return link, server_link


class Raw:
    """Bytes sent as they are, where a value belongs."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def encode_amqp(self) -> bytes:
        return self.raw


# ------------------------------------------------------------ connection
def test_open_negotiates_frame_size_channels_and_idle_timeout():
    pair = Pair(max_frame_size=4096, channel_max=7, idle_timeout=30)
    pair.client.open()
    pair.exchange()
    (opened,) = pair.take("client", ev.ConnectionOpened)
    assert opened.open.container_id == "server"
    assert pair.client.peer_max_frame_size == 4096
    assert pair.client.peer_channel_max == 7
    assert pair.client.peer_idle_timeout == 30.0
    assert pair.server.peer_idle_timeout is None
    assert pair.take("server", ev.ConnectionOpened)


def test_an_open_with_a_max_frame_size_below_512_is_a_framing_error():
    pair = Pair()
    pair.client.max_frame_size = 511   # spec 2.7.1: MIN-MAX-FRAME-SIZE is 512
    pair.client.open()
    pair.exchange()
    (closed,) = pair.take("server", ev.ConnectionClosed)
    assert closed.error.condition == errors.FRAMING_ERROR and "511" in closed.error.description
    assert pair.take("client", ev.ConnectionOpened)   # our open comes first, then the close
    assert pair.take("client", ev.ConnectionClosed)[0].error.condition == errors.FRAMING_ERROR


def test_sasl_anonymous_and_plain():
    anonymous = Pair(client_sasl=SaslClient(), server_sasl=SaslServer(lambda u, pw: False))
    anonymous.client.open()
    anonymous.exchange()
    assert anonymous.server.open_received and anonymous.server.sasl.identity == ""
    checked = []
    plain = Pair(client_sasl=SaslClient("PLAIN", "alice", "secret"),
                 server_sasl=SaslServer(lambda u, pw: checked.append((u, pw)) or pw == "secret"))
    plain.client.open()
    plain.exchange()
    assert checked == [("alice", "secret")]
    assert plain.client.open_received and plain.server.sasl.identity == "alice"


def test_sasl_plain_with_bad_credentials_is_refused():
    pair = Pair(client_sasl=SaslClient("PLAIN", "alice", "wrong"),
                server_sasl=SaslServer(lambda u, pw: pw == "secret"))
    pair.client.open()
    pair.exchange()
    (closed,) = pair.take("server", ev.ConnectionClosed)
    assert closed.error.condition == errors.UNAUTHORIZED_ACCESS
    assert pair.server.finished and not pair.server.open_received
    assert pair.take("client", ev.ConnectionClosed)[0].error.condition == errors.UNAUTHORIZED_ACCESS


def test_a_plain_password_past_512_bytes_logs_in():
    """A long token as the password (the auth server's secret) made a SASL frame over 512 bytes,
    which was a framing error: SASL frames are read up to 8 KiB, the AMQP frames after them
    within 512 bytes again until our open announces more."""
    token = "t" * 6000
    checked = []
    pair = Pair(client_sasl=SaslClient("PLAIN", "alice", token),
                server_sasl=SaslServer(lambda u, pw: checked.append(pw) or pw == token))
    pair.client.open()
    pair.exchange()
    assert checked == [token] and pair.client.open_received and pair.server.open_received
    server = Connection(client=False, container_id="s", sasl=SaslServer(lambda u, pw: True))
    server.receive_data(SASL_HEADER + encode_frame(0, p.SaslInit("PLAIN", b"\0a\0b").encode_amqp(), 1)
                        + AMQP_HEADER)
    assert server.reader.max_frame_size == 512


def _sasl_outcome(data: bytes) -> int:
    reader = FrameReader(8192)
    items = list(reader.feed(data))
    frame, _ = codec.decode(items[-1][2])
    assert isinstance(frame, p.SaslOutcome)
    return frame.code


def test_a_sasl_frame_over_8_kib_gets_a_sys_perm_outcome_then_a_hang_up():
    server = Connection(client=False, container_id="s", sasl=SaslServer(lambda u, pw: True))
    init = p.SaslInit("PLAIN", b"\0a\0" + b"x" * 9000).encode_amqp()
    events = server.receive_data(SASL_HEADER + encode_frame(0, init, 1))
    assert server.finished and events[0].error.condition == errors.FRAMING_ERROR
    assert _sasl_outcome(server.data_to_send()) == p.SASL_SYS_PERM


def test_a_stop_during_sasl_gets_a_sys_temp_outcome():
    server = Connection(client=False, container_id="s", sasl=SaslServer(lambda u, pw: True))
    server.receive_data(SASL_HEADER)
    server.close(p.Error(errors.CONNECTION_FORCED, "the daemon ended the connection"))
    assert server.finished and _sasl_outcome(server.data_to_send()) == p.SASL_SYS_TEMP


def test_sasl_required_refuses_a_bare_amqp_header():
    server = Connection(client=False, container_id="s", sasl=SaslServer(lambda u, pw: True), sasl_required=True)
    events = server.receive_data(AMQP_HEADER)
    assert server.data_to_send() == SASL_HEADER
    assert server.finished and isinstance(events[0], ev.ConnectionClosed)


def test_without_sasl_required_a_bare_amqp_header_is_served():
    server = Connection(client=False, container_id="s", sasl=SaslServer(lambda u, pw: True))
    server.receive_data(AMQP_HEADER)
    assert server.data_to_send() == AMQP_HEADER and not server.finished


@pytest.mark.parametrize("header", [b"HTTP/1.1", b"AMQP\x02\x01\x00\x00", b"AMQP\x00\x00\x09\x01"])
def test_unsupported_protocol_header_gets_ours_and_a_hang_up(header):
    server = Connection(client=False, container_id="s", sasl=SaslServer(lambda u, pw: True))
    server.receive_data(header)
    assert server.data_to_send() == SASL_HEADER
    assert server.finished


@pytest.mark.parametrize("data", [
    b"AMQP\x00\x02\x00\x00",                                                     # a header we lack
    SASL_HEADER + encode_frame(0, p.SaslInit("CRAM-MD5", b"x").encode_amqp(), 1),  # a failed SASL exchange
])
def test_before_the_amqp_header_exchange_close_sends_nothing(data):
    """Spec 2.2 and 5.3.2: a refused header or SASL exchange is followed by a hang-up, no AMQP close."""
    server = Connection(client=False, container_id="s", sasl=SaslServer(lambda u, pw: False))
    server.receive_data(data)
    said = server.data_to_send()
    server.close(p.Error(errors.CONNECTION_FORCED, "bye"))
    assert server.finished and not server.close_sent and server.data_to_send() == b""
    assert b"\x00\x53\x18" not in said


def test_close_after_the_header_exchange_sends_open_first():
    server = Connection(client=False, container_id="s")
    server.receive_data(AMQP_HEADER)
    server.close(p.Error(errors.CONNECTION_FORCED, "bye"))
    out = server.data_to_send()
    assert out.index(b"\x00\x53\x10") < out.index(b"\x00\x53\x18")


def _opened_server(**options) -> Connection:
    server = Connection(client=False, container_id="s", **options)
    server.receive_data(AMQP_HEADER + encode_frame(0, p.Open("c").encode_amqp()))
    server.data_to_send()
    return server


def _close_error(server: Connection, events: list) -> str:
    (closed,) = [e for e in events if isinstance(e, ev.ConnectionClosed)]
    out = server.data_to_send()
    assert p.Close(closed.error).encode_amqp() in out
    assert server.finished
    return closed.error.condition


@pytest.mark.parametrize("frame, condition", [
    (encode_frame(0, b"\x41"), errors.DECODE_ERROR),                                  # not described
    (encode_frame(0, b"\x00\x53\x10\x45"), errors.DECODE_ERROR),                      # open without container-id
    (encode_frame(0, b"\x00\x53\x99\x45"), errors.DECODE_ERROR),                      # unknown performative
    (encode_frame(0, p.Open("again").encode_amqp()), errors.ILLEGAL_STATE),           # second open
    (encode_frame(3, p.Flow(0, 1, 0, 1).encode_amqp()), errors.ILLEGAL_STATE),        # no session there
    (encode_frame(300, p.Begin(None, 0, 10, 10).encode_amqp()), errors.FRAMING_ERROR),  # beyond channel-max
    (encode_frame(300, p.Flow(0, 1, 0, 1).encode_amqp()), errors.FRAMING_ERROR),        # (spec 2.7.1)
    (encode_frame(0, b"x" * 200_000), errors.FRAMING_ERROR),                          # beyond max-frame-size
    (encode_frame(0, p.Close().encode_amqp() + b"junk"), errors.DECODE_ERROR),        # payload after close
    # spec 2.7.2: remote-channel is set only when answering a begin; we sent none
    (encode_frame(0, p.Begin(3, 0, 10, 10).encode_amqp()), errors.INVALID_FIELD),
])
def test_protocol_violations_close_the_connection_with_an_error(frame, condition):
    server = _opened_server()
    events = server.receive_data(frame)
    assert _close_error(server, events) == condition


@pytest.mark.parametrize("body", [
    b"\x00\x53\x18\xc0\x04\x01\xa1\x01x",                                 # close{error="x"}
    b"\x00\x53\x18\xc0\x02\x01\x45",                                       # close{error=[]}
    b"\x00\x53\x17\xc0\x03\x01\x52\x07",                                   # end{error=7}
    p.Detach(0, True, Raw(b"\xa1\x01x")).encode_amqp(),                     # detach{error="x"}
    p.Disposition(p.RECEIVER, 0, None, False, p.Rejected(Raw(b"\x45"))).encode_amqp(),  # rejected{error=[]}
])
def test_an_error_field_that_is_not_an_error_is_a_decode_error(body):
    """Spec 2.8.14: an error field holds an amqp:error list; the code reads its condition."""
    server = _opened_server()
    server.receive_data(encode_frame(0, p.Begin(None, 0, 100, 100).encode_amqp()))
    server.receive_data(encode_frame(0, p.Attach("l", 0, p.SENDER, source=p.Source(), target=p.Target(),
                                                initial_delivery_count=0).encode_amqp()))
    server.data_to_send()
    events = server.receive_data(encode_frame(0, body))
    assert _close_error(server, events) == errors.DECODE_ERROR


def test_a_violation_before_open_still_sends_open_then_close():
    server = Connection(client=False, container_id="s")
    events = server.receive_data(AMQP_HEADER + encode_frame(0, p.Begin(None, 0, 1, 1).encode_amqp()))
    out = server.data_to_send()
    assert out.startswith(AMQP_HEADER)
    assert out.index(b"\x00\x53\x10") < out.index(b"\x00\x53\x18")
    assert events[-1].error.condition == errors.ILLEGAL_STATE


def test_peer_close_is_answered():
    pair = Pair()
    pair.open_session()
    pair.client.close(p.Error("amqp:internal-error", "bye"))
    pair.exchange()
    (closed,) = pair.take("server", ev.ConnectionClosed)
    assert closed.by_peer and closed.error.description == "bye"
    assert pair.server.finished and pair.client.finished


@given(st.binary(min_size=1, max_size=400))
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_garbage_after_the_handshake_never_raises(garbage):
    server = _opened_server(sasl=SaslServer(lambda u, pw: True))
    server.receive_data(encode_frame(0, p.Begin(None, 0, 100, 100).encode_amqp()))
    server.receive_data(garbage)
    server.receive_data(encode_frame(0, b"\x00\x53\x14" + garbage))
    server.data_to_send()


_VALID_FRAMES = [
    p.Attach("l", 0, p.SENDER, source=p.Source("/s"), target=p.Target("/topics/t"), initial_delivery_count=0),
    p.Flow(0, 100, 0, 100, 0, 0, 10, echo=True),
    p.Transfer(0, 0, b"tag", 0, False),
    p.Disposition(p.RECEIVER, 0, 3, True, p.Accepted()),
    p.Detach(0, True, p.Error("amqp:internal-error", "x")),
    p.End(),
    p.Close(p.Error("amqp:internal-error")),
    p.Begin(None, 0, 100, 100),
    p.Open("again"),
]
_MUTANTS = (0x00, 0x40, 0x41, 0x43, 0x45, 0x52, 0x53, 0x70, 0xA0, 0xA1, 0xC0, 0xD0, 0xE0, 0xFF)


def test_every_truncation_and_byte_swap_of_valid_frames_is_handled():
    """Short and mutated performatives (the inline transfer reader included) never raise."""
    handshake = (AMQP_HEADER + encode_frame(0, p.Open("c").encode_amqp())
                 + encode_frame(0, p.Begin(None, 0, 100, 100).encode_amqp()))
    for performative in _VALID_FRAMES:
        body = performative.encode_amqp() + b"payload"
        variants = [body[:n] for n in range(len(body))]
        variants += [body[:i] + bytes([b]) + body[i + 1:] for i in range(len(body)) for b in _MUTANTS]
        for variant in variants:
            server = Connection(client=False, container_id="s")
            server.receive_data(handshake)
            server.receive_data(encode_frame(0, variant))
            server.data_to_send()


def test_every_truncation_and_byte_swap_of_a_sasl_init_is_handled():
    body = p.SaslInit("PLAIN", b"\x00user\x00pass", "host").encode_amqp()
    variants = [body[:n] for n in range(len(body))]
    variants += [body[:i] + bytes([b]) + body[i + 1:] for i in range(len(body)) for b in _MUTANTS]
    for variant in variants:
        server = Connection(client=False, container_id="s", sasl=SaslServer(lambda u, pw: True))
        server.receive_data(SASL_HEADER + encode_frame(0, variant, 1) + AMQP_HEADER)
        server.data_to_send()


@given(st.lists(st.binary(max_size=64), max_size=10))
@settings(max_examples=500, deadline=None)
def test_garbage_from_the_first_byte_never_raises(chunks):
    server = Connection(client=False, container_id="s", sasl=SaslServer(lambda u, pw: True))
    for chunk in chunks:
        server.receive_data(chunk)
    server.data_to_send()


# ------------------------------------------------------------ sessions
def test_peer_ended_session_is_answered_and_reported():
    pair = Pair()
    session = pair.open_session()
    session.end()
    pair.exchange()
    (ended,) = pair.take("server", ev.SessionEnded)
    assert ended.by_peer
    assert 0 not in pair.server.sessions and 0 not in pair.client.sessions


def test_late_frames_on_a_session_the_peer_ended_are_ignored_not_fatal():
    """rhea with a credit window sends a flow on its session's channel after its own end; that
    closed the whole connection with illegal-state, every other session with it. A frame on a
    channel that never had a session is still illegal-state."""
    pair = Pair()
    pair.open_session()
    other = pair.client.begin()
    pair.exchange()
    pair.client.sessions[0].end()
    pair.exchange()
    assert pair.take("server", ev.SessionEnded)
    late = encode_frame(0, p.Flow(0, 10, 0, 10).encode_amqp())
    pair.server_events += pair.server.receive_data(late + late)
    assert not pair.take("server", ev.ConnectionClosed) and not pair.server.close_sent
    other.end()
    pair.exchange()
    assert pair.take("server", ev.SessionEnded) and not pair.server.close_sent
    pair.server_events += pair.server.receive_data(encode_frame(7, p.Flow(0, 10, 0, 10).encode_amqp()))
    assert _close_error(pair.server, pair.server_events) == errors.ILLEGAL_STATE


def test_transfer_beyond_the_incoming_window_ends_the_session():
    pair = Pair()
    client_link, server_link = pair.link()
    server_link.flow(credit=INCOMING_WINDOW + 10)
    pair.exchange()
    client_link.session.remote_incoming_window = INCOMING_WINDOW + 10  # the client ignores our window
    client_link.send_transfers([b"%d" % i for i in range(INCOMING_WINDOW + 1)],
                               [b"x"] * (INCOMING_WINDOW + 1), False)
    events = pair.server.receive_data(pair.client.data_to_send())
    ended = [e for e in events if isinstance(e, ev.SessionEnded)]
    assert ended[0].error.condition == errors.WINDOW_VIOLATION and not ended[0].by_peer
    assert sum(len(e.deliveries) for e in events if isinstance(e, ev.Transfers)) == INCOMING_WINDOW
    assert not pair.server.finished


def test_incoming_window_is_kept_open():
    pair = Pair()
    client_link, server_link = pair.link()
    server_link.flow(credit=3 * INCOMING_WINDOW)
    pair.exchange()
    sent = 0
    while sent < 3 * INCOMING_WINDOW:
        n = min(client_link.session.outgoing_room, 3 * INCOMING_WINDOW - sent)
        assert n > 0
        client_link.send_transfers([b"%d" % i for i in range(n)], [b"x"] * n, True)
        sent += n
        pair.exchange()
    delivered = sum(len(e.deliveries) for e in pair.take("server", ev.Transfers))
    assert delivered == 3 * INCOMING_WINDOW


def _sender_facing_window(window: int):
    """A link pair whose receiver granted credit 10, with the sender's view of the peer's window set."""
    pair = Pair()
    client_link, server_link = pair.link()
    server_link.flow(credit=10)
    pair.exchange()
    session = client_link.session
    session.remote_incoming_window = window
    return pair, client_link, server_link, session


def test_frames_beyond_the_peers_window_wait_for_its_flow():
    pair, client_link, server_link, session = _sender_facing_window(3)
    client_link.send_transfers([b"%d" % i for i in range(5)], [b"x"] * 5, True)
    assert len(session.pending) == 2
    pair.exchange()
    assert sum(len(e.deliveries) for e in pair.take("server", ev.Transfers)) == 3
    server_link.session.send_flow()
    pair.exchange()
    assert not session.pending
    assert sum(len(e.deliveries) for e in pair.take("server", ev.Transfers)) == 2


def test_a_handle_is_not_reused_while_its_detach_waits_behind_held_back_transfers():
    """Our answer to the peer's detach waits behind transfers beyond the peer's window; a link
    attached meanwhile must not take that handle, or its attach would come before the detach."""
    pair, client_link, server_link, session = _sender_facing_window(1)
    client_link.send_transfers([b"0", b"1", b"2"], [b"x"] * 3, True)
    server_link.detach()
    pair.exchange()
    assert client_link.detach_received and session.pending   # our detach is still queued
    server_session = server_link.session
    incoming = server_session.attach("next", p.RECEIVER)
    incoming.attach(p.Source("/src"), p.Target("/dst"))
    pair.exchange()
    (attaching,) = pair.take("client", ev.LinkAttaching)
    attaching.link.attach(p.Source("/src"), p.Target("/dst"))
    pair.exchange()
    assert attaching.link.handle != client_link.handle
    assert incoming.attach_received and not pair.take("server", ev.SessionEnded)
    server_session.send_flow()
    pair.exchange()
    assert not session.pending and server_link.detach_received


# ------------------------------------------------------------ links
def test_refused_link_gets_a_null_node_then_a_detach_with_the_error():
    pair = Pair()
    pair.open_session()
    link = pair.client.sessions[0].attach("r", p.RECEIVER)
    link.attach(p.Source("/bad"), p.Target())
    pair.exchange()
    (attaching,) = pair.take("server", ev.LinkAttaching)
    attaching.link.refuse(p.Error(errors.NOT_FOUND, "no such node"))
    pair.exchange()
    (attached,) = pair.take("client", ev.LinkAttached)
    assert attached.link.remote_attach.source is None
    (detached,) = pair.take("client", ev.LinkDetached)
    assert detached.error.condition == errors.NOT_FOUND and detached.by_peer
    assert not pair.client.finished and not pair.server.finished
    assert not link.session.by_handle and not attaching.link.session.by_handle


def test_link_credit_is_set_not_added():
    pair = Pair()
    client_link, server_link = pair.link()
    server_link.flow(credit=5)
    server_link.flow(credit=5)
    pair.exchange()
    assert client_link.credit == 5


@pytest.mark.parametrize("initial", [0, 2**32 - 2])
def test_sender_credit_formula_across_a_flow_in_flight(initial):
    """credit(snd) = delivery-count(rcv) + credit(rcv) - delivery-count(snd), in serial arithmetic."""
    pair = Pair()
    client_link, server_link = pair.link(initial_delivery_count=initial)
    server_link.flow(credit=3)
    pair.exchange()
    client_link.send_transfers([b"a", b"b"], [b"1", b"2"], True)   # two deliveries in flight ...
    server_link.flow(credit=6)                                       # ... while the receiver sets 6
    to_server, to_client = pair.client.data_to_send(), pair.server.data_to_send()
    pair.client.receive_data(to_client)
    assert client_link.credit == 4                                   # 6 less the two in flight
    assert client_link.delivery_count == serial.add(initial, 2)
    pair.server.receive_data(to_server)
    assert server_link.credit == 4 and server_link.delivery_count == serial.add(initial, 2)


@pytest.mark.parametrize("credit", [2**31 - 1, 2**31, 2**32 - 1])
def test_any_uint_credit_is_credit(credit):
    """Spec 2.7.4: link-credit is a uint; 2**31 and more is no serial number and must not wrap to 0."""
    pair = Pair()
    client_link, server_link = pair.link(p.RECEIVER, initial_delivery_count=7)
    client_link.flow(credit=credit)
    pair.exchange()
    assert server_link.credit == credit


def test_a_receivers_delivery_count_ahead_of_ours_adds_no_credit():
    pair = Pair()
    client_link, server_link = pair.link(p.RECEIVER)
    client_link.delivery_count = 5  # the sender's count is 0 (spec 2.6.7: the sender's is authoritative)
    client_link.flow(credit=10)
    pair.exchange()
    assert server_link.credit == 10


def test_a_senders_delivery_count_gone_backwards_adds_no_credit():
    pair = Pair()
    client_link, server_link = pair.link(initial_delivery_count=100)
    server_link.flow(credit=10)
    pair.exchange()
    client_link.delivery_count = 50
    client_link.send_flow()
    pair.exchange()
    assert server_link.credit == 10 and server_link.delivery_count == 50
    client_link.delivery_count = 53  # a drain: three credits used up
    client_link.send_flow()
    pair.exchange()
    assert server_link.credit == 7 and server_link.delivery_count == 53


def test_drain_uses_up_the_credit_and_reports_it():
    pair = Pair()
    client_link, server_link = pair.link(p.RECEIVER)  # the server sends
    client_link.flow(credit=10, drain=True)
    pair.exchange()
    (flow,) = pair.take("server", ev.LinkFlow)
    assert flow.drain and server_link.credit == 10
    server_link.send_transfers([b"t"], [b"x"], True)
    server_link.complete_drain()
    pair.exchange()
    assert server_link.credit == 0 and server_link.delivery_count == 10
    assert client_link.credit == 0 and client_link.delivery_count == 10


def test_transfer_without_credit_detaches_that_link_only():
    pair = Pair()
    client_link, server_link = pair.link()
    client_link.credit = 1  # the client pretends
    client_link.send_transfers([b"t"], [b"x"], True)
    pair.exchange()
    (detached,) = pair.take("server", ev.LinkDetached)
    assert detached.error.condition == errors.TRANSFER_LIMIT_EXCEEDED and not detached.by_peer
    assert not pair.server.finished
    assert pair.take("client", ev.LinkDetached)[0].error.condition == errors.TRANSFER_LIMIT_EXCEEDED


def test_large_messages_are_split_to_the_peers_frame_size_and_reassembled():
    pair = Pair(max_frame_size=1024)
    client_link, server_link = pair.link()
    server_link.flow(credit=2)
    pair.exchange()
    payloads = [bytes(range(256)) * 20, b"small"]
    client_link.send_transfers([b"big", b"small"], payloads, False)
    frames = pair.client.data_to_send()
    events = pair.server.receive_data(frames)
    assert [d[3] for e in events if isinstance(e, ev.Transfers) for d in e.deliveries] == payloads
    assert server_link.session.next_incoming_id == 7  # 6 frames for 5120 bytes at 1024 a frame, 1 more


def test_a_delivery_above_the_links_max_message_size_arrives_without_payload():
    pair = Pair()
    client_link, server_link = pair.link()
    server_link.max_message_size = 1000
    server_link.flow(credit=3)
    pair.exchange()
    client_link.send_transfers([b"a", b"b", b"c"], [b"x" * 999, b"y" * 1001, b"z" * 300_000], False)
    pair.exchange()
    deliveries = [d for e in pair.take("server", ev.Transfers) for d in e.deliveries]
    assert [(d[1], d[3] and len(d[3])) for d in deliveries] == [(b"a", 999), (b"b", None), (b"c", None)]


def raw_transfers(pair: Pair, transfers: list) -> list:
    """Send hand-made ``(transfer fields, payload)`` frames on a link with credit 2; the deliveries
    the server reports as (tag, payload)."""
    client_link, server_link = pair.link()
    server_link.flow(credit=2)
    pair.exchange()
    session = client_link.session
    for fields, payload in transfers:
        session.send(p.Transfer(client_link.handle, **fields), payload)
    session.frames_sent(len(transfers))
    pair.exchange()
    return [(d[1], d[3]) for e in pair.take("server", ev.Transfers) for d in e.deliveries]


def test_aborted_delivery_is_dropped():
    first = {"delivery_id": 0, "delivery_tag": b"t", "message_format": 0, "settled": False, "more": True}
    pair = Pair()
    assert raw_transfers(pair, [(first, b"part"), ({"aborted": True}, b"")]) == []
    (client_link,) = pair.client.sessions[0].by_handle.values()
    client_link.send_transfers([b"u"], [b"whole"], False)
    pair.exchange()
    assert [d[1] for e in pair.take("server", ev.Transfers) for d in e.deliveries] == [b"u"]


def test_unfinished_deliveries_over_all_links_are_bounded_per_connection():
    """Each link holds at most one unfinished multi-frame delivery, but a connection may have 256
    sessions of 256 links: together they may hold at most ``max_partial_bytes``."""
    pair = Pair(max_partial_bytes=10_000)
    links = [pair.link(name=f"l{i}") for i in range(4)]
    for client_link, server_link in links:
        server_link.flow(credit=5)
    pair.exchange()

    def start(client_link, tag: bytes, size: int, more: bool = True) -> None:
        session = client_link.session
        session.send(p.Transfer(client_link.handle, delivery_id=session.next_outgoing_id, delivery_tag=tag,
                                message_format=0, settled=True, more=more), b"x" * size)
        session.frames_sent(1)
        pair.exchange()

    start(links[0][0], b"a", 4000)
    start(links[1][0], b"b", 4000)
    assert pair.server.partial_bytes == 8000
    session = links[0][0].session
    session.send(p.Transfer(links[0][0].handle), b"y" * 10)  # the end of "a": given back
    session.frames_sent(1)
    pair.exchange()
    assert [d[1] for e in pair.take("server", ev.Transfers) for d in e.deliveries] == [b"a"]
    assert pair.server.partial_bytes == 4000
    links[1][0].detach()  # a detached link's unfinished delivery is given back too
    pair.exchange()
    assert pair.server.partial_bytes == 0
    start(links[2][0], b"c", 6000)
    start(links[3][0], b"d", 4001)  # 10,001 held: too many
    (closed,) = pair.take("server", ev.ConnectionClosed)
    assert closed.error.condition == errors.RESOURCE_LIMIT_EXCEEDED
    assert "10000 bytes" in closed.error.description


class SharedBudget:
    """The daemon's body budget as the engine sees it: bytes shared by every connection."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def try_take(self, size: int) -> bool:
        if self.used + size > self.capacity:
            return False
        self.used += size
        return True

    def give_back(self, size: int) -> None:
        self.used -= size
        assert self.used >= 0


def test_unfinished_deliveries_past_the_free_allowance_take_from_the_shared_budget():
    """What a connection keeps of unfinished deliveries past ``free_partial_bytes`` comes from the
    budget every connection shares. A delivery that finds no room is not kept and completes as
    NO_ROOM (the gateway refuses it); the others go on, and what they took goes back."""
    budget = SharedBudget(5_000)
    pair = Pair(partial_budget=budget, free_partial_bytes=2_000)
    links = [pair.link(name=f"l{i}") for i in range(3)]
    for client_link, server_link in links:
        server_link.flow(credit=5)
    pair.exchange()

    def send(client_link, size: int, *, tag: bytes = b"", more: bool = True) -> None:
        session = client_link.session
        if tag:
            transfer = p.Transfer(client_link.handle, delivery_id=session.next_outgoing_id, delivery_tag=tag,
                                  message_format=0, settled=True, more=more)
        else:
            transfer = p.Transfer(client_link.handle, more=more)
        session.send(transfer, b"x" * size)
        session.frames_sent(1)
        pair.exchange()

    def delivered() -> list:
        return [(d[1], d[3] if d[3] is ev.NO_ROOM else len(d[3]))
                for e in pair.take("server", ev.Transfers) for d in e.deliveries]

    send(links[0][0], 3000, tag=b"a")
    assert (pair.server.partial_bytes, budget.used) == (3000, 1000)
    send(links[1][0], 3000, tag=b"b")
    assert (pair.server.partial_bytes, budget.used) == (6000, 4000)
    send(links[2][0], 1500, tag=b"c")  # 1,500 more would take the budget to 5,500
    assert (pair.server.partial_bytes, budget.used) == (6000, 4000)
    send(links[2][0], 10, more=False)  # c's frames after that are not kept either
    assert delivered() == [(b"c", ev.NO_ROOM)]
    send(links[0][0], 10, more=False)
    assert delivered() == [(b"a", 3010)]
    assert (pair.server.partial_bytes, budget.used) == (3000, 1000)
    send(links[2][0], 1500, tag=b"d")  # room again: kept
    assert (pair.server.partial_bytes, budget.used) == (4500, 2500)
    links[1][0].detach()
    pair.exchange()
    assert (pair.server.partial_bytes, budget.used) == (1500, 0)
    send(links[0][0], 2000, tag=b"e")
    assert budget.used == 1500
    pair.server.release_partials()  # the connection is over
    assert budget.used == 0


def test_a_continuation_may_repeat_the_delivery_id_but_not_change_it():
    """Spec 2.7.5 (transfer, delivery-id): "On continuation transfers the delivery-id MAY be omitted.
    It is an error if the delivery-id on a continuation transfer differs from the delivery-id on the
    first transfer of a delivery." We close with amqp:invalid-field, as Proton does."""
    pair = Pair()
    assert raw_transfers(pair, [
        ({"delivery_id": 0, "delivery_tag": b"t", "more": True}, b"par"),
        ({"delivery_id": 0}, b"t"),                  # the same id again: fine
        ({"delivery_id": 1, "delivery_tag": b"u", "more": True}, b"par"),
        ({"delivery_id": 7}, b"t"),                  # another id: an error
    ]) == [(b"t", b"part")]
    (closed,) = pair.take("server", ev.ConnectionClosed)
    assert closed.error.condition == errors.INVALID_FIELD
    assert pair.take("client", ev.ConnectionClosed)[0].error.condition == errors.INVALID_FIELD


def test_dispositions_settle_ranges_and_report_per_link():
    pair = Pair()
    client_link, server_link = pair.link()
    server_link.flow(credit=10)
    pair.exchange()
    client_link.send_transfers([b"%d" % i for i in range(10)], [b"x"] * 10, False)
    pair.exchange()
    (transfers,) = pair.take("server", ev.Transfers)
    ids = [d[0] for d in transfers.deliveries]
    server_link.settle(ids[:4] + ids[5:], p.Accepted())   # two ranges
    server_link.settle([ids[4]], p.Rejected(p.Error("amqp:not-allowed", "no")))
    out = pair.server.data_to_send()
    assert out.count(b"\x00\x53\x15") == 3
    settled = [e for e in pair.client.receive_data(out) if isinstance(e, ev.Settled)]
    assert [(type(s.state).__name__, s.tags) for s in settled] == [
        ("Accepted", [b"0", b"1", b"2", b"3"]), ("Accepted", [b"5", b"6", b"7", b"8", b"9"]),
        ("Rejected", [b"4"])]
    assert not client_link.session.unsettled


def test_dispositions_that_go_through_many_ids_count_as_more_frames_in_a_step():
    """A disposition over a range goes through up to as many ids as are unsettled: 128 of them
    over 2,500 each held the event loop for 60-130 ms a step. Every IDS_PER_FRAME ids count as
    one more frame against step_frames."""
    from amqp_gateway.connection import IDS_PER_FRAME

    pair = Pair(step_frames=32)
    client_link, server_link = pair.link(p.RECEIVER)
    client_link.flow(credit=640)
    pair.exchange()
    server_link.send_transfers([b"%d" % i for i in range(640)], [b"x"] * 640, False)
    pair.exchange()
    for first in range(10_000, 20_000, 1_000):  # ranges that match none of them
        client_link.session.send(p.Disposition(p.RECEIVER, first, first + 639, True, p.Accepted()))
    pair.server.receive_data(pair.client.data_to_send())
    cost = 1 + 640 // IDS_PER_FRAME
    handled = -(-32 // cost)  # frames until the step's budget is spent
    assert pair.server.more and handled < 10
    steps = 1
    while pair.server.more:
        pair.server.receive_data(b"")
        steps += 1
    assert steps == -(-10 // handled)
    assert len(server_link.session.unsettled) == 640


def _settle_unsettled_delivery(pair: Pair, state):
    """The server sends the client one unsettled delivery; the client gives it ``state``, unsettled.
    Returns the server's link."""
    client_link, server_link = pair.link(p.RECEIVER)
    client_link.flow(credit=1)
    pair.exchange()
    server_link.send_transfers([b"m"], [b"x"], False)
    pair.exchange()
    (transfers,) = pair.take("client", ev.Transfers)
    client_link.session.send(p.Disposition(p.RECEIVER, transfers.deliveries[0][0], None, False, state))
    return server_link


def test_unsettled_terminal_outcome_is_settled_by_the_sender():
    pair = Pair()
    server_link = _settle_unsettled_delivery(pair, p.Released())
    pair.exchange()
    (settled,) = pair.take("server", ev.Settled)
    assert settled.tags == [b"m"] and not settled.settled
    assert not server_link.session.unsettled


def test_an_outcome_with_any_valid_array_is_settled_back_as_it_came():
    """The settling disposition repeats the peer's state: arrays of booleans (0x41 elements), of
    empty lists, of arrays are valid AMQP (spec 1.6) and must encode again."""
    pair = Pair()
    arrays = {"bools": Raw(b"\xe0\x02\x01\x41"), "lists": Raw(b"\xe0\x02\x01\x45"),
              "arrays": Raw(b"\xe0\x06\x01\xe0\x03\x01\x56\x01")}
    _settle_unsettled_delivery(pair, p.Modified(True, False, arrays))
    pair.exchange()
    (settled,) = pair.take("server", ev.Settled)
    assert settled.state.message_annotations["bools"].items == [True]
    assert not pair.server.close_sent


def _attach_with(pair: Pair, *frames) -> list:
    """The client's attach and ``frames`` arrive at the server together; the events they make."""
    session = pair.client.sessions.get(0) or pair.open_session()
    link = session.attach("l", p.SENDER)
    link.attach(p.Source(), p.Target("/t"))
    for frame in frames:
        session.send(frame)
    return pair.server.receive_data(pair.client.data_to_send())


def _bodies(data: bytes) -> list[bytes]:
    """The frame bodies in ``data``, frames after the protocol headers."""
    reader = FrameReader(1 << 20)
    reader.expect_header = False
    return [body for _, _, body in reader.feed(data)]


def _performatives(data: bytes) -> list:
    return [type(codec.decode(body)[0]) for body in _bodies(data)]


@pytest.mark.parametrize("frame, error", [
    (p.Detach(0, True), None),                                          # the peer's detach, pipelined
    (p.Transfer(0, 0, b"t", 0), errors.TRANSFER_LIMIT_EXCEEDED),         # a transfer without credit
])
def test_a_detach_waits_for_our_attach(frame, error):
    """Spec 2.6.3: our attach answers the peer's before any detach of ours on that link."""
    pair = Pair()
    events = _attach_with(pair, frame)
    (attaching,) = [e for e in events if isinstance(e, ev.LinkAttaching)]
    (detached,) = [e for e in events if isinstance(e, ev.LinkDetached)]
    assert attaching.link.over and (detached.error and detached.error.condition) == error
    assert pair.server.data_to_send() == b""
    attaching.link.refuse(None)
    out = pair.server.data_to_send()
    assert _performatives(out) == [p.Attach, p.Detach]
    assert p.Detach(0, True, detached.error).encode_amqp() in out
    link = attaching.link
    assert (link.handle in link.session.by_handle) == (error is not None)  # released once both detached


def test_a_held_detach_keeps_its_handle_from_new_links():
    pair = Pair()
    events = _attach_with(pair, p.Detach(0, True), p.Attach("m", 1, p.SENDER, source=p.Source(),
                                                            target=p.Target("/t"), initial_delivery_count=0))
    first, second = [e.link for e in events if isinstance(e, ev.LinkAttaching)]
    assert first.handle != second.handle
    first.refuse(None)
    assert first.handle not in first.session.by_handle  # the peer's detach came: both are out


@pytest.mark.parametrize("frame", [p.End(), p.Close()])
def test_nothing_follows_our_end_or_close(frame):
    """Spec 2.5, 2.4.3: an attach that arrived with the peer's end or close is answered by it."""
    pair = Pair()
    events = _attach_with(pair, frame)
    (attaching,) = [e for e in events if isinstance(e, ev.LinkAttaching)]
    assert _performatives(pair.server.data_to_send()) == [type(frame)]
    assert attaching.link.over
    attaching.link.attach(p.Source(), p.Target("/t"))
    attaching.link.flow(credit=10)
    assert pair.server.data_to_send() == b""


def _small_frames_attach(attach: p.Attach) -> tuple[Connection, list]:
    """A server whose client announced the smallest max-frame-size, 512, then attached with ``attach``."""
    server = Connection(client=False, container_id="s")
    events = server.receive_data(AMQP_HEADER + encode_frame(0, p.Open("c", max_frame_size=512).encode_amqp())
                                 + encode_frame(0, p.Begin(None, 0, 100, 100).encode_amqp())
                                 + encode_frame(0, attach.encode_amqp()))
    server.data_to_send()
    return server, [e.link for e in events if isinstance(e, ev.LinkAttaching)]


def test_our_frames_fit_the_peers_max_frame_size():
    """Spec 2.7.1: the client's attach fits our max-frame-size, not necessarily its own; our answer,
    which repeats it, and an error quoting it are made to fit (512 bytes at the least)."""
    address = "/topics/" + "q" * 700
    big = p.Attach("l", 0, p.SENDER, source=p.Source("/s", capabilities=["c" * 200] * 3),
                   target=p.Target(address), initial_delivery_count=0, properties={"k": "v" * 600})
    server, (link,) = _small_frames_attach(big)
    link.refuse(p.Error(errors.INVALID_FIELD, f"invalid topic name in {address!r}"))
    link.session.send(p.Disposition(p.SENDER, 0, None, True, p.Rejected(p.Error(errors.DECODE_ERROR, "x" * 900))))
    server.close(p.Error(errors.INTERNAL_ERROR, "y" * 900))
    out = server.data_to_send()
    assert _performatives(out) == [p.Attach, p.Detach, p.Disposition, p.Close]
    assert max(len(body) + 8 for body in _bodies(out)) <= 512
    attach, detach, disposition, close = [codec.decode(body)[0] for body in _bodies(out)]
    assert attach.source.address == "/s" and attach.target is None and not attach.properties
    assert detach.error.description.startswith("invalid topic name in '/topics/qqq")
    assert disposition.state.error.condition == errors.DECODE_ERROR


def test_a_frame_that_cannot_fit_the_peers_max_frame_size_closes_the_connection():
    server, (link,) = _small_frames_attach(p.Attach("n" * 600, 0, p.SENDER, source=p.Source("/s"),
                                                    target=p.Target("/t"), initial_delivery_count=0))
    link.attach(p.Source("/s"), p.Target("/t"))
    out = server.data_to_send()
    assert _performatives(out) == [p.Close] and server.close_sent
    assert codec.decode(_bodies(out)[0])[0].error.condition == errors.FRAME_SIZE_TOO_SMALL


def test_detach_by_the_peer_is_answered():
    pair = Pair()
    client_link, server_link = pair.link()
    client_link.detach(p.Error("amqp:internal-error", "done"))
    pair.exchange()
    (detached,) = pair.take("server", ev.LinkDetached)
    assert detached.by_peer and detached.error.description == "done"
    assert not server_link.session.by_remote_handle and not client_link.session.by_handle


# ------------------------------------------------------------ publish credit shared by a topic's links
class Publisher:
    def __init__(self, credit: int = 0) -> None:
        self.topic_name = "t"
        self.link = CountedLink(credit)


class CountedLink:
    """A link whose credit counts how often it is read."""

    reads = 0

    def __init__(self, credit: int) -> None:
        self._credit = credit

    @property
    def credit(self) -> int:
        CountedLink.reads += 1
        return self._credit


def test_a_round_of_grants_over_a_topics_links_reads_each_links_credit_about_once():
    """Summing every link's credit at every grant made a poll round over 5,000 starved links
    cost 7.6 s of the event loop: the sum is kept (HELD_TTL) and updated with our grants."""
    links = TopicLinks()
    publishers = [Publisher() for _ in range(2000)]
    for publisher in publishers:
        links.add(publisher)
    holder = Publisher()
    links.add(holder)
    CountedLink.reads = 0
    assert links.share(holder, 100) == 1   # an equal share of 100 among 2,001 links
    links.granted(holder, 1)
    assert [links.share(p, 100) for p in publishers[:3]] == [1, 1, 1]
    for publisher in publishers:
        links.share(publisher, 100)
    assert CountedLink.reads <= 2 * len(publishers)
    links.discard(holder)   # its credit is free again
    assert links.share(publishers[0], 4000) == 2
