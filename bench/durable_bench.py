#!/usr/bin/env python3
"""Durable mode against default flags, in one run: what fsync-before-OK costs a publisher.

Spawns a daemon with default flags and one with ``--durable`` in turn
(``--rounds`` times, interleaved, each on a fresh data dir) and loads each
with ``nsq_bench.py``'s publishers, 200-byte messages:

* ``mpub``: ``--mpub-writers`` (4) publishers, each in its own process (as
  Go's ``bench_writer`` runs a goroutine per connection), sending an MPUB of
  ``--batch`` (200) and waiting for its ``OK`` before the next;
* ``pub``: ``--pub-writers`` (100) publishers sending single PUBs, spread
  over ``--pub-procs`` (2) processes, each waiting for its ``OK``.

Every figure is printed with the daemon's CPU µs per message (from /proc)
and its fsyncs per second (``/metrics``); the summary gives durable /
default per round and checks the goals: durable MPUB at 80% of the default
rate, 60,000 durable single PUBs a second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nsq_bench  # noqa: E402  (the generator this bench drives)

GOALS = {"mpub": ("ratio", 0.8), "pub": ("durable msgs/s", 60_000)}


def load(opts, mode: str, durable: bool, args) -> dict:
    """One daemon, one load; returns msgs/s, µs/msg and fsyncs/s."""
    daemon = nsq_bench.Daemon(["--durable"] if durable else [], keep=False)
    try:
        opts.address, opts.http_address = daemon.address, "%s:%d" % daemon.http_address
        if mode == "mpub":
            opts.batch, opts.procs, writers = args.batch, args.mpub_writers, args.mpub_writers
        else:
            opts.batch, opts.procs, writers = 1, args.pub_procs, args.pub_writers
        topic = f"durable_bench_{mode}"
        nsq_bench.ensure_channel(opts.address, topic, opts.channel, opts.features)
        name = f"{mode} {'durable' if durable else 'default'}"
        out = nsq_bench.run_phase(opts, daemon.pid, name, topic, writers=writers)
    finally:
        daemon.stop()
    return {"rate": out["pub"]["rate"], "us": out["daemon"]["us_per_msg"], "fsyncs": out.get("fsyncs", 0.0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="interleaved default/durable pairs per load")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per load")
    p.add_argument("--loads", default="mpub,pub", help="mpub, pub or both (comma-separated)")
    p.add_argument("--batch", type=int, default=200, help="messages per MPUB")
    p.add_argument("--mpub-writers", type=int, default=4, help="MPUB publishers, one process each")
    p.add_argument("--pub-writers", type=int, default=100, help="single-PUB publishers")
    p.add_argument("--pub-procs", type=int, default=2, help="processes the single-PUB publishers are spread over")
    args = p.parse_args(argv)
    opts = nsq_bench.parse_args(["--duration", str(args.duration)])
    opts.features, opts.features_label = {}, "plain"
    loads = [mode for mode in args.loads.split(",") if mode]
    results: dict[str, list[tuple[dict, dict]]] = {mode: [] for mode in loads}
    try:
        for _ in range(args.rounds):
            for mode in loads:
                default = load(opts, mode, False, args)
                durable = load(opts, mode, True, args)
                results[mode].append((default, durable))
    except (nsq_bench.BenchError, OSError) as exc:
        print(f"durable_bench: error: {exc}", file=sys.stderr)
        return 1
    print("\nsummary (200-byte messages; us/msg is the daemon's CPU a message)")
    print(f"{'load':<6}{'default msgs/s':>16}{'us/msg':>8}{'fsyncs/s':>10}"
          f"{'durable msgs/s':>16}{'us/msg':>8}{'fsyncs/s':>10}{'ratio':>7}")
    for mode, pairs in results.items():
        for default, durable in pairs:
            print(f"{mode:<6}{default['rate']:>16.0f}{default['us']:>8.2f}{default['fsyncs']:>10.0f}"
                  f"{durable['rate']:>16.0f}{durable['us']:>8.2f}{durable['fsyncs']:>10.0f}"
                  f"{durable['rate'] / default['rate']:>7.2f}")
        kind, goal = GOALS[mode]
        if kind == "ratio":
            got = statistics.median(d["rate"] / n["rate"] for n, d in pairs)
            print(f"{mode:<6}goal: durable at {goal:.0%} of the default rate; median {got:.2f}: "
                  f"{'met' if got >= goal else 'not met'}")
        else:
            got = statistics.median(d["rate"] for _, d in pairs)
            print(f"{mode:<6}goal: {goal:,} durable msgs/s; median {got:,.0f}: {'met' if got >= goal else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
