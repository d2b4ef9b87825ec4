#!/usr/bin/env python3
"""Throughput of the disk queue (nsqd/diskq) on this machine.

Measures, for ``--size`` byte records (200 by default):

* appends/s and MB/s with ``put_many`` batches of ``--batch`` (an MPUB),
  ``sync_every=2500``, the ``run()`` task fsyncing in the background;
* appends/s with single ``put`` calls;
* reads/s and MB/s with ``read_many(--batch)``, draining what was appended;
* confirmed appends/s: ``--writers`` tasks each looping ``put`` then
  ``await wait_durable()`` (group commit) for ``--duration`` seconds.

Each figure is the median of ``--repeat`` runs (min and max shown). Run from
the repository root: ``python bench/diskq_bench.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import structlog
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsqd.diskq import DiskQueue  # noqa: E402


def machine_description(data_dir: Path) -> str:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as meminfo:
        memory_gib = int(meminfo.readline().split()[1]) / (1 << 20)
    mount = max(
        (line.split() for line in open("/proc/mounts")),
        key=lambda fields: len(fields[1]) if str(data_dir.resolve()).startswith(fields[1]) else -1,
    )
    return (
        f"{os.cpu_count()} x {cpu}, {memory_gib:.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}, trio {trio.__version__}, data dir on {mount[2]} ({mount[0]})"
    )


async def appends(data_dir: Path, count: int, size: int, batch: int) -> tuple[float, float]:
    """Returns (put_many records/s, read_many records/s)."""
    payloads = [os.urandom(size) for _ in range(batch)]
    queue = DiskQueue("bench", data_dir, sync_every=2500)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        started = time.perf_counter()
        for _ in range(count // batch):
            queue.put_many(payloads)
            await trio.lowlevel.checkpoint()  # let run() fsync as it would in the daemon
        append_seconds = time.perf_counter() - started

        read = 0
        started = time.perf_counter()
        while records := queue.read_many(batch):
            read += len(records)
            await trio.lowlevel.checkpoint()
        read_seconds = time.perf_counter() - started
        assert read == count // batch * batch, read
        nursery.cancel_scope.cancel()
    queue.delete()
    return read / append_seconds, read / read_seconds


async def single_puts(data_dir: Path, count: int, size: int) -> float:
    payload = os.urandom(size)
    queue = DiskQueue("bench", data_dir, sync_every=2500)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        started = time.perf_counter()
        for index in range(count):
            queue.put(payload)
            if index % 100 == 0:
                await trio.lowlevel.checkpoint()
        seconds = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    queue.delete()
    return count / seconds


async def confirmed_appends(data_dir: Path, size: int, writers: int, duration: float) -> tuple[float, float]:
    """Returns (confirmed records/s, records per fsync round)."""
    payload = os.urandom(size)
    queue = DiskQueue("bench", data_dir, sync_every=2500)
    confirmed = 0
    stop = False

    async def writer() -> None:
        nonlocal confirmed
        while not stop:
            queue.put(payload)
            await queue.wait_durable()
            confirmed += 1

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        async with trio.open_nursery() as writer_tasks:
            for _ in range(writers):
                writer_tasks.start_soon(writer)
            await trio.sleep(0.5)  # warm up
            confirmed_before, syncs_before = confirmed, queue.statistics().syncs
            started = time.perf_counter()
            await trio.sleep(duration)
            seconds = time.perf_counter() - started
            done, syncs = confirmed - confirmed_before, queue.statistics().syncs - syncs_before
            stop = True
        nursery.cancel_scope.cancel()
    queue.delete()
    return done / seconds, done / syncs


def fdatasync_latency(data_dir: Path, rounds: int = 300) -> tuple[float, float]:
    """Median and 90th percentile seconds of one 20 KiB append plus fdatasync: the floor of a commit."""
    path = data_dir / "fdatasync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    block = os.urandom(20 * 1024)
    latencies = []
    try:
        for index in range(rounds):
            os.pwrite(fd, block, index * len(block))
            started = time.perf_counter()
            os.fdatasync(fd)
            latencies.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        path.unlink()
    latencies.sort()
    return statistics.median(latencies), latencies[int(rounds * 0.9)]


def summarize(label: str, samples: list[float], unit: str, size: int | None = None) -> None:
    median = statistics.median(samples)
    line = f"{label:<34} {median:>12,.0f} {unit}"
    if size is not None:
        line += f"  ({median * size / 1e6:,.0f} MB/s payload)"
    line += f"  [min {min(samples):,.0f}, max {max(samples):,.0f}, {len(samples)} runs]"
    print(line, flush=True)


async def main(args: argparse.Namespace) -> None:
    base = Path(args.data_dir) if args.data_dir else Path(tempfile.gettempdir())
    data_dir = Path(tempfile.mkdtemp(prefix="diskq-bench-", dir=base))
    try:
        print(machine_description(data_dir))
        median, p90 = fdatasync_latency(data_dir)
        print(f"fdatasync of a 20 KiB append: median {median * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us")
        print(f"{args.size}-byte records, batches of {args.batch}, sync_every=2500\n", flush=True)
        append_rates, read_rates, put_rates, confirmed_rates, per_sync = [], [], [], [], []
        for _ in range(args.repeat):
            append_rate, read_rate = await appends(data_dir, args.count, args.size, args.batch)
            append_rates.append(append_rate)
            read_rates.append(read_rate)
            put_rates.append(await single_puts(data_dir, args.count // 4, args.size))
        summarize("appends (put_many)", append_rates, "records/s", args.size)
        summarize("appends (put)", put_rates, "records/s", args.size)
        summarize("reads (read_many)", read_rates, "records/s", args.size)
        for _ in range(args.repeat):
            rate, records_per_sync = await confirmed_appends(data_dir, args.size, args.writers, args.duration)
            confirmed_rates.append(rate)
            per_sync.append(records_per_sync)
        summarize(f"confirmed appends ({args.writers} writers)", confirmed_rates, "records/s")
        print(f"{'':<34} {statistics.median(per_sync):>12,.1f} records per fsync round")
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2_000_000, help="records appended then read per run")
    parser.add_argument("--size", type=int, default=200, help="payload bytes per record")
    parser.add_argument("--batch", type=int, default=100, help="records per put_many / read_many")
    parser.add_argument("--writers", type=int, default=100, help="concurrent confirmed writers")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per confirmed run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure")
    parser.add_argument("--data-dir", help="directory to create the queue under (default: system temp dir)")
    return parser.parse_args()


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    trio.run(main, parse_args())
