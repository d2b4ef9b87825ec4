"""A restart with many topics lists the data directory once, not once per queue.

Every queue used to list the whole directory twice while it opened (its own
segments, and whether Go nsqd left files for it), so start-up grew with the
square of the queues: 3,000 topics with a channel each took 70 s to restart.
"""

import os

from .support import NSQConnection, running_nsqd, tcp_port
from .test_go_takeover import go_message, write_go_queue

TOPICS = 60


async def test_a_restart_lists_the_data_directory_once_and_recovers_every_queue(tmp_path, monkeypatch):
    async with running_nsqd(tmp_path) as nsqd:
        conn = await NSQConnection.open(tcp_port(nsqd))
        for index in range(TOPICS):
            nsqd.declare(f"t{index}", "c")
            await conn.pub(f"t{index}", b"m%d" % index)
        await conn.close()
    # a Go queue for one of the topics, and a topic whose name holds our files' marker
    write_go_queue(tmp_path, "t7:c", [go_message(b"%016x" % 1, b"from-go")])
    async with running_nsqd(tmp_path) as nsqd:
        nsqd.declare("a.diskq.b", "c")
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.pub("a.diskq.b", b"marked")
        await conn.close()

    calls = []
    real_listdir, real_scandir = os.listdir, os.scandir
    monkeypatch.setattr(os, "listdir", lambda path=".": calls.append(path) or real_listdir(path))
    monkeypatch.setattr(os, "scandir", lambda path=".": calls.append(path) or real_scandir(path))
    async with running_nsqd(tmp_path) as nsqd:
        listed_at_start = len(calls)
        depths = {name: topic.channels["c"].depth for name, topic in nsqd.topics.items()}
        nsqd.declare("fresh", "c")  # a new topic and channel have no files to look for
        nsqd.delete_topic("t3")
        left = [name for name in real_listdir(nsqd.data_path)
                if name.startswith(("t3.diskq.", "t3%3Ac.diskq.")) and not name.endswith(".trash")]
        assert not left, left  # every file of the deleted topic's queues went, segments included
        nsqd.declare("t3", "c")  # nor has a topic deleted since, which took its files with it
        listed_after_start = len(calls) - listed_at_start
        assert nsqd.topics["t3"].channels["c"].depth == 0
    assert listed_at_start <= 3  # once for nsqd.dat's queues (3 * TOPICS before), plus the Go takeover's own
    assert listed_after_start == 0  # deleting a queue removes the segments it knows of: no listing
    assert depths == {**{f"t{index}": 1 for index in range(TOPICS)}, "t7": 2, "a.diskq.b": 1}
