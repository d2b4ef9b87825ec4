"""The collector's pauses, reported where Go nsqd reports its own: /stats memory, statsd, /metrics."""

import gc
import json
import urllib.request

import trio
from prometheus_client.parser import text_string_to_metric_families

from nsqd.gc_pauses import GCPauses

from .conftest import HTTPClient
from .support import Daemon, NSQConnection, free_port, running_nsqd, tcp_port


def test_percentiles_are_picked_as_go_picks_them():
    pauses = GCPauses(keep=256)
    assert pauses.percentiles_usec((100.0, 99.0, 95.0)) == [0, 0, 0]
    pauses.recent.extend(i / 1e6 for i in range(100, 0, -1))  # 1..100 µs, in any order
    # Go: index floor(p/100 * n + 0.5), capped at n - 1, of the sorted pauses
    assert pauses.percentiles_usec((100.0, 99.0, 95.0, 50.0, 0.0)) == [100, 100, 96, 51, 1]


def test_only_the_latest_pauses_are_kept_and_every_one_is_counted():
    pauses = GCPauses(keep=4)
    for _ in range(10):
        pauses.callback("start", {})
        pauses.callback("stop", {})
    assert len(pauses.recent) == 4 and pauses.count == 10
    assert pauses.total >= sum(pauses.recent) > 0


def test_a_real_daemon_reports_its_collections_in_stats(tmp_path):
    http_port = free_port()
    daemon = Daemon(tmp_path, f"--http-address=127.0.0.1:{http_port}")
    try:
        daemon.wait_ready_sync()
        body = b"".join(b"\x00\x00\x00\x05hello" for _ in range(2000))
        for _ in range(5):  # enough allocation for several young collections
            request = urllib.request.Request(f"http://127.0.0.1:{http_port}/mpub?topic=gc&binary=true",
                                             data=b"\x00\x00\x07\xd0" + body, method="POST")
            assert urllib.request.urlopen(request, timeout=10).read() == b"OK"
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/stats?format=json", timeout=10) as response:
            memory = json.loads(response.read())["memory"]
    finally:
        daemon.proc.terminate()
        daemon.proc.wait(30)
    assert memory["gc_total_runs"] > 0
    assert memory["gc_pause_usec_100"] >= memory["gc_pause_usec_99"] >= memory["gc_pause_usec_95"]
    assert memory["gc_pause_usec_100"] > 0


async def test_statsd_and_metrics_send_the_pauses(tmp_path):
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    async with running_nsqd(tmp_path, http_address="127.0.0.1:0", statsd_address=f"127.0.0.1:{port}",
                            statsd_interval=0.2, statsd_prefix="nsq.") as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.mpub("t", [b"a", b"b"])
        for _ in range(3):
            gc.collect()
        wanted = {"heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes",
                  "gc_pause_usec_100", "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes"}
        gauges: dict[str, int] = {}
        with trio.fail_after(5):
            while not wanted <= gauges.keys() or not gauges["gc_pause_usec_100"]:
                for line in (await sock.recv(65536)).decode().splitlines():
                    if line.startswith("nsq.mem.") and line.endswith("|g"):
                        name, value = line[len("nsq.mem."):-2].split(":")
                        gauges[name] = int(value)
        assert gauges["gc_pause_usec_100"] >= gauges["gc_pause_usec_99"] >= gauges["gc_pause_usec_95"] > 0
        assert gauges["heap_objects"] > 0

        resp = await HTTPClient(nsqd.http_addresses[0][1]).request("GET", "/metrics")
        families = {f.name: f for f in text_string_to_metric_families(resp.body.decode())}
        summary = {(s.name, s.labels.get("quantile")): s.value for s in families["python_gc_pause_seconds"].samples}
        assert summary[("python_gc_pause_seconds_count", None)] >= 3
        assert summary[("python_gc_pause_seconds_sum", None)] > 0
        assert summary[("python_gc_pause_seconds", "1")] >= summary[("python_gc_pause_seconds", "0.95")] > 0
    sock.close()
