"""AMQP over TLS (amqps), with Qpid Proton as the client, and --tls-required on the plain listener."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from contextlib import asynccontextmanager

import pytest
import trio
import trustme
from proton import ConnectionException, Delivery, Message, SSLDomain, SSLException
from proton.utils import BlockingConnection

from nsqd import stats
from nsqd.options import TLS_REQUIRED

from .support import NSQConnection, running_nsqd, tcp_port


def _certs() -> tuple[dict, dict]:
    """The daemon's certificate, a client's, their CA, and a CA that signed nothing of ours."""
    ca, stranger = trustme.CA(), trustme.CA()
    cert, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("client.example")
    folder = tempfile.mkdtemp(prefix="nsqd-amqps-")
    atexit.register(shutil.rmtree, folder, True)  # made at import: removed when the test run ends
    paths = {name: f"{folder}/{name}.pem" for name in ("cert", "key", "ca", "stranger", "client", "client_key")}
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    client.cert_chain_pems[0].write_to_path(paths["client"])
    client.private_key_pem.write_to_path(paths["client_key"])
    ca.cert_pem.write_to_path(paths["ca"])
    stranger.cert_pem.write_to_path(paths["stranger"])
    return paths


CERTS = _certs()


@asynccontextmanager
async def amqps_daemon(tmp_path, **overrides):
    async with running_nsqd(tmp_path / "nsqd", amqps_address="127.0.0.1:0", tls_cert=CERTS["cert"],
                            tls_key=CERTS["key"], **overrides) as nsqd:
        yield nsqd


def domain(ca: str, certificate: bool) -> SSLDomain:
    client = SSLDomain(SSLDomain.MODE_CLIENT)
    client.set_trusted_ca_db(ca)
    client.set_peer_authentication(SSLDomain.VERIFY_PEER)
    if certificate:
        client.set_credentials(CERTS["client"], CERTS["client_key"], None)
    return client


def amqps(nsqd, ca: str = CERTS["ca"], certificate: bool = False) -> BlockingConnection:
    return BlockingConnection(f"amqps://127.0.0.1:{nsqd.amqps_addresses[0][1]}", timeout=5,
                              ssl_domain=domain(ca, certificate))


async def slots_given_back(nsqd) -> None:
    """Every connection slot is free again (given back just after a dropped socket is closed)."""
    with trio.fail_after(5):
        while nsqd.connection_slots.used:
            await trio.sleep(0.01)


def publish_and_consume(nsqd) -> list[bytes]:
    """Publish two messages over one amqps connection and take them from a channel over another."""
    consumer, publisher = amqps(nsqd), amqps(nsqd)
    try:
        receiver = consumer.create_receiver("/topics/secure/channels/c", credit=10)
        sender = publisher.create_sender("/topics/secure")
        for body in (b"one", b"two"):
            sender.send(Message(body=body, inferred=True))  # unsettled: returns once accepted
        bodies = []
        for _ in range(2):
            message = receiver.receive(timeout=5)  # kept: its body is a view into memory the message owns
            bodies.append(bytes(message.body))
            receiver.accept()
        return bodies
    finally:
        publisher.close()
        consumer.close()


async def test_amqps_publishes_and_consumes_and_stats_say_tls(tmp_path):
    async with amqps_daemon(tmp_path) as nsqd:
        consumer = await trio.to_thread.run_sync(amqps, nsqd)
        await trio.to_thread.run_sync(lambda: consumer.create_receiver("/topics/secure/channels/watched", credit=1))
        (client,) = stats.snapshot(nsqd).topics[0].channels[0].clients
        assert client.tls and client.tls_version.startswith("TLS1.") and client.tls_cipher_suite
        await trio.to_thread.run_sync(consumer.close)

        assert await trio.to_thread.run_sync(publish_and_consume, nsqd) == [b"one", b"two"]
        channel = nsqd.topics["secure"].channels["c"]
        assert channel.message_count == 2 and channel.depth == 0
        assert await trio.to_thread.run_sync(publish_and_consume, nsqd) == [b"one", b"two"]
        assert channel.message_count == 4


async def test_a_client_that_does_not_trust_the_certificate_cannot_connect(tmp_path):
    async with amqps_daemon(tmp_path) as nsqd:
        with pytest.raises((ConnectionException, SSLException)):
            await trio.to_thread.run_sync(lambda: amqps(nsqd, CERTS["stranger"]).create_sender("/topics/t"))
        assert await trio.to_thread.run_sync(publish_and_consume, nsqd) == [b"one", b"two"]
        await slots_given_back(nsqd)


async def test_plain_amqp_and_silence_on_the_amqps_port_are_dropped_and_hold_no_slot(tmp_path, monkeypatch):
    monkeypatch.setattr("amqp_gateway.server.HANDSHAKE_TIMEOUT", 0.5)
    async with amqps_daemon(tmp_path) as nsqd:
        port = nsqd.amqps_addresses[0][1]
        plain = await trio.open_tcp_stream("127.0.0.1", port)
        await plain.send_all(b"AMQP\x00\x01\x00\x00")  # a plain AMQP header, not a TLS hello
        silent = await trio.open_tcp_stream("127.0.0.1", port)  # says nothing at all
        with trio.fail_after(5):
            while await plain.receive_some(1024):  # perhaps a TLS alert, then the end
                pass
            assert await silent.receive_some(1024) == b""  # cut off after the handshake timeout
            await slots_given_back(nsqd)
        assert await trio.to_thread.run_sync(publish_and_consume, nsqd) == [b"one", b"two"]
        await plain.aclose()
        await silent.aclose()


async def test_tls_required_refuses_plain_amqp_and_serves_amqps(tmp_path):
    async with amqps_daemon(tmp_path, amqp_address="127.0.0.1:0", tls_required=TLS_REQUIRED) as nsqd:
        plain_port, secure_port = nsqd.amqp_addresses[0][1], nsqd.amqps_addresses[0][1]

        def plain_connect():
            BlockingConnection(f"127.0.0.1:{plain_port}", timeout=5).create_sender("/topics/t")

        with pytest.raises(ConnectionException) as refused:
            await trio.to_thread.run_sync(plain_connect)
        assert "amqp:not-allowed" in str(refused.value)
        assert f"TLS is required: connect with amqps (port {secure_port})" in str(refused.value)
        await slots_given_back(nsqd)
        assert await trio.to_thread.run_sync(publish_and_consume, nsqd) == [b"one", b"two"]
        consumer = await NSQConnection.open(tcp_port(nsqd))  # NSQ TCP is untouched by this
        await consumer.command("NOP")


async def test_the_daemon_checks_client_certificates_on_amqps_when_asked(tmp_path):
    async with amqps_daemon(tmp_path, tls_client_auth_policy="require-verify", tls_root_ca_file=CERTS["ca"]) as nsqd:
        with pytest.raises((ConnectionException, SSLException)):  # no client certificate
            await trio.to_thread.run_sync(lambda: amqps(nsqd).create_sender("/topics/t"))
        await slots_given_back(nsqd)

        def with_certificate():
            conn = amqps(nsqd, certificate=True)
            try:
                return conn.create_sender("/topics/t").send(Message(body=b"signed", inferred=True)).remote_state
            finally:
                conn.close()

        assert await trio.to_thread.run_sync(with_certificate) == Delivery.ACCEPTED
        assert nsqd.topics["t"].message_count == 1


async def test_a_client_over_max_connections_is_refused_over_tls(tmp_path):
    async with amqps_daemon(tmp_path, max_connections=1) as nsqd:
        def second_is_refused():
            first = amqps(nsqd)
            try:
                first.create_sender("/topics/t")
                with pytest.raises(ConnectionException) as refused:
                    amqps(nsqd).create_sender("/topics/t")
                return str(refused.value)
            finally:
                first.close()

        assert "amqp:resource-limit-exceeded" in await trio.to_thread.run_sync(second_is_refused)
        await slots_given_back(nsqd)
