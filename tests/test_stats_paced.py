"""A big /stats is taken and rendered in slices, so the event loop serves publishers in between.

With a thousand topics, two thousand channels and a thousand consumers the
whole job takes tens of milliseconds; taken in one go, every publish and
delivery of the daemon waited for it (a PUB's answer took up to 150 ms while
a client polled /stats).
"""

import trio

from nsqd import metrics, stats

from .support import NSQConnection, running_nsqd, tcp_port


class Turns:
    """A task that counts its turns on the event loop."""

    def __init__(self) -> None:
        self.count = 0
        self.on_first_turn = None

    async def run(self) -> None:
        while True:
            self.count += 1
            if self.on_first_turn is not None:
                self.on_first_turn()
                self.on_first_turn = None
            await trio.sleep(0)


async def test_snapshot_and_rendering_let_other_tasks_run_between_topics(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "SLICE", 0)  # a slice a topic
    async with running_nsqd(tmp_path) as nsqd:
        for index in range(40):
            nsqd.declare(f"t{index:02}", "c")
        consumer = await NSQConnection.open(tcp_port(nsqd))
        await consumer.sub("t00", "c")
        whole = stats.snapshot(nsqd)
        turns = Turns()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(turns.run)
            await trio.sleep(0.01)
            before = turns.count
            paced = await stats.snapshot_paced(nsqd)
            taking = turns.count - before
            json_text = await stats.render_json_paced(paced)
            text = await stats.render_text_paced(paced)
            rendering = turns.count - before - taking
            nursery.cancel_scope.cancel()
        assert taking >= 35 and rendering >= 70  # taken in one go, no other task would have run
        assert json_text == stats.render_json(whole)
        assert text.split(b"\n")[3:] == stats.render_text(whole).split(b"\n")[3:]  # past the uptime line
        await consumer.close()


async def test_metrics_are_rendered_a_family_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "SLICE", 0)
    async with running_nsqd(tmp_path) as nsqd:
        for index in range(5):
            nsqd.declare(f"t{index}", "c")
        snapshot = stats.snapshot(nsqd, include_clients=False)
        turns = Turns()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(turns.run)
            await trio.sleep(0.01)
            before = turns.count
            paced = await metrics.render_paced(snapshot, 0)
            rendering = turns.count - before
            nursery.cancel_scope.cancel()
        assert rendering >= 20  # one a metric family of topics or channels
        whole = metrics.render(snapshot, 0).split(b"\n")
        # all but the process's own figures (resident memory and CPU move between the two renders)
        assert [line for line in paced.split(b"\n") if not line.startswith(b"process_")] == \
            [line for line in whole if not line.startswith(b"process_")]


async def test_a_topic_deleted_while_stats_are_taken_is_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "SLICE", 0)
    async with running_nsqd(tmp_path) as nsqd:
        for index in range(10):
            nsqd.declare(f"t{index}", "c")
        turns = Turns()
        turns.on_first_turn = lambda: nsqd.delete_topic("t9")  # after t0 was taken
        async with trio.open_nursery() as nursery:
            nursery.start_soon(turns.run)
            paced = await stats.snapshot_paced(nsqd)
            nursery.cancel_scope.cancel()
        assert [t.topic_name for t in paced.topics] == [f"t{index}" for index in range(9)]


async def test_a_topic_with_thousands_of_channels_is_taken_and_rendered_a_few_channels_at_a_time(tmp_path,
                                                                                               monkeypatch):
    """A topic was one step: with 10,000 channels (made by SUB, no authorization needed) each
    /stats or /metrics held the event loop for 0.2-0.35 s."""
    monkeypatch.setattr(stats, "SLICE", 0)
    monkeypatch.setattr(metrics, "STEP_LINES", 17)  # a channel family's 1,003 lines are 59 steps exactly
    async with running_nsqd(tmp_path) as nsqd:
        for index in range(1000):
            nsqd.declare("fan", f"c{index:04}")
        nsqd.declare("other", "c")
        whole = stats.snapshot(nsqd)
        turns = Turns()
        turns.on_first_turn = lambda: nsqd.delete_channel(nsqd.topics["fan"], "c0999")  # not taken yet
        async with trio.open_nursery() as nursery:
            nursery.start_soon(turns.run)
            before = turns.count
            paced = await stats.snapshot_paced(nsqd)
            taking = turns.count - before
            json_text = await stats.render_json_paced(whole)
            text = await stats.render_text_paced(whole)
            exposition = await metrics.render_paced(whole, 0)
            rendering = turns.count - before - taking
            nursery.cancel_scope.cancel()
        assert taking >= 1000 // stats.STEP_CHANNELS and rendering >= 2 * 1000 // stats.STEP_CHANNELS + 500
        assert b"\n\n" not in exposition  # a family that ends a step exactly left an empty line
        assert [c.channel_name for c in paced.topics[0].channels] == [f"c{index:04}" for index in range(999)]
        assert json_text == stats.render_json(whole)
        assert text.split(b"\n")[3:] == stats.render_text(whole).split(b"\n")[3:]  # past the uptime line
        assert [line for line in exposition.split(b"\n") if not line.startswith(b"process_")] == \
            [line for line in metrics.render(whole, 0).split(b"\n") if not line.startswith(b"process_")]
