"""How long /metrics and /stats take to render with many channels.

Builds a daemon object (not serving) with TOPICS x CHANNELS ephemeral channels
(no disk), then times one stats snapshot, its JSON rendering and the
Prometheus rendering. Prints milliseconds per render.

    python bench/metrics_bench.py [topics] [channels-per-topic]
"""

import sys
import tempfile
import time

from nsqd import metrics, stats
from nsqd.nsqd import NSQD
from nsqd.options import Options


def main() -> None:
    topics = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    per_topic = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    nsqd = NSQD(Options(data_path=tempfile.mkdtemp(), http_address="", amqp_address=""))
    for t in range(topics):
        topic = nsqd.get_topic(f"topic-{t}#ephemeral")
        for c in range(per_topic):
            topic.get_channel(f"channel-{c}#ephemeral")
    runs = 5
    started = time.perf_counter()
    for _ in range(runs):
        snap = stats.snapshot(nsqd, include_clients=False)
    snap_ms = (time.perf_counter() - started) / runs * 1000
    started = time.perf_counter()
    for _ in range(runs):
        text = metrics.render(snap, 0)
    prom_ms = (time.perf_counter() - started) / runs * 1000
    started = time.perf_counter()
    for _ in range(runs):
        stats.render_json(snap)
    json_ms = (time.perf_counter() - started) / runs * 1000
    print(f"channels: {topics * per_topic}")
    print(f"snapshot: {snap_ms:.1f} ms")
    print(f"prometheus render: {prom_ms:.1f} ms ({len(text) / 1e6:.1f} MB)")
    print(f"json render: {json_ms:.1f} ms")


if __name__ == "__main__":
    main()
