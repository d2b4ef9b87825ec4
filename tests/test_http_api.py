"""The HTTP API over real HTTP against the daemon running in-process.

Expected statuses, messages and JSON keys are Go nsqd 1.3's (nsqd/http.go,
nsqd/stats.go, nsqd/http_test.go).
"""

import atexit
import json
import shutil
import time

import pytest
import structlog
import trio

from nsqd.channel import ChannelExiting
from nsqd.cli import configure_logging
from nsqd.diskq import DiskQueueWriteError
from nsqd.options import Options
from nsqd.subscription import Budget

from .conftest import http_port
from .support import NSQConnection, mpub_body, tcp_port

# small limits so the "too big" cases are cheap to provoke
SMALL = {"max_msg_size": 16, "max_body_size": 64, "max_req_timeout": 10.0}

V1 = ("x-nsq-content-type", "nsq; version=1.0")
JSON_TYPE = "application/json; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"

TOP_KEYS = {"version", "health", "start_time", "topics", "memory", "producers"}
TOPIC_KEYS = {"topic_name", "channels", "depth", "backend_depth", "message_count", "message_bytes",
              "paused", "e2e_processing_latency"}
CHANNEL_KEYS = {"channel_name", "depth", "backend_depth", "in_flight_count", "deferred_count",
                "message_count", "requeue_count", "timeout_count", "client_count", "clients", "paused",
                "e2e_processing_latency"}
CLIENT_KEYS = {"client_id", "hostname", "version", "remote_address", "state", "ready_count",
               "in_flight_count", "message_count", "finish_count", "requeue_count", "connect_ts",
               "sample_rate", "deflate", "snappy", "user_agent", "topology_zone", "topology_region", "tls",
               "tls_cipher_suite", "tls_version", "tls_negotiated_protocol",
               "tls_negotiated_protocol_is_mutual"}


async def stats(http, query=""):
    response = await http.get(f"/stats?format=json{query}")
    assert response.status == 200
    assert response.headers["content-type"] == JSON_TYPE
    return response.json()


def topic_of(doc, name):
    return next(t for t in doc["topics"] if t["topic_name"] == name)


def channel_of(doc, topic, name):
    return next(c for c in topic_of(doc, topic)["channels"] if c["channel_name"] == name)


def assert_ok_empty(response):
    """Go's V1 answer to a successful admin POST: 200, no body, the V1 header."""
    assert (response.status, response.body) == (200, b"")
    assert response.headers[V1[0]] == V1[1]
    assert "content-type" not in response.headers


def assert_error(response, status, message):
    assert (response.status, response.body) == (status, json.dumps({"message": message}, separators=(",", ":")).encode())
    assert response.headers["content-type"] == JSON_TYPE
    assert response.headers[V1[0]] == V1[1]


async def wait_for_metadata(nsqd, predicate):
    """The metadata file as soon as it satisfies ``predicate`` (it is written asynchronously)."""
    path = nsqd.data_path / "nsqd.dat"
    with trio.fail_after(5):
        while True:
            if path.exists():
                data = json.loads(path.read_bytes())
                if predicate(data):
                    return data
            await trio.sleep(0.01)


# ------------------------------------------------------------------ basics


async def test_ping_answers_plain_ok(http):
    response = await http.get("/ping")
    assert (response.status, response.body) == (200, b"OK")
    assert response.headers["content-type"] == TEXT_TYPE
    assert V1[0] not in response.headers


async def test_ping_reports_unhealthy_with_500_and_the_health_text(nsqd_server, http):
    nsqd_server.storage_error = "failed to write to disk"
    response = await http.get("/ping")
    assert (response.status, response.body) == (500, b"NOK - failed to write to disk")
    assert response.headers["content-type"] == TEXT_TYPE


async def test_info_matches_go_fields_and_real_ports(nsqd_server, http):
    response = await http.get("/info")
    assert response.status == 200
    assert response.headers["content-type"] == JSON_TYPE
    assert response.headers[V1[0]] == V1[1]
    info = response.json()
    assert list(info) == ["version", "broadcast_address", "hostname", "http_port", "tcp_port", "start_time",
                          "max_heartbeat_interval", "max_output_buffer_size", "max_output_buffer_timeout",
                          "max_deflate_level", "topology_zone", "topology_region"]
    assert info["version"] == "1.3.0"
    assert info["http_port"] == http_port(nsqd_server)
    assert info["tcp_port"] == tcp_port(nsqd_server)
    assert info["start_time"] == int(nsqd_server.start_time)
    assert info["broadcast_address"] == nsqd_server.options.broadcast_address
    assert info["max_heartbeat_interval"] == 60_000_000_000
    assert info["max_output_buffer_timeout"] == 30_000_000_000
    assert (info["max_output_buffer_size"], info["max_deflate_level"]) == (65536, 6)


async def test_unknown_path_is_404_json(http):
    assert_error(await http.get("/nope"), 404, "NOT_FOUND")
    assert_error(await http.get("/config/"), 404, "NOT_FOUND")
    assert_error(await http.get("/config/a/b"), 404, "NOT_FOUND")


@pytest.mark.parametrize("method,path,allow", [
    ("POST", "/stats", "GET, OPTIONS"),
    ("GET", "/pub", "OPTIONS, POST"),
    ("DELETE", "/topic/create", "OPTIONS, POST"),
    ("POST", "/config/log_level", "GET, OPTIONS, PUT"),
    ("HEAD", "/ping", "GET, OPTIONS"),
])
async def test_wrong_method_is_405_with_allow(http, method, path, allow):
    response = await http.request(method, path)
    assert response.status == 405
    assert response.headers["allow"] == allow
    if method != "HEAD":
        assert_error(response, 405, "METHOD_NOT_ALLOWED")


async def test_options_lists_allowed_methods(http):
    response = await http.request("OPTIONS", "/mpub")
    assert (response.status, response.body, response.headers["allow"]) == (200, b"", "OPTIONS, POST")


def _server_certs() -> dict:
    """A certificate for 127.0.0.1 signed by a throwaway CA, written to a temp dir."""
    import tempfile

    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    folder = tempfile.mkdtemp(prefix="nsqd-http-tls-")
    atexit.register(shutil.rmtree, folder, True)  # made at import: removed when the test run ends
    paths = {name: f"{folder}/{name}.pem" for name in ("cert", "key", "ca")}
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    ca.cert_pem.write_to_path(paths["ca"])
    return paths


CERTS = _server_certs()


@pytest.mark.parametrize("nsqd_server", [{"tls_required": 2, "https_address": "127.0.0.1:0",
                                          "tls_cert": CERTS["cert"], "tls_key": CERTS["key"]}], indirect=True)
async def test_tls_required_refuses_plain_http_and_https_serves(http, nsqd_server):
    response = await http.get("/ping")
    https_port = nsqd_server.https_addresses[0][1]
    assert response.status == 403
    assert response.body == b'{"message": "TLS_REQUIRED", "https_port": %d}' % https_port
    assert response.headers[V1[0]] == V1[1]
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=CERTS["ca"])
    body = await trio.to_thread.run_sync(
        lambda: urllib.request.urlopen(f"https://127.0.0.1:{https_port}/ping", context=context).read())
    assert body == b"OK"


# ---------------------------------------------------------------- publish


async def test_pub_then_stats_counts_it(http):
    response = await http.post("/pub?topic=t", b"hello")
    assert (response.status, response.body) == (200, b"OK")
    assert response.headers[V1[0]] == V1[1]
    topic = topic_of(await stats(http), "t")
    assert (topic["depth"], topic["message_count"], topic["message_bytes"]) == (1, 1, 5)


async def test_mpub_newline_separated_skips_empty_lines(http):
    response = await http.post("/mpub?topic=t", b"one\ntwo\n\n\nthree\n")
    assert (response.status, response.body) == (200, b"OK")
    topic = topic_of(await stats(http), "t")
    assert (topic["depth"], topic["message_count"], topic["message_bytes"]) == (3, 3, 11)


async def test_mpub_only_empty_lines_publishes_nothing(http):
    assert (await http.post("/mpub?topic=t", b"\n\n")).body == b"OK"
    topic = topic_of(await stats(http), "t")
    assert (topic["depth"], topic["message_count"]) == (0, 0)


@pytest.mark.parametrize("binary", ["true", "1", "legacy-value"])
async def test_mpub_binary(http, binary):
    body = mpub_body([b"a", b"with\nnewline", b"c"])
    response = await http.post(f"/mpub?topic=t&binary={binary}", body)
    assert (response.status, response.body) == (200, b"OK")
    topic = topic_of(await stats(http), "t")
    assert (topic["depth"], topic["message_count"], topic["message_bytes"]) == (3, 3, 14)


async def test_mpub_binary_false_is_newline_mode(http):
    assert (await http.post("/mpub?topic=t&binary=false", b"a\nb")).body == b"OK"
    assert topic_of(await stats(http), "t")["depth"] == 2


async def test_pub_defer_holds_the_message_as_deferred(http):
    assert_ok_empty(await http.post("/topic/create?topic=t"))
    assert_ok_empty(await http.post("/channel/create?topic=t&channel=c"))
    assert (await http.post("/pub?topic=t&defer=5000", b"later")).body == b"OK"
    assert (await http.post("/pub?topic=t&defer=0", b"now")).body == b"OK"
    # Go's Duration(defer) * Millisecond wraps past int64: this is 384µs, in range
    assert (await http.post("/pub?topic=t&defer=18446744073709552", b"soon")).body == b"OK"
    channel = channel_of(await stats(http), "t", "c")
    assert (channel["message_count"], channel["deferred_count"] + channel["depth"]) == (3, 3)


async def test_chunked_body_is_read(http):
    assert (await http.post("/pub?topic=t", b"chunky", chunked=True)).body == b"OK"
    assert topic_of(await stats(http), "t")["message_bytes"] == 6


async def test_http_publish_is_delivered_over_tcp(nsqd_server, http):
    before = time.time_ns()
    assert (await http.post("/pub?topic=e2e", b"over http")).body == b"OK"
    conn = await NSQConnection.open(tcp_port(nsqd_server))
    try:
        await conn.command("SUB e2e c")
        await conn.expect_response(b"OK")
        await conn.command("RDY 1")
        msg = await conn.read_message()
    finally:
        await conn.close()
    assert msg.body == b"over http"
    assert msg.attempts == 1
    assert len(msg.id) == 16 and all(c in b"0123456789abcdef" for c in msg.id)
    assert before <= msg.timestamp <= time.time_ns()


# ----------------------------------------------------------------- errors

ERRORS = [
    # /pub: body checks first, then the topic, then defer
    ("/pub", b"x", 400, "MISSING_ARG_TOPIC"),
    ("/pub?topic=", b"x", 400, "INVALID_TOPIC"),
    ("/pub?topic=bad!name", b"x", 400, "INVALID_TOPIC"),
    ("/pub?topic=" + "t" * 65, b"x", 400, "INVALID_TOPIC"),
    ("/pub?topic=t", b"", 400, "MSG_EMPTY"),
    ("/pub", b"", 400, "MSG_EMPTY"),
    ("/pub?topic=t", b"x" * 17, 413, "MSG_TOO_BIG"),
    ("/pub?topic=t&defer=x", b"x", 400, "INVALID_DEFER"),
    ("/pub?topic=t&defer=", b"x", 400, "INVALID_DEFER"),
    ("/pub?topic=t&defer=1.5", b"x", 400, "INVALID_DEFER"),
    ("/pub?topic=t&defer=-1", b"x", 400, "INVALID_DEFER"),
    ("/pub?topic=t&defer=10001", b"x", 400, "INVALID_DEFER"),
    ("/pub?topic=t%zz", b"x", 400, "INVALID_REQUEST"),
    ("/pub?topic=t;x=1", b"x", 400, "INVALID_REQUEST"),
    # /mpub: size by Content-Length, then the topic, then the body
    ("/mpub", b"x", 400, "MISSING_ARG_TOPIC"),
    ("/mpub?topic=a+b", b"x", 400, "INVALID_TOPIC"),
    ("/mpub?topic=t", b"x" * 65, 413, "BODY_TOO_BIG"),
    ("/mpub", b"x" * 65, 413, "BODY_TOO_BIG"),
    ("/mpub?topic=t", b"ok\n" + b"x" * 17, 413, "MSG_TOO_BIG"),
    ("/mpub?topic=t&binary=true", b"", 413, "BAD_BODY"),
    ("/mpub?topic=t&binary=true", b"\x00\x00\x00\x00", 413, "BAD_BODY"),
    ("/mpub?topic=t&binary=true", mpub_body([b"a"]) + b"junk", 413, "BAD_BODY"),
    ("/mpub?topic=t&binary=true", mpub_body([b"x" * 17]), 413, "BAD_MESSAGE"),
    ("/mpub?topic=t&binary=true", mpub_body([b"abc"])[:-1], 413, "BAD_MESSAGE"),
    # topic admin
    ("/topic/create", b"", 400, "MISSING_ARG_TOPIC"),
    ("/topic/create?topic=no/slash", b"", 400, "INVALID_TOPIC"),
    ("/topic/delete", b"", 400, "MISSING_ARG_TOPIC"),
    ("/topic/delete?topic=missing", b"", 404, "TOPIC_NOT_FOUND"),
    ("/topic/empty", b"", 400, "MISSING_ARG_TOPIC"),
    ("/topic/empty?topic=bad!", b"", 400, "INVALID_TOPIC"),
    ("/topic/empty?topic=missing", b"", 404, "TOPIC_NOT_FOUND"),
    ("/topic/pause", b"", 400, "MISSING_ARG_TOPIC"),
    ("/topic/pause?topic=missing", b"", 404, "TOPIC_NOT_FOUND"),
    ("/topic/unpause?topic=missing", b"", 404, "TOPIC_NOT_FOUND"),
    # channel admin
    ("/channel/create", b"", 400, "MISSING_ARG_TOPIC"),
    ("/channel/create?topic=bad!", b"", 400, "INVALID_ARG_TOPIC"),
    ("/channel/create?topic=t", b"", 400, "MISSING_ARG_CHANNEL"),
    ("/channel/create?topic=t&channel=bad!", b"", 400, "INVALID_ARG_CHANNEL"),
    ("/channel/create?topic=missing&channel=c", b"", 404, "TOPIC_NOT_FOUND"),
    ("/channel/delete?topic=missing&channel=c", b"", 404, "TOPIC_NOT_FOUND"),
    ("/channel/empty?topic=t", b"", 400, "MISSING_ARG_CHANNEL"),
    ("/channel/pause?topic=t&channel=", b"", 400, "INVALID_ARG_CHANNEL"),
    ("/channel/unpause?topic=%", b"", 400, "INVALID_REQUEST"),
    # Go's regexp $ is the end of the text: a trailing newline is not a valid name
    ("/topic/create?topic=t%0A", b"", 400, "INVALID_TOPIC"),
    ("/pub?topic=t%0A", b"x", 400, "INVALID_TOPIC"),
    ("/channel/create?topic=t%0A&channel=c", b"", 400, "INVALID_ARG_TOPIC"),
    ("/channel/create?topic=t&channel=c%0A", b"", 400, "INVALID_ARG_CHANNEL"),
]


@pytest.mark.parametrize("nsqd_server", [SMALL], indirect=True)
@pytest.mark.parametrize("target,body,status,message", ERRORS)
async def test_bad_requests_get_go_status_and_message(nsqd_server, http, target, body, status, message):
    assert_error(await http.post(target, body), status, message)
    # a rejected publish or admin request creates nothing
    assert list(nsqd_server.topics) == []


@pytest.mark.parametrize("nsqd_server", [SMALL], indirect=True)
@pytest.mark.parametrize("target,body,message", [
    ("/pub?topic=t", b"x" * 17, "MSG_TOO_BIG"),
    ("/mpub?topic=t", b"x" * 65, "BODY_TOO_BIG"),
    ("/mpub?topic=t&binary=true", b"x" * 65, "BODY_TOO_BIG"),
])
async def test_too_big_without_content_length_is_caught_while_reading(http, target, body, message):
    assert_error(await http.post(target, body, chunked=True), 413, message)


@pytest.mark.parametrize("nsqd_server", [SMALL], indirect=True)
@pytest.mark.parametrize("target,message", [("/pub?topic=t", b"MSG_TOO_BIG"), ("/mpub?topic=t", b"BODY_TOO_BIG")])
async def test_declared_too_big_is_refused_before_the_body_arrives(nsqd_server, target, message):
    """A Content-Length over the limit is answered at once; the body is never awaited."""
    async with await trio.open_tcp_stream("127.0.0.1", http_port(nsqd_server)) as stream:
        await stream.send_all(f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n".encode())
        answer = b""
        with trio.fail_after(5):
            while b"}" not in answer:
                answer += await stream.receive_some(4096)
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert answer.endswith(b'{"message":"' + message + b'"}')


async def test_client_leaving_mid_body_publishes_nothing(nsqd_server, http):
    with structlog.testing.capture_logs() as logs:
        async with await trio.open_tcp_stream("127.0.0.1", http_port(nsqd_server)) as stream:
            await stream.send_all(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\npartial")
            await trio.sleep(0.05)
        assert (await http.get("/ping")).body == b"OK"
    assert list(nsqd_server.topics) == []
    assert not [entry for entry in logs if entry["log_level"] in ("error", "critical")]


@pytest.mark.parametrize("nsqd_server", [SMALL], indirect=True)
async def test_limits_are_inclusive(http):
    assert (await http.post("/pub?topic=t", b"x" * 16)).body == b"OK"
    assert (await http.post("/mpub?topic=t", (b"x" * 15 + b"\n") * 4)).body == b"OK"
    assert (await http.post("/pub?topic=t&defer=10000", b"x")).body == b"OK"
    assert topic_of(await stats(http), "t")["message_count"] == 6


async def test_channel_not_found(http):
    assert_ok_empty(await http.post("/topic/create?topic=t"))
    for action in ("delete", "empty", "pause", "unpause"):
        assert_error(await http.post(f"/channel/{action}?topic=t&channel=nope"), 404, "CHANNEL_NOT_FOUND")


async def test_a_consumer_whose_messages_an_empty_dropped_gets_the_next_at_once(nsqd_server, http):
    """/channel/empty drops the messages in flight too (as nsqd's Empty): a consumer whose RDY
    they filled has room again and gets the next message, not at its next heartbeat (30 s)."""
    publisher = await NSQConnection.open(tcp_port(nsqd_server))
    consumer = await NSQConnection.open(tcp_port(nsqd_server))
    await consumer.sub("t", "c")
    await consumer.command("RDY 2")
    await publisher.mpub("t", [b"1", b"2"])
    [await consumer.read_message() for _ in range(2)]
    assert_ok_empty(await http.post("/channel/empty?topic=t&channel=c"))
    await publisher.pub("t", b"3")
    assert (await consumer.read_message(timeout=3)).body == b"3"

async def test_handler_exception_becomes_logged_json_500(nsqd_server, http):
    assert_ok_empty(await http.post("/topic/create?topic=t"))

    def broken():
        raise ValueError("boom")

    nsqd_server.topics["t"].empty = broken
    with structlog.testing.capture_logs() as logs:
        response = await http.post("/topic/empty?topic=t")
    assert_error(response, 500, "INTERNAL_ERROR")
    failure = next(entry for entry in logs if entry["event"] == "HTTP handler failed")
    assert failure["log_level"] == "error" and failure["uri"] == "/topic/empty?topic=t"
    assert (await http.get("/ping")).body == b"OK"  # the server carries on


async def test_publish_the_disk_refuses_is_503_with_the_reason(nsqd_server, http):
    assert_ok_empty(await http.post("/topic/create?topic=t"))

    def disk_full(*args, **kwargs):
        raise DiskQueueWriteError(28, "No space left on device")

    topic = nsqd_server.topics["t"]
    topic.publish = disk_full
    topic.backend.failing = "No space left on device"  # as a full disk leaves the queue: /ping stays NOK
    nsqd_server._room_to_write = lambda: False  # and the writer's probe of the disk finds no room either
    assert_error(await http.post("/pub?topic=t", b"x"), 503, "PUB_FAILED: cannot store: No space left on device")
    assert_error(await http.post("/mpub?topic=t", b"x\ny"), 503,
                 "MPUB_FAILED: cannot store: No space left on device")
    assert (await http.get("/ping")).body == b"NOK - No space left on device"


# ------------------------------------------------------------------ admin


async def test_topic_create_pause_unpause_empty_delete(nsqd_server, http):
    assert_ok_empty(await http.post("/topic/create?topic=t"))
    assert_ok_empty(await http.post("/topic/create?topic=t"))  # idempotent
    assert topic_of(await stats(http), "t")["paused"] is False

    assert_ok_empty(await http.post("/topic/pause?topic=t"))
    assert topic_of(await stats(http), "t")["paused"] is True
    await wait_for_metadata(nsqd_server, lambda d: d["topics"] == [{"channels": [], "name": "t", "paused": True}])

    assert_ok_empty(await http.post("/topic/unpause?topic=t"))
    assert topic_of(await stats(http), "t")["paused"] is False
    await wait_for_metadata(nsqd_server, lambda d: d["topics"] == [{"channels": [], "name": "t", "paused": False}])

    await http.post("/mpub?topic=t", b"a\nb\nc")
    assert topic_of(await stats(http), "t")["depth"] == 3
    assert_ok_empty(await http.post("/topic/empty?topic=t"))
    topic = topic_of(await stats(http), "t")
    assert (topic["depth"], topic["message_count"]) == (0, 3)

    assert_ok_empty(await http.post("/topic/delete?topic=t"))
    assert (await stats(http))["topics"] == []
    await wait_for_metadata(nsqd_server, lambda d: d["topics"] == [])


async def test_pauses_one_after_another_are_each_answered_once_saved_without_a_fixed_wait(nsqd_server, http):
    """A pause is answered once nsqd.dat holds it (as Go); the writer then rested a fixed 50 ms,
    so nsqadmin's pauses one after another took 45 ms each (Go: under 1 ms). It now rests as long
    as the save took."""
    assert_ok_empty(await http.post("/topic/create?topic=t"))
    start = trio.current_time()
    for _ in range(20):
        assert_ok_empty(await http.post("/topic/pause?topic=t"))
        assert_ok_empty(await http.post("/topic/unpause?topic=t"))
    assert trio.current_time() - start < 1.0  # was 1.8 s
    await wait_for_metadata(nsqd_server, lambda d: d["topics"] == [{"channels": [], "name": "t", "paused": False}])


async def test_channel_create_pause_unpause_empty_delete(nsqd_server, http):
    assert_ok_empty(await http.post("/topic/create?topic=t"))
    assert_ok_empty(await http.post("/channel/create?topic=t&channel=c"))
    assert_ok_empty(await http.post("/channel/create?topic=t&channel=other"))
    assert [c["channel_name"] for c in topic_of(await stats(http), "t")["channels"]] == ["c", "other"]

    assert_ok_empty(await http.post("/channel/pause?topic=t&channel=c"))
    assert channel_of(await stats(http), "t", "c")["paused"] is True
    assert channel_of(await stats(http), "t", "other")["paused"] is False
    await wait_for_metadata(nsqd_server, lambda d: {"name": "c", "paused": True} in d["topics"][0]["channels"])

    assert_ok_empty(await http.post("/channel/unpause?topic=t&channel=c"))
    assert channel_of(await stats(http), "t", "c")["paused"] is False
    await wait_for_metadata(nsqd_server, lambda d: {"name": "c", "paused": False} in d["topics"][0]["channels"])

    await http.post("/mpub?topic=t", b"a\nb")
    assert_ok_empty(await http.post("/channel/empty?topic=t&channel=c"))
    assert channel_of(await stats(http), "t", "c")["depth"] == 0
    assert channel_of(await stats(http), "t", "other")["depth"] == 2

    assert_ok_empty(await http.post("/channel/delete?topic=t&channel=c"))
    assert [c["channel_name"] for c in topic_of(await stats(http), "t")["channels"]] == ["other"]


async def test_queues_deleted_before_their_tasks_begin_do_not_stop_the_daemon(nsqd_server, http):
    """A create and a delete handled in one pass of the scheduler (two admin requests read together):
    each disk queue's task began after its queue was gone, raised, and took the daemon down."""
    nsqd_server.declare("t", "c")
    nsqd_server.delete_topic("t")
    nsqd_server.declare("u", "c")
    nsqd_server.delete_channel(nsqd_server.topics["u"], "c")
    await trio.sleep(0.05)
    assert_ok_empty(await http.post("/topic/create?topic=t"))
    assert (await http.post("/pub?topic=t", b"x")).status == 200
    assert topic_of(await stats(http), "t")["depth"] == 1


async def test_admin_posts_ignore_a_body(http):
    """nsqadmin POSTs a JSON body to the admin endpoints; it means nothing."""
    assert_ok_empty(await http.post("/topic/create?topic=t", b'{"topic":"other"}'))
    assert [t["topic_name"] for t in (await stats(http))["topics"]] == ["t"]


# ------------------------------------------------------------------ stats


async def clients_for_stats(nsqd):
    """A consumer subscribed to t/c with RDY 5 and a producer that published to t and u."""
    consumer = await NSQConnection.open(tcp_port(nsqd))
    await consumer.identify(client_id="cons", hostname="conshost", user_agent="test-consumer/1.0")
    await consumer.sub("t", "c")
    await consumer.command("RDY 5")
    producer = await NSQConnection.open(tcp_port(nsqd))
    await producer.identify(client_id="prod", hostname="prodhost", user_agent="test-producer/1.0")
    await producer.pub("t", b"m1")
    await producer.pub("t", b"m2")
    await producer.pub("u", b"m3")
    await consumer.read_message()
    await consumer.read_message()
    return consumer, producer


async def test_stats_json_has_go_keys_and_values(nsqd_server, http):
    consumer, producer = await clients_for_stats(nsqd_server)
    doc = await stats(http)
    assert list(doc) == ["version", "health", "start_time", "topics", "memory", "producers"]
    assert (doc["version"], doc["health"], doc["start_time"]) == ("1.3.0", "OK", int(nsqd_server.start_time))
    assert set(doc["memory"]) == {"heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes",
                                  "gc_pause_usec_100", "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes",
                                  "gc_total_runs"}
    assert doc["memory"]["heap_in_use_bytes"] > 0
    assert [t["topic_name"] for t in doc["topics"]] == ["t", "u"]

    topic = topic_of(doc, "t")
    assert set(topic) == TOPIC_KEYS
    assert topic["e2e_processing_latency"] == {"count": 0, "percentiles": []}
    assert (topic["message_count"], topic["message_bytes"], topic["depth"]) == (2, 4, 0)

    channel = topic["channels"][0]
    assert set(channel) == CHANNEL_KEYS
    assert (channel["channel_name"], channel["in_flight_count"], channel["message_count"]) == ("c", 2, 2)
    assert (channel["client_count"], len(channel["clients"])) == (1, 1)

    client = channel["clients"][0]
    assert set(client) == CLIENT_KEYS  # omitempty: no pub_counts, authed, auth_identity(_url)
    assert (client["client_id"], client["hostname"], client["user_agent"]) == ("cons", "conshost", "test-consumer/1.0")
    assert (client["version"], client["state"], client["ready_count"]) == ("V2", 3, 5)
    assert (client["in_flight_count"], client["message_count"], client["finish_count"]) == (2, 2, 0)
    assert client["remote_address"].startswith("127.0.0.1:")
    assert abs(client["connect_ts"] - time.time()) < 60

    [prod] = doc["producers"]
    assert set(prod) == CLIENT_KEYS | {"pub_counts"}
    assert prod["client_id"] == "prod"
    assert prod["pub_counts"] == [{"topic": "t", "count": 2}, {"topic": "u", "count": 1}]
    await consumer.close()
    await producer.close()


@pytest.mark.parametrize("nsqd_server", [{"topology_region": "eu", "topology_zone": "eu-1a"}], indirect=True)
async def test_identify_topology_and_names_are_the_clients_own(nsqd_server, http):
    """As nsqd's IDENTIFY: the answer names the daemon's topology, and /stats shows
    the client's topology and names as it sent them (absent ones empty)."""
    consumer = await NSQConnection.open(tcp_port(nsqd_server))
    answer = await consumer.identify(feature_negotiation=True, client_id="cons", hostname="conshost",
                                     topology_region="us", topology_zone="us-2b")
    assert (answer["topology_region"], answer["topology_zone"]) == ("eu", "eu-1a")
    await consumer.sub("t", "c")
    bare = await NSQConnection.open(tcp_port(nsqd_server))
    await bare.identify(short_id="old", long_id="old.example")  # pre-1.0 names mean nothing to nsqd 1.3
    await bare.sub("t", "c")
    clients = channel_of(await stats(http), "t", "c")["clients"]
    fields = sorted((c["client_id"], c["hostname"], c["topology_region"], c["topology_zone"]) for c in clients)
    assert fields == [("", "", "", ""), ("cons", "conshost", "us", "us-2b")]
    await consumer.close()
    await bare.close()


@pytest.mark.parametrize("nsqd_server", [{"tcp_address": "[::1]:0"}], indirect=True)
async def test_ipv6_clients_are_named_as_go_names_them(nsqd_server, http):
    """Go's RemoteAddr().String() brackets an IPv6 host, and the client's default
    client_id and hostname are its host as net.SplitHostPort gives it."""
    conn = NSQConnection(await trio.open_tcp_stream("::1", tcp_port(nsqd_server)))
    await conn.send(b"  V2")
    await conn.sub("t", "c")
    [client] = channel_of(await stats(http), "t", "c")["clients"]
    assert client["remote_address"].startswith("[::1]:")
    assert (client["client_id"], client["hostname"]) == ("::1", "::1")
    await conn.close()


async def test_stats_filters(nsqd_server, http):
    consumer, producer = await clients_for_stats(nsqd_server)
    await http.post("/channel/create?topic=t&channel=d")
    await http.post("/channel/create?topic=u&channel=d")

    doc = await stats(http, "&topic=t")
    assert [t["topic_name"] for t in doc["topics"]] == ["t"]
    assert [c["channel_name"] for c in doc["topics"][0]["channels"]] == ["c", "d"]
    # producers stay listed, with counts for the requested topic only
    assert doc["producers"][0]["pub_counts"] == [{"topic": "t", "count": 2}]

    doc = await stats(http, "&topic=t&channel=d")
    assert [c["channel_name"] for c in doc["topics"][0]["channels"]] == ["d"]

    doc = await stats(http, "&channel=c")  # topics without that channel are left out
    assert [(t["topic_name"], [c["channel_name"] for c in t["channels"]]) for t in doc["topics"]] == [("t", ["c"])]

    doc = await stats(http, "&topic=missing")  # nsqd's GetStats returns before it lists producers
    assert (doc["topics"], doc["producers"]) == ([], [])

    doc = await stats(http, "&include_clients=false")
    channel = channel_of(doc, "t", "c")
    assert (channel["clients"], channel["client_count"], doc["producers"]) == ([], 1, [])
    assert channel_of(await stats(http, "&include_clients=junk"), "t", "c")["clients"] != []

    assert "memory" not in await stats(http, "&include_mem=false")
    assert "memory" in await stats(http, "&include_mem=0x")  # unknown values keep the default
    await consumer.close()
    await producer.close()


async def test_stats_text_format(nsqd_server, http):
    consumer, producer = await clients_for_stats(nsqd_server)
    await http.post("/channel/create?topic=t&channel=held")
    await http.post("/channel/pause?topic=t&channel=held")
    for target in ("/stats", "/stats?format=text", "/stats?format=anything"):
        response = await http.get(target)
        assert response.status == 200
        assert response.headers["content-type"] == TEXT_TYPE
        text = response.body.decode()
        lines = text.splitlines()
        assert lines[0].startswith("nsqd v1.3.0 ")
        assert lines[1].startswith("start_time 20")
        assert "\nHealth: OK\n" in text
        assert "\nMemory:\n   heap_objects" in text
        assert "\n   [t              ] depth: 0     be-depth: 0     msgs: 2        e2e%: \n" in text
        assert "      [c                        ] depth: 0     be-depth: 0     inflt: 2    def: 0    " in text
        assert "   *P [held                     ] depth: 0 " in text
        assert any(line.startswith("        [V2 conshost:") and "state: 3 inflt: 2    rdy: 5 " in line
                   for line in lines)
        assert any(line.startswith("   [V2 prodhost:") and "msgs: 3        topics: t=2,u=1 connected: " in line
                   for line in lines)
    text = (await http.get("/stats?include_mem=false&include_clients=false")).body.decode()
    assert "Memory:" not in text and text.endswith("\nProducers: None\n")
    text = (await http.get("/stats?topic=missing")).body.decode()
    assert "\nTopics: None\n" in text
    await consumer.close()
    await producer.close()


class BareConsumer:
    """A non-TCP consumer (as an AMQP link would be) with only what a channel needs."""

    write_blocked = False

    def wake(self) -> None:
        pass

    def timed_out(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass

    def drain(self) -> None:
        pass


async def test_stats_render_consumers_that_lack_client_fields(nsqd_server, http):
    assert_ok_empty(await http.post("/topic/create?topic=t"))
    assert_ok_empty(await http.post("/channel/create?topic=t&channel=c"))
    channel = nsqd_server.topics["t"].channels["c"]
    channel.subscribe(BareConsumer(), 10_000, Budget(0), msg_timeout_ns=1, max_msg_timeout_ns=1)
    channel = channel_of(await stats(http), "t", "c")
    assert channel["client_count"] == 1
    [client] = channel["clients"]
    assert set(client) == CLIENT_KEYS
    assert (client["version"], client["state"], client["in_flight_count"], client["hostname"]) == ("V2", 0, 0, "")
    text = (await http.get("/stats")).body.decode()
    assert "        [V2 :  " in text and "state: 0 inflt: 0 " in text


async def test_publish_while_exiting_is_503(nsqd_server, http):
    def exiting(name):
        raise ChannelExiting("exiting")

    nsqd_server.get_topic = exiting
    assert_error(await http.post("/pub?topic=t", b"x"), 503, "EXITING")
    assert_error(await http.post("/mpub?topic=t", b"x"), 503, "EXITING")
    assert_error(await http.post("/topic/create?topic=t"), 503, "EXITING")


# ----------------------------------------------------------------- config


@pytest.mark.parametrize("opt,body,content_type", [
    ("msg_timeout", b"60000000000", JSON_TYPE),
    ("max_req_timeout", b"3600000000000", JSON_TYPE),
    ("max_msg_size", b"1048576", JSON_TYPE),
    ("mem_queue_size", b"10000", JSON_TYPE),
    ("nsqlookupd_tcp_addresses", b"[]", JSON_TYPE),
    ("log_level", b"2", JSON_TYPE),
    ("snappy", b"true", JSON_TYPE),
    ("tcp_address", b"127.0.0.1:0", TEXT_TYPE),
])
async def test_config_get(http, opt, body, content_type):
    response = await http.get(f"/config/{opt}")
    assert (response.status, response.body) == (200, body)
    assert response.headers["content-type"] == content_type
    assert response.headers[V1[0]] == V1[1]


async def test_config_reports_the_options_nsqd_rewrites_once_it_listens(nsqd_server, http):
    """Go's New sets the broadcast ports left at 0 to the bound ones and fills the statsd
    prefix's %s with the host key; /config then reports those (it said 0, 0 and nsq.%s)."""
    tcp, http_port = nsqd_server.tcp_addresses[0][1], nsqd_server.http_addresses[0][1]
    assert (await http.get("/config/broadcast_tcp_port")).body == b"%d" % tcp
    response = await http.get("/config/broadcast_http_port")
    assert (response.body, response.headers["content-type"]) == (b"%d" % http_port, JSON_TYPE)
    host = nsqd_server.options.broadcast_address.replace(".", "_")
    response = await http.get("/config/statsd_prefix")
    assert (response.body, response.headers["content-type"]) == (f"nsq.{host}_{http_port}.".encode(), TEXT_TYPE)


async def test_config_unknown_option(http):
    assert_error(await http.get("/config/no_such_option"), 400, "INVALID_OPTION")
    assert_error(await http.get("/config/queue_scan_interval"), 400, "INVALID_OPTION")  # not a Go flag field
    for newer in ("topology_region", "topology_zone", "enable_experiment", "auth_http_request_method"):
        assert_error(await http.get(f"/config/{newer}"), 400, "INVALID_OPTION")  # flags of nsqd after v1.3.0


async def test_config_put_lookupd_addresses(nsqd_server, http):
    addresses = b'["127.0.0.1:4160","127.0.0.1:4162"]'
    response = await http.put("/config/nsqlookupd_tcp_addresses", addresses)
    assert (response.status, response.body) == (200, addresses)
    assert nsqd_server.options.lookupd_tcp_addresses == ["127.0.0.1:4160", "127.0.0.1:4162"]
    assert (await http.get("/config/nsqlookupd_tcp_addresses")).body == addresses
    # null clears the list, and Go's answer is then null (its slice is nil), until set again
    for body, answer in ((b"null", b"null"), (b"[]", b"[]"), (b"null", b"null"), (addresses, addresses)):
        response = await http.put("/config/nsqlookupd_tcp_addresses", body)
        assert (response.status, response.body) == (200, answer)
        assert (await http.get("/config/nsqlookupd_tcp_addresses")).body == answer
    assert nsqd_server.options.lookupd_tcp_addresses == ["127.0.0.1:4160", "127.0.0.1:4162"]


@pytest.mark.parametrize("opt,body,status,message", [
    ("nsqlookupd_tcp_addresses", b"", 413, "INVALID_VALUE"),
    ("nsqlookupd_tcp_addresses", b"x" * 1048577, 413, "INVALID_VALUE"),
    ("nsqlookupd_tcp_addresses", b"not json", 400, "INVALID_VALUE"),
    ("nsqlookupd_tcp_addresses", b'"127.0.0.1:4160"', 400, "INVALID_VALUE"),
    ("nsqlookupd_tcp_addresses", b"[4160]", 400, "INVALID_VALUE"),
    ("nsqlookupd_tcp_addresses", b'["no-port"]', 400, "INVALID_VALUE"),
    pytest.param("nsqlookupd_tcp_addresses", b"[" * 100_000 + b"]" * 100_000, 400, "INVALID_VALUE",
                 id="nested-too-deep"),
    ("log_level", b"loud", 400, "INVALID_VALUE"),
    ("log_level", b"info\n", 400, "INVALID_VALUE"),
    ("msg_timeout", b"1000", 400, "INVALID_OPTION"),
    ("no_such_option", b"1", 400, "INVALID_OPTION"),
])
async def test_config_put_rejects(nsqd_server, http, opt, body, status, message):
    before = (list(nsqd_server.options.lookupd_tcp_addresses), nsqd_server.options.log_level)
    assert_error(await http.put(f"/config/{opt}", body), status, message)
    assert (nsqd_server.options.lookupd_tcp_addresses, nsqd_server.options.log_level) == before


async def test_config_put_log_level_changes_the_logging_level(nsqd_server, http, capsys):
    saved, was_configured = structlog.get_config(), structlog.is_configured()
    configure_logging(Options(log_level="info", log_format="json"))
    try:
        response = await http.put("/config/log_level", b"ERROR")
        assert (response.status, response.body) == (200, b"4")
        assert nsqd_server.options.log_level == "error"
        structlog.get_logger("probe").warning("should be filtered")
        structlog.get_logger("probe").error("should be shown")
        err = capsys.readouterr().err
        assert "should be shown" in err and "should be filtered" not in err
        assert (await http.put("/config/log_level", b"debug")).body == b"1"
    finally:
        structlog.reset_defaults()
        if was_configured:
            structlog.configure(**saved)


@pytest.mark.parametrize("nsqd_server", [{"topic_max_messages": 2}], indirect=True)
async def test_full_topic_answers_503_and_other_topics_accept(http):
    assert (await http.request("POST", "/pub?topic=small", b"1")).status == 200
    resp = await http.request("POST", "/mpub?topic=small", b"2\n3\n")
    assert resp.status == 503
    assert resp.json()["message"].startswith("MPUB_FAILED: topic small is full")
    assert (await http.request("POST", "/pub?topic=small", b"2")).status == 200
    assert (await http.request("POST", "/pub?topic=small", b"3")).status == 503
    assert (await http.request("POST", "/pub?topic=other", b"x")).status == 200
