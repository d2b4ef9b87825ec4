"""Prometheus /metrics, parsed with prometheus_client's own text parser."""

from prometheus_client.parser import text_string_to_metric_families

from .conftest import HTTPClient
from .support import NSQConnection, running_nsqd, tcp_port


def samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_mirror_stats(tmp_path):
    async with running_nsqd(tmp_path, http_address="127.0.0.1:0", max_attempts=1) as nsqd:
        http = HTTPClient(nsqd.http_addresses[0][1])
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("weird", "c")
        await conn.mpub("weird", [b"a", b"b", b"c"])
        await conn.command("RDY 1")
        msg = await conn.read_message()
        await conn.command(b"REQ " + msg.id + b" 0")  # max_attempts 1: dead-lettered
        await conn.command("NOP")
        resp = await http.request("GET", "/metrics")
        assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
        got = samples(resp.body.decode())
        labels = (("channel", "c"), ("topic", 'weird'))
        assert got[("nsqd_topic_messages_total", (("topic", 'weird'),))] == 3
        assert got[("nsqd_channel_dead_lettered_total", labels)] == 1
        assert got[("nsqd_channel_clients", labels)] == 1
        assert got[("nsqd_channel_in_flight", labels)] + got[("nsqd_channel_depth", labels)] == 2
        assert got[("nsqd_topic_depth", (("topic", 'weird.dead'),))] == 1
        assert got[("nsqd_clients", ())] == 1
        assert got[("nsqd_info", (("version", "1.3.0"),))] == 1
        assert got[("process_cpu_seconds_total", ())] > 0
