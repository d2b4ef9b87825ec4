"""What a long-running daemon must not keep: state of clients, links, topics and channels that went.

Found by the soak (``bench/soak.py``); each test fails on the code before its fix.
"""

from __future__ import annotations

import trio

from nsqd.client_v2 import PUB_COUNTS_PRUNE

from .conftest import HTTPClient
from .support import Daemon, NSQConnection, free_port


async def test_a_long_lived_publisher_does_not_keep_the_names_of_the_topics_that_went(tmp_path):
    """Request and reply: each requester's ``#ephemeral`` topic goes with it, and the
    replying connection's publish counts forget it (they kept every name: ~100 B a reply)."""
    http_port = free_port()
    daemon = Daemon(tmp_path, f"--http-address=127.0.0.1:{http_port}")
    try:
        await daemon.wait_ready()
        server = await NSQConnection.open(daemon.port)
        await server.identify(client_id="server")
        replies = 3 * PUB_COUNTS_PRUNE
        for i in range(replies):
            requester = await NSQConnection.open(daemon.port)
            await requester.identify()
            await requester.sub(f"reply{i}#ephemeral", "c#ephemeral")
            await requester.command("RDY 1")
            await server.pub(f"reply{i}#ephemeral", b"answer")
            assert (await requester.read_message()).body == b"answer"
            await requester.close()
        doc = (await HTTPClient(http_port).request("GET", "/stats?format=json")).json()
        (producer,) = [c for c in doc["producers"] if c["client_id"] == "server"]
        names = [count["topic"] for count in producer["pub_counts"]]
        assert 0 < len(names) <= PUB_COUNTS_PRUNE
        assert "reply0#ephemeral" not in names and f"reply{replies - 1}#ephemeral" in names
    finally:
        daemon.proc.kill()
        await trio.to_thread.run_sync(daemon.proc.wait)
