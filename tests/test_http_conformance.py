"""HTTP API details checked against Go nsqd 1.3's source (nsqd/http.go, internal/http_api).

Each test pins one behaviour a client, a tool or a conformance suite can see,
with the exact status, headers and bytes Go nsqd writes.
"""

import json
import re

import pytest
import trio

from .support import NSQConnection, tcp_port

TOPIC_LINE = "   [{:<15}] depth: {:<5} be-depth: 0     msgs: {:<8} e2e%: "


async def test_text_stats_has_no_blank_line_after_topics_heading(nsqd_server, http):
    """printStats writes "\\nTopics:" without a newline, so the first topic follows at once."""
    for topic in ("a", "b"):
        assert (await http.post(f"/pub?topic={topic}", b"x")).status == 200
    text = (await http.get("/stats?include_mem=false")).body.decode()
    section = text[text.index("\nTopics:"):text.index("\nProducers:")]
    assert section == "\n".join([
        "",
        "Topics:",
        TOPIC_LINE.format("a", 1, 1),
        "",
        TOPIC_LINE.format("b", 1, 1),
        "",
    ])


@pytest.mark.parametrize("nsqd_server", [{"e2e_processing_latency_percentiles": [1.0, 0.5]}], indirect=True)
async def test_stats_json_writes_integral_latency_figures_as_go_does(nsqd_server, http):
    """Go's encoding/json writes float64 1.0 as 1: quantile 1 and whole nanoseconds have no ".0"."""
    consumer = await NSQConnection.open(tcp_port(nsqd_server))
    await consumer.sub("t", "c")
    await consumer.pub("t", b"x")
    await consumer.command("RDY 1")
    message = await consumer.read_message()
    await consumer.command(b"FIN " + message.id)
    for _ in range(100):
        body = (await http.get("/stats?format=json&include_clients=false&include_mem=false")).body.decode()
        if '"count":1' in body:
            break
        await trio.sleep(0.01)
    await consumer.close()
    percentiles = re.findall(r'"percentiles":\[[^\]]*\]', body)
    assert len(percentiles) == 2  # the channel's and the topic's
    for text in percentiles:
        assert re.fullmatch(r'"percentiles":\[\{"quantile":1,"value":[1-9][0-9]*\},'
                            r'\{"quantile":0\.5,"value":[1-9][0-9]*\}\]', text), text


@pytest.mark.parametrize("target", ["/pi%zzng", "/ping%4", "/config/log%_level"])
async def test_path_with_malformed_escape_is_a_bad_request(http, target):
    """Go's net/http refuses such a request line (400) before routing; it is no unknown path (404)."""
    response = await http.get(target)
    assert (response.status, response.body) == (400, b'{"message":"BAD_REQUEST"}')
    assert response.headers["connection"] == "close"


async def test_malformed_escape_in_query_only_is_the_endpoints_business(http):
    """The request line takes any query; /ping never parses its own, so it answers OK."""
    response = await http.get("/p%69ng?x=%zz")
    assert (response.status, response.body) == (200, b"OK")


async def test_config_lookupd_address_with_a_lone_surrogate_escape_reads_it_as_the_replacement_character(
        nsqd_server, http):
    """Go's JSON decoder reads ``\\ud800`` alone as U+FFFD: the address is taken as such (a 200, not a 500)."""
    response = await http.put("/config/nsqlookupd_tcp_addresses", b'["x\\ud800:4160"]')
    assert response.status == 200
    assert nsqd_server.options.lookupd_tcp_addresses == ["x\ufffd:4160"]


async def test_config_lookupd_addresses_are_at_most_64(nsqd_server, http):
    """15,000 addresses in one PUT (open to anyone, as in Go) started a dialing task each and kept
    the event loop busy for seconds; more than 64 distinct ones are refused, the list unchanged."""
    many = json.dumps([f"10.0.{i // 256}.{i % 256}:4160" for i in range(65)]).encode()
    response = await http.put("/config/nsqlookupd_tcp_addresses", many)
    assert (response.status, response.json()) == (400, {"message": "INVALID_VALUE"})
    assert nsqd_server.options.lookupd_tcp_addresses == []
    enough = json.dumps(["127.0.0.1:1"] * 100 + [f"10.0.0.{i}:4160" for i in range(63)]).encode()
    assert (await http.put("/config/nsqlookupd_tcp_addresses", enough)).status == 200


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
async def test_status_line_and_header_names_are_written_as_gos_net_http_writes_them(nsqd_server, version):
    from .conftest import http_port

    stream = await trio.open_tcp_stream("127.0.0.1", http_port(nsqd_server))
    await stream.send_all(b"GET /info HTTP/" + version + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    assert head[0] == b"HTTP/" + version + b" 200 OK"
    names = {line.split(b":", 1)[0] for line in head[1:]}
    assert {b"Content-Type", b"Content-Length", b"Date", b"X-Nsq-Content-Type"} <= names, names
