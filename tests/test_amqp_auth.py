"""AMQP under the daemon's auth servers: the SASL PLAIN password is nsqd's AUTH secret, and its
authorizations decide which links attach and publish, re-checked once they expire.

The daemon runs in-process with a real auth server on loopback; proton is the client where it
can show the behaviour, our engine where frames must be checked exactly.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio
from proton import ConnectionException, Delivery, Message
from proton.utils import BlockingConnection, LinkDetached

from amqp_gateway import events as ev, performatives as p
from amqp_gateway.connection import Connection
from amqp_gateway.framing import AMQP_HEADER, SASL_HEADER, TYPE_SASL, encode_frame
from amqp_gateway.sasl import SaslClient, SaslServer
from nsqd import stats

from .support import running_nsqd
from .test_amqp_raw import Client, body_of, body_payload
from .test_parity import AuthServer, grant


@asynccontextmanager
async def daemon_with_auth(tmp_path, secrets: dict[str, dict]):
    server = AuthServer(secrets)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path / "nsqd", amqp_address="127.0.0.1:0",
                                auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            nsqd.amqp_port = nsqd.amqp_addresses[0][1]
            yield nsqd, server
        nursery.cancel_scope.cancel()


def proton_connect(nsqd, password: str | None = None, **kwargs) -> BlockingConnection:
    if password is not None:
        kwargs.update(user="app", password=password, allowed_mechs="PLAIN")
    return BlockingConnection(f"127.0.0.1:{nsqd.amqp_port}", timeout=5, **kwargs)


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


async def login(nsqd, secret: str) -> Client:
    return await Client.connect(nsqd.amqp_port, sasl=SaslClient("PLAIN", "app", secret))


async def refused_attach(client: Client, role: bool, address: str) -> p.Error:
    """Attach, expect the refusal of spec 2.6.3 (a null node, then a detach), return its error."""
    link = await client.attach(role, address)
    remote = link.remote_attach
    assert (remote.target if role is p.SENDER else remote.source) is None
    await client.until(lambda: link.detach_received)
    (detached,) = client.take(ev.LinkDetached, link)
    return detached.error


async def test_the_password_is_the_secret_for_publishing_and_consuming(tmp_path):
    async with daemon_with_auth(tmp_path, {"good": grant("^orders$", [".*"], ["subscribe", "publish"])}) as (
            nsqd, server):
        def use():
            conn = proton_connect(nsqd, "good")
            sender = conn.create_sender("/topics/orders")
            states = [sender.send(Message(body=b"o%d" % i, inferred=True)).remote_state for i in range(3)]
            receiver = conn.create_receiver("/topics/orders/channels/billing", credit=10)
            messages = [receiver.receive(timeout=5) for _ in range(3)]
            bodies = [bytes(m.body) for m in messages]  # the body is a view into the message
            receiver.accept()
            with pytest.raises(LinkDetached) as refused:
                conn.create_sender("/topics/invoices")
            conn.close()
            return states, bodies, refused.value.condition

        states, bodies, condition = await in_thread(use)
        assert states == [Delivery.ACCEPTED] * 3
        assert bodies == [b"o0", b"o1", b"o2"]
        assert condition == "amqp:unauthorized-access"
        assert "invoices" not in nsqd.topics
        # one login, one query, for every attach and publish within the TTL
        assert server.queries == ["good"]
        (form,) = server.forms
        assert (form["remote_ip"], form["tls"], form["secret"]) == (["127.0.0.1"], ["false"], ["good"])


async def test_the_identity_shows_in_stats(tmp_path):
    async with daemon_with_auth(tmp_path, {"good": grant("^t$", [".*"], ["subscribe", "publish"])}) as (nsqd, _):
        client = await login(nsqd, "good")
        await client.attach(p.RECEIVER, "/topics/t/channels/c")
        assert [type(o) for o in await client.publish(await client.attach(p.SENDER, "/topics/t"), [b"x"])] == [
            p.Accepted]
        snapshot = stats.snapshot(nsqd)
        (consumer,) = snapshot.topics[0].channels[0].clients
        (producer,) = snapshot.producers
        for record in (consumer, producer):
            assert (record.authed, record.auth_identity, record.auth_identity_url) == (
                True, "alice", "http://id/alice")


async def test_a_bad_secret_fails_sasl_and_nothing_gets_in_unchecked(tmp_path):
    secrets = {"good": grant(".*", [".*"], ["publish"]), "empty": {"ttl": 60, "authorizations": []}}
    async with daemon_with_auth(tmp_path, secrets) as (nsqd, server):
        def attempt():
            with pytest.raises(ConnectionException) as failed:
                proton_connect(nsqd, "wrong")
            return str(failed.value)

        assert "amqp:unauthorized-access" in await in_thread(attempt)
        for secret in ("wrong", "empty"):  # refused, or granted nothing
            client = await login(nsqd, secret)
            assert client.conn.finished and not client.conn.open_received
            (closed,) = client.take(ev.ConnectionClosed)
            assert closed.error.condition == "amqp:unauthorized-access"
        assert server.queries == ["wrong", "wrong", "empty"]
        # ANONYMOUS is not offered, a connection without SASL is refused: neither asks the auth server
        for options in ({"sasl": SaslClient()}, {}):
            client = await Client.connect(nsqd.amqp_port, **options)
            assert client.conn.finished and not client.conn.open_received
        assert server.queries == ["wrong", "wrong", "empty"]
        assert (await login(nsqd, "good")).conn.open_received


async def test_an_unauthorized_link_is_refused_and_the_connection_lives_on(tmp_path):
    secret = grant("^orders$", ["^billing$"], ["subscribe"])
    # nsqd matches a publish against the channel "": publishing needs a grant of its own
    secret["authorizations"].append({"topic": "^orders$", "channels": [".*"], "permissions": ["publish"]})
    async with daemon_with_auth(tmp_path, {"s": secret}) as (nsqd, server):
        client = await login(nsqd, "s")
        error = await refused_attach(client, p.SENDER, "/topics/secrets")
        assert error.condition == "amqp:unauthorized-access" and "secrets" in error.description
        error = await refused_attach(client, p.RECEIVER, "/topics/orders/channels/audit")
        assert error.condition == "amqp:unauthorized-access" and "orders/audit" in error.description
        assert "secrets" not in nsqd.topics  # refused before anything was created

        sender = await client.attach(p.SENDER, "/topics/orders")
        assert sender.remote_attach.target.address == "/topics/orders"
        assert [type(o) for o in await client.publish(sender, [b"a"])] == [p.Accepted]
        receiver = await client.attach(p.RECEIVER, "/topics/orders/channels/billing")
        receiver.flow(5)
        await client.until(lambda: any(isinstance(e, ev.Transfers) for e in client.events))
        assert [body_of(d) for d in client.deliveries(receiver)] == [b"a"]
        assert list(nsqd.topics["orders"].channels) == ["billing"]
        assert server.queries == ["s"]


async def test_publish_only_cannot_consume(tmp_path):
    async with daemon_with_auth(tmp_path, {"pub": grant("^t$", [".*"], ["publish"])}) as (nsqd, _):
        client = await login(nsqd, "pub")
        error = await refused_attach(client, p.RECEIVER, "/topics/t/channels/c")
        assert error.condition == "amqp:unauthorized-access"
        assert [type(o) for o in await client.publish(await client.attach(p.SENDER, "/topics/t"), [b"x"])] == [
            p.Accepted]


async def test_an_expired_authorization_is_asked_for_again(tmp_path, mock_clock):
    mock_clock.rate = 1  # real time, plus the jumps below
    secrets = {"s": grant("^t$", [".*"], ["subscribe", "publish"], ttl=10)}
    async with daemon_with_auth(tmp_path, secrets) as (nsqd, server):
        client = await login(nsqd, "s")
        sender = await client.attach(p.SENDER, "/topics/t")
        assert [type(o) for o in await client.publish(sender, [b"1"])] == [p.Accepted]
        assert server.queries == ["s"]

        mock_clock.jump(11)  # expired: the next publish asks again, then goes through
        assert [type(o) for o in await client.publish(sender, [b"2"])] == [p.Accepted]
        assert server.queries == ["s", "s"]
        await client.attach(p.RECEIVER, "/topics/t/channels/c")
        assert server.queries == ["s", "s"]  # renewed for another 10 s

        mock_clock.jump(11)  # expired: the next attach asks again
        receiver = await client.attach(p.RECEIVER, "/topics/t/channels/d")
        assert receiver.remote_attach.source.address == "/topics/t/channels/d"
        assert server.queries == ["s", "s", "s"]

        # renewed without publish: the publishing link is detached, the connection stays
        secrets["s"] = grant("^t$", [".*"], ["subscribe"], ttl=10)
        mock_clock.jump(11)
        sender.send_transfers([b"x"], [body_payload(b"3")], False)
        await client.until(lambda: sender.detach_received)
        (detached,) = client.take(ev.LinkDetached, sender)
        assert detached.error.condition == "amqp:unauthorized-access"
        assert server.queries == ["s"] * 4 and not client.conn.finished

        # not renewed at all: the connection is closed
        del secrets["s"]
        mock_clock.jump(11)
        client.session.attach("e", p.RECEIVER).attach(p.Source("/topics/t/channels/e"), p.Target())
        await client.until(lambda: client.conn.finished)
        (closed,) = client.take(ev.ConnectionClosed)
        assert closed.by_peer and closed.error.condition == "amqp:unauthorized-access"
        assert server.queries == ["s"] * 5
        assert nsqd.topics["t"].message_count == 2
        assert "e" not in nsqd.topics["t"].channels


async def test_without_auth_servers_plain_and_anonymous_get_in(tmp_path):
    async with running_nsqd(tmp_path / "nsqd", amqp_address="127.0.0.1:0") as nsqd:
        nsqd.amqp_port = nsqd.amqp_addresses[0][1]

        def use(**kwargs):
            conn = proton_connect(nsqd, **kwargs)
            state = conn.create_sender("/topics/t").send(Message(body=b"x", inferred=True)).remote_state
            conn.close()
            return state

        assert await in_thread(lambda: use(password="anything")) == Delivery.ACCEPTED
        assert await in_thread(lambda: use(allowed_mechs="ANONYMOUS")) == Delivery.ACCEPTED
        assert nsqd.topics["t"].message_count == 2


# ------------------------------------------------------------ the engine
def _server_waiting_for_a_login() -> tuple[Connection, list]:
    """A server engine that got a PLAIN login with the AMQP header and open pipelined behind it."""
    server = Connection(client=False, container_id="s", sasl=SaslServer(anonymous=False), sasl_required=True)
    init = encode_frame(0, p.SaslInit("PLAIN", b"\x00app\x00pw").encode_amqp(), TYPE_SASL)
    events = server.receive_data(SASL_HEADER + init + AMQP_HEADER + encode_frame(0, p.Open("c").encode_amqp()))
    return server, events


def _sasl_frame(frame) -> bytes:
    return encode_frame(0, frame.encode_amqp(), TYPE_SASL)


def test_a_login_holds_what_follows_until_the_verdict():
    server, events = _server_waiting_for_a_login()
    assert events == [ev.SaslLogin("app", "pw")]
    assert "pw" not in repr(events[0])
    assert server.data_to_send() == SASL_HEADER + _sasl_frame(p.SaslMechanisms(("PLAIN",)))
    assert server.receive_data(b"") == [] and not server.open_received  # the open waits
    events = server.sasl_verdict(True)
    assert [type(e) for e in events] == [ev.ConnectionOpened]
    assert server.sasl.identity == "app"
    out = server.data_to_send()
    head = _sasl_frame(p.SaslOutcome(p.SASL_OK)) + AMQP_HEADER
    assert out.startswith(head) and out[len(head):]  # then our open


def test_a_refused_login_reads_nothing_more():
    server, _ = _server_waiting_for_a_login()
    server.data_to_send()
    (closed,) = server.sasl_verdict(False)
    assert closed.error.condition == "amqp:unauthorized-access"
    assert server.data_to_send() == _sasl_frame(p.SaslOutcome(p.SASL_AUTH))
    assert server.finished and not server.open_received and server.sasl.identity is None


async def test_an_amqps_login_is_asked_about_with_tls_true(tmp_path):
    from .test_amqp_tls import CERTS, domain

    server = AuthServer({"good": grant("^orders$", [".*"], ["publish"])})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path / "nsqd", amqps_address="127.0.0.1:0", tls_cert=CERTS["cert"],
                                tls_key=CERTS["key"], auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            def publish():
                conn = BlockingConnection(f"amqps://127.0.0.1:{nsqd.amqps_addresses[0][1]}", timeout=5,
                                          ssl_domain=domain(CERTS["ca"], False), user="app", password="good",
                                          allowed_mechs="PLAIN")
                try:
                    return conn.create_sender("/topics/orders").send(Message(body=b"o", inferred=True)).remote_state
                finally:
                    conn.close()

            assert await in_thread(publish) == Delivery.ACCEPTED
        nursery.cancel_scope.cancel()
    (form,) = server.forms
    assert (form["tls"], form["secret"]) == (["true"], ["good"])
