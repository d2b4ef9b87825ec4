"""A queue writer for crash tests: killed with SIGKILL at a random moment.

Usage: python -m tests.diskq_helpers.crash_writer DATA_DIR FIRST_SEQ MODE SEED

It prints ``s <seq>`` once the queue is open. MODE ``durable`` puts
batches, waits for durability and prints ``d <seq>`` for the last confirmed
record, while a consumer task reads and prints ``c <seq>`` for the last
record it consumed. MODE ``written`` only puts, and prints ``w <seq>`` for
the last record of each put once it returned (written to the OS: a process
crash must not lose it).
"""

import random
import sys

import structlog
import trio

from nsqd.diskq import DiskQueue

QUEUE_NAME = "crash:test#1"
QUEUE_OPTIONS = {"max_bytes_per_file": 64 * 1024, "sync_every": 300, "sync_timeout": 0.05}


def make_payload(seq: int) -> bytes:
    """Deterministic content, so the test can tell a record from garbage."""
    filler = random.Random(seq).randbytes(seq % 397)
    return seq.to_bytes(8, "big") + filler


async def produce(queue: DiskQueue, seq: int, rng: random.Random, durable: bool) -> None:
    while True:
        batch = [make_payload(seq + n) for n in range(rng.randrange(1, 40))]
        if len(batch) == 1:
            queue.put(batch[0])
        else:
            queue.put_many(batch)
        seq += len(batch)
        if durable:
            await queue.wait_durable()
            print("d", seq - 1, flush=True)
        else:
            print("w", seq - 1, flush=True)
            await trio.sleep(0)


async def consume(queue: DiskQueue, rng: random.Random) -> None:
    last = None
    while True:
        for record in queue.read_many(rng.randrange(1, 30)):
            seq = int.from_bytes(record[:8], "big")
            assert record == make_payload(seq), "garbage record"
            assert last is None or seq == last + 1, "out of order"
            last = seq
        if last is not None:
            print("c", last, flush=True)
        await trio.sleep(0.001)


async def main(data_dir: str, first_seq: int, mode: str, seed: int) -> None:
    rng = random.Random(seed)
    queue = DiskQueue(QUEUE_NAME, data_dir, **QUEUE_OPTIONS)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        print("s", first_seq, flush=True)
        nursery.start_soon(produce, queue, first_seq, rng, mode == "durable")
        if mode == "durable":
            nursery.start_soon(consume, queue, random.Random(seed + 1))


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout carries the protocol
    trio.run(main, sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
