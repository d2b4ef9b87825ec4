"""Drop-in parity: TLS, snappy and deflate upgrades, AUTH against an auth server."""

import json
import signal
import ssl
import subprocess
import time
import sys
from contextlib import asynccontextmanager

import h11
import nsq
import pytest
import trio
import trio.testing
import trustme

from nsqd import message

from .support import FRAME_RESPONSE, Daemon, NSQConnection, running_nsqd, tcp_port
from .test_pynsq import run_loop


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture
def certs(ca, tmp_path):
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path, ca_path = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(cert_path)
    cert.private_key_pem.write_to_path(key_path)
    ca.cert_pem.write_to_path(ca_path)
    return {"tls_cert": str(cert_path), "tls_key": str(key_path), "ca": str(ca_path)}


def client_tls_context(certs) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=certs["ca"])


async def test_tls_upgrade_sends_ok_over_tls(tmp_path, certs):
    async with running_nsqd(tmp_path / "d", tls_cert=certs["tls_cert"], tls_key=certs["tls_key"]) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("IDENTIFY", json.dumps({"feature_negotiation": True, "tls_v1": True}).encode())
        kind, data = await conn.read_frame()
        assert kind == FRAME_RESPONSE and json.loads(data)["tls_v1"] is True
        conn.stream = trio.SSLStream(conn.stream, client_tls_context(certs), server_hostname="127.0.0.1")
        await conn.stream.do_handshake()
        await conn.expect_response(b"OK")
        await conn.sub("t", "c")
        await conn.pub("t", b"secret")
        await conn.command("RDY 1")
        assert (await conn.read_message()).body == b"secret"
        client = next(c for c in nsqd.clients.values() if c.sub is not None)
        assert client.tls and client.tls_version.startswith("TLS")


async def test_tls_required_refuses_plain_commands(tmp_path, certs):
    async with running_nsqd(tmp_path / "d", tls_cert=certs["tls_cert"], tls_key=certs["tls_key"],
                            tls_required=2) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("SUB t c")
        await conn.expect_error("E_INVALID cannot SUB in current state (TLS required)")
        await conn.expect_closed()


async def test_tls_not_offered_without_a_certificate(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        resp = await conn.identify(feature_negotiation=True, tls_v1=True)
        assert resp["tls_v1"] is False
        await conn.sub("t", "c")  # still plain text


async def test_deflate_and_snappy_together_is_refused(tmp_path):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("IDENTIFY", json.dumps({"feature_negotiation": True, "deflate": True,
                                                   "snappy": True}).encode())
        await conn.expect_error("E_IDENTIFY_FAILED cannot enable both deflate and snappy compression")


async def test_deflate_level_is_capped(tmp_path):
    async with running_nsqd(tmp_path, max_deflate_level=4) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        resp = await conn.identify(feature_negotiation=True, deflate=True, deflate_level=9)
        assert (resp["deflate"], resp["deflate_level"], resp["max_deflate_level"]) == (True, 4, 4)


def pynsq_round_trip(daemon, topic, count=200, **conn_kwargs):
    """Publish with a pynsq Writer and consume with a Reader, both with conn_kwargs."""
    address = f"127.0.0.1:{daemon.port}"
    got, acks = [], []
    reader = nsq.Reader(topic=topic, channel="c", nsqd_tcp_addresses=[address], max_in_flight=50,
                        message_handler=lambda m: got.append(m.body) or True, lookupd_poll_interval=1,
                        **conn_kwargs)
    writer = nsq.Writer([address], **conn_kwargs)
    bodies = [b"%s-%04d" % (topic.encode(), i) for i in range(count)]

    def publish():
        for i in range(0, count, 50):
            writer.mpub(topic, bodies[i:i + 50], callback=lambda conn, data: acks.append(data))

    trio_loop_later(publish)
    run_loop(lambda: len(got) >= count)
    reader.close()
    return bodies, got, acks


def trio_loop_later(fn):
    import tornado.ioloop
    tornado.ioloop.IOLoop.current().call_later(0.5, fn)


@pytest.mark.parametrize("kwargs", [
    {"snappy": True},
    {"deflate": True, "deflate_level": 6},
    {"tls": True},
    {"tls": True, "snappy": True},
    {"tls": True, "deflate": True},
], ids=["snappy", "deflate", "tls", "tls+snappy", "tls+deflate"])
def test_pynsq_with_tls_and_compression(tmp_path, certs, kwargs):
    kwargs = dict(kwargs)
    args = []
    if kwargs.pop("tls", False):
        args = [f"--tls-cert={certs['tls_cert']}", f"--tls-key={certs['tls_key']}"]
        kwargs.update(tls_v1=True, tls_options={"ca_certs": certs["ca"]})
    daemon = Daemon(tmp_path / "d", *args)
    daemon.wait_ready_sync()
    try:
        bodies, got, acks = pynsq_round_trip(daemon, "parity", **kwargs)
        assert sorted(got) == bodies
        assert acks and all(a == b"OK" for a in acks)
    finally:
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(30) == 0


class AuthServer:
    """A real HTTP auth server on loopback answering nsqd's auth protocol."""

    def __init__(self, secrets: dict[str, dict]):
        self.secrets = secrets
        self.queries: list[str] = []
        #: every query's fields (common_name, remote_ip, secret, tls), as parse_qs gives them, and as sent
        self.forms: list[dict[str, list[str]]] = []
        self.raw_queries: list[str] = []
        self.port = 0

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream):
        conn = h11.Connection(h11.SERVER)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            if isinstance(event, h11.Request):
                target = event.target.decode()
            if isinstance(event, h11.EndOfMessage):
                break
        from urllib.parse import parse_qs, urlsplit
        self.raw_queries.append(urlsplit(target).query)
        query = parse_qs(urlsplit(target).query, keep_blank_values=True)
        secret = query["secret"][0]
        self.queries.append(secret)
        self.forms.append(query)
        reply = self.secrets.get(secret)
        status, body = (200, json.dumps(reply).encode()) if reply else (403, b'{"message":"NOT_AUTHORIZED"}')
        data = conn.send(h11.Response(status_code=status, headers=[("content-length", str(len(body)))]))
        data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        await stream.send_all(data)
        await stream.aclose()


def grant(topic, channels, permissions, ttl=3600):
    return {"ttl": ttl, "identity": "alice", "identity_url": "http://id/alice",
            "authorizations": [{"topic": topic, "channels": channels, "permissions": permissions}]}


async def test_auth_flow(tmp_path):
    server = AuthServer({"good": grant("^orders$", [".*"], ["subscribe", "publish"]),
                         "pub-only": grant("^orders$", [".*"], ["publish"])})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path, auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            conn = await NSQConnection.open(tcp_port(nsqd))
            resp = await conn.identify(feature_negotiation=True)
            assert resp["auth_required"] is True
            await conn.command("SUB orders c")
            await conn.expect_error("E_AUTH_FIRST AUTH required before SUB")

            bad = await NSQConnection.open(tcp_port(nsqd))
            await bad.command("AUTH", b"wrong")
            await bad.expect_error("E_AUTH_FAILED AUTH failed")
            await bad.expect_closed()

            ok = await NSQConnection.open(tcp_port(nsqd))
            await ok.command("AUTH", b"good")
            kind, data = await ok.read_frame()
            assert json.loads(data) == {"identity": "alice", "identity_url": "http://id/alice",
                                        "permission_count": 1}
            await ok.sub("orders", "c")
            await ok.pub("orders", b"x")
            await ok.command("PUB other", b"y")
            await ok.expect_error('E_UNAUTHORIZED AUTH failed for PUB on "other" ""')

            pub_only = await NSQConnection.open(tcp_port(nsqd))
            await pub_only.command("AUTH", b"pub-only")
            await pub_only.read_frame()
            await pub_only.pub("orders", b"z")
            await pub_only.command("SUB orders c")
            await pub_only.expect_error('E_UNAUTHORIZED AUTH failed for SUB on "orders" "c"')
            assert server.queries == ["wrong", "good", "pub-only"]
            nursery.cancel_scope.cancel()



async def test_the_auth_server_is_told_the_tls_client_certificates_common_name(tmp_path, ca, certs):
    """Go sends the client certificate's subject CN as common_name; it had always been empty,
    so an auth server that grants by certificate saw an anonymous client."""
    alice = ca.issue_cert("client.example", common_name="alice")
    context = client_tls_context(certs)
    alice.configure_cert(context)
    server = AuthServer({"s": grant("^t$", [".*"], ["publish"])})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path / "d", tls_cert=certs["tls_cert"], tls_key=certs["tls_key"],
                                tls_client_auth_policy="require-verify", tls_root_ca_file=certs["ca"],
                                auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            conn = await NSQConnection.open(tcp_port(nsqd))
            await conn.identify(feature_negotiation=True, tls_v1=True)
            conn.stream = trio.SSLStream(conn.stream, context, server_hostname="127.0.0.1")
            await conn.stream.do_handshake()
            await conn.expect_response(b"OK")
            await conn.command("AUTH", b"s")
            await conn.read_frame()
            await conn.pub("t", b"x")
            assert server.forms == [{"common_name": ["alice"], "remote_ip": ["127.0.0.1"], "secret": ["s"],
                                     "tls": ["true"]}]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("client_cert,error", [
    (None, "tls: client didn't provide a certificate"),
    ("stranger", "tls: failed to verify certificate: x509: certificate signed by unknown authority"),
])
async def test_a_refused_client_certificate_gets_gos_words(tmp_path, certs, client_cert, error):
    async with running_nsqd(tmp_path / "d", tls_cert=certs["tls_cert"], tls_key=certs["tls_key"],
                            tls_client_auth_policy="require-verify", tls_root_ca_file=certs["ca"]) as nsqd:
        context = client_tls_context(certs)
        if client_cert == "stranger":
            trustme.CA().issue_cert("client.example").configure_cert(context)
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.identify(feature_negotiation=True, tls_v1=True)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
        received = b""
        with trio.fail_after(5):
            while True:  # the handshake by hand: the refusal comes in plain text, after TLS records
                try:
                    tls.do_handshake()
                    tls.read(1)  # TLS 1.3: the server's verdict on our certificate comes after our finished
                except (ssl.SSLWantReadError, ssl.SSLError):
                    pass
                await conn.stream.send_all(outgoing.read())
                data = await conn.stream.receive_some(65536)
                if not data:
                    break
                received += data
                incoming.write(data)
        assert received.endswith(message.encode_error(f"E_IDENTIFY_FAILED IDENTIFY failed {error}".encode()))


@asynccontextmanager
async def nsqd_with_auth(tmp_path, secrets: dict[str, dict]):
    """An in-process daemon asking a real auth server (both yielded) about ``secrets``."""
    server = AuthServer(secrets)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path, auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            yield nsqd, server
        nursery.cancel_scope.cancel()


async def test_expired_auth_is_checked_again(tmp_path):
    server = AuthServer({"short": grant(".*", [".*"], ["publish", "subscribe"], ttl=1)})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path, auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            conn = await NSQConnection.open(tcp_port(nsqd))
            await conn.command("AUTH", b"short")
            await conn.read_frame()
            await conn.pub("t", b"1")
            assert server.queries == ["short"]
            await trio.sleep(1.1)
            await conn.pub("t", b"2")  # expired: asked again, then the PUB goes through
            assert server.queries == ["short", "short"]
            del server.secrets["short"]
            await trio.sleep(1.1)
            await conn.command("PUB t", b"3")
            await conn.expect_error("E_AUTH_FAILED AUTH failed")
            assert nsqd.topics["t"].message_count == 2
            nursery.cancel_scope.cancel()


async def test_a_refresh_without_authorizations_refuses_the_command_as_go_does(tmp_path):
    """Go stores the refreshed state and its check refuses the command; the text of the first
    AUTH's refusal ("no authorizations found") is for the first AUTH only."""
    async with nsqd_with_auth(tmp_path, {"short": grant(".*", [".*"], ["publish"], ttl=1)}) as (nsqd, server):
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("AUTH", b"short")
        await conn.read_frame()
        server.secrets["short"] = {"ttl": 1, "identity": "alice", "authorizations": []}
        await trio.sleep(1.1)
        await conn.command("PUB t", b"x")
        await conn.expect_error('E_UNAUTHORIZED AUTH failed for PUB on "t" ""')
        await conn.expect_closed()
        assert "t" not in nsqd.topics  # refused before the topic was made


async def test_a_secret_that_is_not_utf8_reaches_the_auth_server_as_it_came(tmp_path):
    async with nsqd_with_auth(tmp_path, {}) as (nsqd, server):
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("AUTH", b"sec\xffret")
        await conn.expect_error("E_AUTH_FAILED AUTH failed")
        assert server.raw_queries == ["common_name=&remote_ip=127.0.0.1&secret=sec%FFret&tls=false"]


@pytest.mark.parametrize("line,body,before_sub", [
    (b"AUTH\n", b"", "E_BAD_BODY AUTH invalid body size 0"),
    (b"AUTH x\n", b"secret", "E_INVALID AUTH invalid number of parameters"),
    (b"AUTH\n", b"secret", "E_AUTH_DISABLED AUTH disabled"),
])
async def test_auth_in_a_wrong_state_is_refused_before_its_line_or_body_is_looked_at(tmp_path, line, body, before_sub):
    """nsqd checks AUTH's state first: after SUB every AUTH gets the state error, however malformed."""
    import struct

    frame = line + struct.pack(">i", len(body)) + body
    async with running_nsqd(tmp_path) as nsqd:
        fresh = await NSQConnection.open(tcp_port(nsqd))
        await fresh.send(frame)
        await fresh.expect_error(before_sub)
        subscribed = await NSQConnection.open(tcp_port(nsqd))
        await subscribed.sub("t", "c")
        await subscribed.send(frame)
        await subscribed.expect_error("E_INVALID cannot AUTH in current state")
        await subscribed.expect_closed()


def test_auth_decisions_follow_nsqd():
    from nsqd.auth import AuthError, parse_reply
    state = parse_reply(json.dumps(grant("^a", ["^c$"], ["subscribe"])).encode(), now=0)
    assert state.allows("ab", "c") and not state.allows("ab", "cd") and not state.allows("ba", "c")
    assert not state.allows("ab")  # no publish permission
    with pytest.raises(AuthError, match="unknown permission"):
        parse_reply(json.dumps(grant("a", [], ["admin"])).encode(), now=0)
    with pytest.raises(AuthError, match="invalid TTL"):
        parse_reply(json.dumps(grant("a", [], ["publish"], ttl=0)).encode(), now=0)
    # RE2's syntax, as Go's regexp: a backreference is no pattern there, so the reply is unusable
    with pytest.raises(AuthError, match="invalid escape sequence"):
        parse_reply(json.dumps(grant("(a)\\1", [".*"], ["publish"])).encode(), now=0)
    with pytest.raises(AuthError, match="not a string"):
        parse_reply(json.dumps(grant(5, [".*"], ["publish"])).encode(), now=0)


@pytest.mark.parametrize("ttl", ["Infinity", "1e400", "1" + "0" * 400, '"10"', "3.5", "true"])
def test_an_auth_ttl_that_is_no_go_integer_is_an_invalid_reply(ttl):
    """Infinity and 10**400 raised OverflowError out of the parser: the client was dropped with no
    answer (over HTTP, no response at all) and the other auth servers were never tried."""
    from nsqd.auth import AuthError, parse_reply
    body = json.dumps(grant("a", [".*"], ["publish"])).replace('"ttl": 3600', f'"ttl": {ttl}')
    assert f'"ttl": {ttl}' in body
    with pytest.raises(AuthError, match="invalid auth reply"):
        parse_reply(body.encode(), now=0)


def test_an_auth_reply_holds_at_most_1024_patterns_each_compiled_once():
    """250,000 entries in a 1 MB reply held the event loop for 4 s (and each publish walked them)."""
    from nsqd.auth import MAX_PATTERNS, AuthError, parse_reply
    many = {"ttl": 60, "authorizations": [{"topic": "^t$", "channels": [".*"], "permissions": ["publish"]}] * 512}
    state = parse_reply(json.dumps(many).encode(), now=0)
    assert len({id(a.topic) for a in state.authorizations}) == 1  # one text, one compiled pattern
    many["authorizations"].append({"topic": "x", "permissions": ["publish"]})
    with pytest.raises(AuthError, match=f"more than {MAX_PATTERNS}"):
        parse_reply(json.dumps(many).encode(), now=0)


@pytest.mark.parametrize("field, value", [
    ("channels", "."), ("channels", "xq"), ("channels", [1]), ("permissions", {"publish": False}),
    ("permissions", "publish"), ("topic", ["a"]), ("identity", {"x": 1}), ("identity_url", 7),
    ("authorizations", {"topic": "a"}), ("authorizations", [None]), ("authorizations", ["a"]),
])
def test_an_auth_reply_of_the_wrong_types_is_refused_whole_as_go_decodes_it(field, value):
    """A string where Go wants an array made each character a pattern (``"."``: any channel), a
    map of permissions gave its keys (``{"publish": false}``: publish)."""
    from nsqd.auth import AuthError, parse_reply
    reply = {"ttl": 60, "identity": "i", "authorizations": [{"topic": ".*", "channels": ["^c$"],
                                                             "permissions": ["subscribe"]}]}
    target = reply if field in ("identity", "identity_url", "authorizations") else reply["authorizations"][0]
    target[field] = value
    with pytest.raises(AuthError, match="invalid auth reply"):
        parse_reply(json.dumps(reply).encode(), now=0)
    nulls = {"ttl": 60, "identity": None, "authorizations": [{"topic": None, "channels": None,
                                                             "permissions": ["publish"]}]}
    state = parse_reply(json.dumps(nulls).encode(), now=0)  # null is Go's zero value
    assert state.identity == "" and not state.allows("t")  # (no channel pattern: nothing matches)


def test_auth_patterns_that_cost_too_much_to_compile_are_refused_fast():
    """``\\pL{300}\\pN{300}``: 25 bytes of reply took 0.24 s and up to 10 MB to compile; 200 of
    them held the event loop for 48 s and grew the daemon by 600 MB."""
    from nsqd.auth import AuthError, parse_reply
    one = {"ttl": 60, "authorizations": [{"topic": "\\pL{300}\\pN{300}", "permissions": ["publish"]}]}
    started = time.perf_counter()
    with pytest.raises(AuthError, match="pattern too large"):
        parse_reply(json.dumps(one).encode(), now=0)
    costly = {"ttl": 60, "authorizations": [{"topic": "\\pL{40}\\pN{40}%d" % i, "permissions": ["publish"]}
                                            for i in range(200)]}
    with pytest.raises(AuthError, match="take more than"):
        parse_reply(json.dumps(costly).encode(), now=0)
    assert time.perf_counter() - started < 2


def test_auth_patterns_match_in_linear_time():
    """Python's re backtracks: this pattern and a 28-letter topic held the event loop 8 s, and
    each letter more doubles that. The decision runs in a subprocess, so a regression fails by
    its timeout instead of hanging the test run."""
    code = (
        "import json; from nsqd.auth import parse_reply; "
        "state = parse_reply(json.dumps({'ttl': 60, 'authorizations': [{'topic': r'^([a-z]+_?)+\\.log$', "
        "'channels': ['.*'], 'permissions': ['publish']}]}).encode(), now=0); "
        "print(state.allows('a' * 64), state.allows('abc_def.log'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert done.stdout.split() == ["False", "True"], done.stderr


async def test_e2e_processing_latency_in_stats(tmp_path):
    from nsqd import stats

    async with running_nsqd(tmp_path, e2e_processing_latency_percentiles=[0.99, 0.5]) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.mpub("t", [b"%d" % i for i in range(20)])
        await trio.sleep(0.2)  # every message is at least 200 ms old when finished
        await conn.command("RDY 20")
        for _ in range(20):
            msg = await conn.read_message()
            await conn.command(b"FIN " + msg.id)
        await conn.command("NOP")
        with trio.fail_after(2):
            while nsqd.topics["t"].channels["c"].in_flight_count:
                await trio.sleep(0.01)
        doc = json.loads(stats.render_json(stats.snapshot(nsqd)))
        channel = doc["topics"][0]["channels"][0]["e2e_processing_latency"]
        assert channel["count"] == 20
        assert [p["quantile"] for p in channel["percentiles"]] == [0.99, 0.5]
        assert all(0.2e9 <= p["value"] < 5e9 for p in channel["percentiles"])
        assert doc["topics"][0]["e2e_processing_latency"]["count"] == 20
        assert b"e2e%: 2" in stats.render_text(stats.snapshot(nsqd))


async def test_statsd_receives_nsqd_metric_names(tmp_path):
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    async with running_nsqd(tmp_path, statsd_address=f"127.0.0.1:{port}", statsd_interval=0.2,
                            statsd_prefix="nsq.%s", broadcast_address="node.local",
                            broadcast_http_port=4151) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.mpub("t", [b"a", b"b", b"c"])
        expected = {"nsq.node_local_4151.topic.t.message_count:3|c",
                    "nsq.node_local_4151.topic.t.channel.c.depth:3|g",
                    "nsq.node_local_4151.topic.t.channel.c.clients:1|g"}
        lines = set()
        with trio.fail_after(3):
            while not expected <= lines:
                lines.update((await sock.recv(65536)).decode().splitlines())
        later = set()
        with trio.fail_after(3):
            while not any(l.startswith("nsq.node_local_4151.topic.t.message_count:") for l in later):
                later.update((await sock.recv(65536)).decode().splitlines())
        assert "nsq.node_local_4151.topic.t.message_count:0|c" in later  # counters send the change
    sock.close()


async def test_statsd_over_ipv6_and_an_unresolvable_statsd_leave_the_daemon_running(tmp_path):
    """The socket was IPv4 only and connected once, outside any error handling: either address
    ended the daemon (exit 1) after it was already listening."""
    sock = trio.socket.socket(trio.socket.AF_INET6, trio.socket.SOCK_DGRAM)
    await sock.bind(("::1", 0))
    port = sock.getsockname()[1]
    async with running_nsqd(tmp_path / "a", statsd_address=f"[::1]:{port}", statsd_interval=0.2) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.pub("t", b"x")
        with trio.fail_after(3):
            while b"topic.t.message_count:1|c" not in await sock.recv(65536):
                pass
    sock.close()
    async with running_nsqd(tmp_path / "b", statsd_address="no-such-host.invalid:8125", statsd_interval=0.1) as nsqd:
        await trio.sleep(0.5)  # a few intervals, each failing to resolve
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.pub("t", b"still here")


def test_statsd_packets_respect_the_size():
    from nsqd.statsd import packets
    lines = [f"metric.{i}:{i}|g" for i in range(100)]
    datagrams = packets(lines, 100)
    assert all(len(d) <= 100 for d in datagrams)
    assert b"".join(datagrams).decode().splitlines() == lines


async def test_http_publish_and_admin_need_a_secret_when_auth_is_on(tmp_path):
    from .conftest import HTTPClient

    server = AuthServer({"pub": grant("^t$", [".*"], ["publish"]),
                         "admin": grant("^t$", [".*"], ["publish", "subscribe"])})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with running_nsqd(tmp_path, http_address="127.0.0.1:0",
                                auth_http_addresses=[f"127.0.0.1:{server.port}"]) as nsqd:
            http = HTTPClient(nsqd.http_addresses[0][1])
            bearer = lambda s: (("authorization", f"Bearer {s}"),)
            assert (await http.request("GET", "/ping")).status == 200
            assert (await http.request("POST", "/pub?topic=t", b"x")).json() == {"message": "AUTH_REQUIRED"}
            assert (await http.request("POST", "/pub?topic=t", b"x", headers=bearer("nope"))).status == 401
            assert (await http.request("POST", "/pub?topic=t", b"x", headers=bearer("pub"))).status == 200
            assert (await http.request("POST", "/pub?topic=u", b"x", headers=bearer("pub"))).status == 403
            # the handler acts on the first value of a repeated parameter (Go's ReqParams.Get): so does auth
            assert (await http.request("POST", "/pub?topic=u&topic=t", b"x", headers=bearer("pub"))).status == 403
            assert "u" not in nsqd.topics
            resp = await http.request("POST", "/topic/empty?topic=t", headers=bearer("pub"))
            assert (resp.status, resp.json()) == (403, {"message": "AUTH_UNAUTHORIZED"})
            assert (await http.request("POST", "/topic/empty?topic=t", headers=bearer("admin"))).status == 200
            assert server.queries == ["nope", "pub", "admin"]  # answers are cached until they expire
            # ... for the address and TLS they were given to: the auth server may answer each its own way
            other = HTTPClient(nsqd.http_addresses[0][1], local_address="127.0.0.2")
            assert (await other.request("POST", "/pub?topic=t", b"x", headers=bearer("pub"))).status == 200
            assert server.queries == ["nope", "pub", "admin", "pub"]
            # a redrive publishes to its "to" topic: that needs publish permission there too
            resp = await http.request("POST", "/topic/redrive?topic=t&to=u", headers=bearer("admin"))
            assert (resp.status, resp.json()) == (403, {"message": "AUTH_UNAUTHORIZED"})
            assert "u" not in nsqd.topics
            # a query that does not parse gets its answer (the connection was dropped without one)
            resp = await http.request("POST", "/pub?topic=t;x=1", b"x", headers=bearer("pub"))
            assert (resp.status, resp.json()) == (400, {"message": "INVALID_REQUEST"})
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("upgrade", ["tls_v1", "snappy", "deflate"])
async def test_commands_sent_behind_an_upgrading_identify_are_dropped_as_nsqd_does(tmp_path, certs, upgrade):
    """Bytes pipelined behind the IDENTIFY belong to the stream before its upgrade: never run as
    commands (behind --tls-required they would be plaintext)."""
    async with running_nsqd(tmp_path / "d", tls_cert=certs["tls_cert"], tls_key=certs["tls_key"],
                            tls_required=1 if upgrade == "tls_v1" else 0) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        identify = json.dumps({"feature_negotiation": True, upgrade: True}).encode()
        await conn.send(b"IDENTIFY\n" + len(identify).to_bytes(4, "big") + identify
                        + b"PUB sneaked\n" + (5).to_bytes(4, "big") + b"plain")
        kind, data = await conn.read_frame()
        assert kind == FRAME_RESPONSE and json.loads(data)[upgrade] is True
        if upgrade == "tls_v1":
            conn.stream = trio.SSLStream(conn.stream, client_tls_context(certs), server_hostname="127.0.0.1")
            await conn.stream.do_handshake()
            await conn.expect_response(b"OK")
            await conn.pub("t", b"over tls")  # the refusal the dropped PUB met does not linger
            assert nsqd.topics["t"].message_count == 1
        else:  # the OK comes compressed: any bytes after the response say the upgrade is done
            with trio.fail_after(5):
                assert conn._buf or await conn.stream.receive_some(100)
            await trio.sleep(0.1)
        assert "sneaked" not in nsqd.topics


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 100 Continue\r\n\r\n" * 100,
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\n{\r\n" * 40_000,
], ids=["endless 100 Continue", "1-byte chunks"])
async def test_an_auth_server_cannot_make_the_daemon_take_endless_events(reply):
    """Each event is Python work: informational answers are capped, and each chunk costs 64 bytes
    of the 1 MiB a reply may hold (40,000 one-byte chunks are over it)."""
    from nsqd import http_client

    ours, theirs = trio.testing.memory_stream_pair()
    await theirs.send_all(reply)
    with pytest.raises(http_client.ResponseError):
        with trio.fail_after(5):
            await http_client.exchange(ours, "GET", "/auth", [("Host", "x")])


async def tls_client_stats(nsqd, certs, maximum=None, ciphers=None) -> dict:
    conn = await NSQConnection.open(tcp_port(nsqd))
    await conn.command("IDENTIFY", json.dumps({"feature_negotiation": True, "tls_v1": True}).encode())
    await conn.read_frame()
    context = client_tls_context(certs)
    if maximum is not None:
        context.maximum_version = maximum
    if ciphers is not None:
        context.set_ciphers(ciphers)
    conn.stream = trio.SSLStream(conn.stream, context, server_hostname="127.0.0.1")
    await conn.stream.do_handshake()
    await conn.expect_response(b"OK")
    await conn.sub("t", "c")
    from nsqd import stats

    (client,) = [c for c in stats.snapshot(nsqd).topics[0].channels[0].clients]
    await conn.close()
    return {key: getattr(client, key) for key in (
        "tls_version", "tls_cipher_suite", "tls_negotiated_protocol", "tls_negotiated_protocol_is_mutual")}


async def test_tls_clients_in_stats_are_named_as_go_names_them(tmp_path, certs):
    """Go's /stats says TLS1.2 / TLS1.3, the IANA name of the suites it knows, else "Unknown <number>"."""
    async with running_nsqd(tmp_path / "d", tls_cert=certs["tls_cert"], tls_key=certs["tls_key"]) as nsqd:
        described = await tls_client_stats(nsqd, certs)
        assert described == {"tls_version": "TLS1.3", "tls_cipher_suite": "Unknown 4866",  # TLS_AES_256_GCM_SHA384
                             "tls_negotiated_protocol": "", "tls_negotiated_protocol_is_mutual": True}
        nsqd.topics["t"].delete_channel("c")
        described = await tls_client_stats(nsqd, certs, maximum=ssl.TLSVersion.TLSv1_2,
                                           ciphers="ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256")
        assert described["tls_version"] == "TLS1.2"
        assert described["tls_cipher_suite"] in ("TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
                                                 "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256")


async def test_a_tls_upgrade_that_gets_no_handshake_is_answered_e_identify_failed_in_plain_text(tmp_path, certs):
    async with running_nsqd(tmp_path / "d", tls_cert=certs["tls_cert"], tls_key=certs["tls_key"]) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("IDENTIFY", json.dumps({"feature_negotiation": True, "tls_v1": True}).encode())
        await conn.read_frame()
        await conn.command("NOP\nNOP")  # not a TLS ClientHello
        await conn.expect_error("E_IDENTIFY_FAILED IDENTIFY failed tls: first record does not look like a TLS handshake")
        await conn.expect_closed()
        await conn.close()
        conn = await NSQConnection.open(tcp_port(nsqd))  # the daemon serves on
        await conn.pub("t", b"x")
