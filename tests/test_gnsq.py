"""gnsq, a gevent NSQ client, against two daemons it finds through nsqlookupd.

Both daemons are started as a harness starts Go nsqd (port 0, ports read from
stderr) and register with a minimal nsqlookupd (``tests/lookupd.py``). The
gnsq application runs in its own process (gevent patches the standard
library, which must not happen to the Trio test process): it publishes with
gnsq's Producer and HTTP client, then consumes with a Consumer given only the
nsqlookupd address, so every message it receives came over a connection to
a daemon it discovered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio

from .conftest import HTTPClient
from .harness import GoStyleNsqd
from .lookupd import NSQLookupd

CLIENT = Path(__file__).with_name("gnsq_client.py")
COUNT = 20


async def test_gnsq_publishes_and_consumes_from_daemons_found_through_nsqlookupd(tmp_path):
    lookupd = NSQLookupd()
    daemons: list[GoStyleNsqd] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.serve)
        try:
            for index in range(2):  # the second one proves nothing else holds a fixed port (AMQP is opt-in)
                daemon = GoStyleNsqd("--tcp-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
                                     "--data-path", str(tmp_path / f"nsqd{index}"), "-broadcast-address", "127.0.0.1",
                                     f"-lookupd-tcp-address=127.0.0.1:{lookupd.tcp_port}")
                daemons.append(daemon)
                await daemon.start()
            tcp_ports = {d.ports["TCP"] for d in daemons}
            await lookupd.wait_for(lambda: {p.info["tcp_port"] for p in lookupd.producers.values()} == tcp_ports)
            identified = [p.info for p in lookupd.producers.values()]
            assert {i["http_port"] for i in identified} == {d.ports["HTTP"] for d in daemons}
            assert {(i["broadcast_address"], i["version"]) for i in identified} == {("127.0.0.1", "1.3.0")}

            args = [sys.executable, str(CLIENT), "--topic", "gnsq_orders", "--channel", "billing",
                    "--lookupd-http", f"http://127.0.0.1:{lookupd.http_port}", "--count", str(COUNT),
                    "--nsqd-http", f"127.0.0.1:{daemons[0].ports['HTTP']}"]
            for daemon in daemons:
                args += ["--nsqd-tcp", f"127.0.0.1:{daemon.ports['TCP']}"]
            with trio.fail_after(90):
                done = await trio.run_process(args, capture_stdout=True, capture_stderr=True, check=False)
            assert done.returncode == 0, done.stderr.decode()[-3000:]
            result = json.loads(done.stdout.decode().strip().splitlines()[-1])

            # everything published (MPUB, PUB, DPUB, /pub, /mpub) came back exactly once
            assert len(result["published"]) == 2 * (COUNT + 2) + 3
            assert result["received"] == result["published"]
            assert result["info_version"] == "1.3.0"
            # nsqlookupd told gnsq about both daemons, and gnsq asked it
            producers = result["lookup"]["producers"]
            assert {(p["broadcast_address"], p["tcp_port"]) for p in producers} == {("127.0.0.1", p) for p in tcp_ports}
            assert any(r.startswith("/lookup?topic=gnsq_orders") for r in lookupd.requests)

            # each daemon: the consumer subscribed there and finished what it held
            for index, daemon in enumerate(daemons):
                stats = json.loads((await HTTPClient(daemon.ports["HTTP"]).get(
                    "/stats?format=json&topic=gnsq_orders")).body)
                (topic,) = stats["topics"]
                (channel,) = topic["channels"]
                held = COUNT + 2 + (3 if index == 0 else 0)
                assert (topic["message_count"], channel["channel_name"]) == (held, "billing")
                assert (channel["message_count"], channel["depth"], channel["in_flight_count"],
                        channel["deferred_count"]) == (held, 0, 0, 0)
            # the daemons registered the channel the consumer created
            assert lookupd.lookup("gnsq_orders")["channels"] == ["billing"]

            for daemon in daemons:
                status, lines = await daemon.stop()
                assert status == 0 and lines[-1].endswith("INFO: NSQ: bye")
        finally:
            for daemon in daemons:
                await daemon.kill()
            nursery.cancel_scope.cancel()
