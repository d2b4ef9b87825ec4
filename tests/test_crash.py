"""A confirm is a promise: SIGKILL the daemon under load, many times, and lose nothing confirmed.

Each round runs four publishers (MPUB batches, each waiting for its OK) and a
consumer (FIN everything) against a real daemon subprocess, SIGKILLs it at a
random moment, restarts it on the same data directory and drains the round's
topic. Every message whose publish was confirmed must have been received
before the kill or after the restart; duplicates (at-least-once) are counted
and reported at the end of the run.
"""

from __future__ import annotations

import os
import random
import signal

import pytest
import trio

from .support import Daemon, NSQConnection, consume_until_quiet

ROUNDS = int(os.environ.get("NSQD_CRASH_ROUNDS", "20"))
PUBLISHERS = 4
BATCH = 50
#: what every mode lost and repeated, for the summary at the end of the run
REPORT: dict[str, dict[str, int]] = {}


async def publisher(port: int, topic: str, number: int, confirmed: set[bytes]) -> None:
    try:
        conn = await NSQConnection.open(port)
        seq = 0
        while True:
            bodies = [b"%d:%d" % (number, seq + i) for i in range(BATCH)]
            await conn.mpub(topic, bodies)
            confirmed.update(bodies)
            seq += BATCH
    except (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
        return  # the daemon was killed


async def consumer(port: int, topic: str, received: list[bytes], rdy: int = 200) -> None:
    try:
        conn = await NSQConnection.open(port)
        await conn.sub(topic, "c")
        await conn.command(f"RDY {rdy}")
        while True:
            msg = await conn.read_message(timeout=30)
            received.append(msg.body)
            await conn.command(b"FIN " + msg.id)
    except (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
        return


async def crash_rounds(tmp_path, mode: str, args: list[str], seed: int) -> None:
    rng = random.Random(seed)
    report = REPORT.setdefault(mode, {"kills": 0, "confirmed": 0, "lost": 0, "duplicates": 0})
    daemon = Daemon(tmp_path, *args)
    await daemon.wait_ready()
    try:
        for number in range(ROUNDS):
            topic = f"t{number}"
            confirmed: set[bytes] = set()
            before: list[bytes] = []
            async with trio.open_nursery() as nursery:
                # declare the channel first, so every message published reaches it
                setup = await NSQConnection.open(daemon.port)
                await setup.sub(topic, "c")
                await setup.close()
                for p in range(PUBLISHERS):
                    nursery.start_soon(publisher, daemon.port, topic, p, confirmed)
                nursery.start_soon(consumer, daemon.port, topic, before)
                await trio.sleep(rng.uniform(0.2, 0.9))
                daemon.proc.send_signal(signal.SIGKILL)
                await trio.to_thread.run_sync(daemon.proc.wait)
            report["kills"] += 1
            daemon = Daemon(tmp_path, *args)
            await daemon.wait_ready()
            after = await consume_until_quiet(daemon.port, topic)
            seen = set(before) | set(after)
            lost = confirmed - seen
            report["confirmed"] += len(confirmed)
            report["lost"] += len(lost)
            report["duplicates"] += len(before) + len(after) - len(seen)
            assert not lost, f"round {number}: {len(lost)} of {len(confirmed)} confirmed messages lost"
            assert confirmed, f"round {number}: nothing was confirmed before the kill"
    finally:
        daemon.proc.kill()
        daemon.proc.wait()


@pytest.mark.slow
async def test_sigkill_loses_no_confirmed_message_with_memory_queues_off(tmp_path):
    """Go nsqd's "lose nothing" setting: every message is written before its OK."""
    await crash_rounds(tmp_path, "--mem-queue-size=0", ["--mem-queue-size=0"], seed=10)


@pytest.mark.slow
async def test_sigkill_loses_no_confirmed_message_in_durable_mode(tmp_path):
    """Durable mode: OK only after fsync, delivery from memory, in-flight kept across the crash."""
    await crash_rounds(tmp_path, "--durable", ["--durable"], seed=20)
