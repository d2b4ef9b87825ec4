#!/usr/bin/env python3
"""Rows per second through the nsq source and sink of PySpark, in local mode, beside Spark's own source.

Three phases against one daemon (``--spawn`` starts one on free ports with a
fresh data dir and, unless ``--nsqd-args`` says otherwise, a memory queue
that holds the whole backlog), after a warm-up that runs them with
``--warm-up`` rows (the first jobs of a session pay for JIT compilation and
Python worker start-up, which a long-running pipeline pays once). The phases
run ``--repeat`` times, the source and the rate source in turn first, as
other load on the machine shifts the figures from one run to the next:

* ``sink``    a DataFrame of ``--rows`` rows with ``--size``-byte bodies in
              ``--partitions`` partitions is written to a topic with
              ``df.write.format("nsq")``; rows/s is rows over the write's wall time.
* ``source``  the topic that ``sink`` filled is read by a streaming query with
              ``Trigger.AvailableNow`` into Parquet with a checkpoint (the
              pipeline a user runs); rows/s is rows over the query's wall time
              from ``start()`` to its end, and also over the batches alone
              (Spark's progress reports: what a long-running query sustains).
              With a spawned daemon (or ``--nsqd-pid``) the daemon's CPU time
              per message comes from ``/proc/<pid>/stat``.
* ``rate``    Spark's own ``rate-micro-batch`` source, made into the same six
              columns (a 16-character id, a ``--size``-byte body, timestamp,
              attempts, topic, channel), the same number of rows in batches of
              the same size into Parquet: what Spark itself ingests on this
              machine. The ratio of the two in-batch rates is the figure to watch.

Result lines have a fixed shape::

    sink publish: 123456 rows/s over 8.10 s [2000000 rows, 200 B, 2 partitions]
    source parquet: 123456 rows/s over 8.10 s, 140000 rows/s in batches [2000000 rows, 4 batches]
    source daemon cpu: 0.61 us/msg
    rate-micro-batch parquet: 123456 rows/s over 8.10 s, 140000 rows/s in batches [2000000 rows, 4 batches]
    source / rate-micro-batch: 0.72 in batches, 0.70 over the query
    ... (the next rounds)
    machine: 2 cpus, load average 1.2 before the phases, 2.3 after

A load average well above the daemon's and Spark's own share means other
processes competed for the CPUs and the figures are low.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nsq_bench import free_port  # noqa: E402


def spawn_daemon(data: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{port}", "--http-address=",
                             "--amqp-address=", f"--data-path={data}", "--log-level=warn", *extra], cwd=REPO)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("the daemon did not start")


def session(partitions: int):
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import nsq_spark

    spark = (SparkSession.builder.master(f"local[{partitions}]").appName("nsq-spark-bench")
             .config("spark.sql.shuffle.partitions", str(partitions))
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    nsq_spark.register(spark)
    return spark


def declare_channel(addr: str, topic: str) -> None:
    """Create the source's channel before the sink fills the topic, as a running pipeline's would be."""
    from nsq_spark.client import Connection

    with Connection(addr) as conn:
        conn.identify()
        conn.subscribe(topic, "bench")


def bench_sink(spark, addr: str, topic: str, rows: int, size: int, partitions: int) -> None:
    declare_channel(addr, topic)
    pad = "x" * (size - 12)
    df = spark.range(0, rows, numPartitions=partitions) \
        .selectExpr(f"concat(lpad(CAST(id AS STRING), 12, '0'), '{pad}') AS body").cache()
    df.count()  # build the rows first: the phase measures publishing
    started = time.monotonic()
    df.write.format("nsq").option("nsqd.address", addr).option("topic", topic).mode("append").save()
    elapsed = time.monotonic() - started
    df.unpersist()
    print(f"sink publish: {rows / elapsed:.0f} rows/s over {elapsed:.2f} s "
          f"[{rows} rows, {size} B, {partitions} partitions]", flush=True)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(name: str, spark, query, out: Path, elapsed: float, rows: int) -> tuple[float, float]:
    """Print the phase's line; returns (rows/s over the query, rows/s in batches)."""
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    in_batches = sum(p["numInputRows"] for p in progress)
    batch_seconds = sum(p["durationMs"]["triggerExecution"] for p in progress) / 1000
    written = spark.read.parquet(str(out)).count()
    print(f"{name} parquet: {written / elapsed:.0f} rows/s over {elapsed:.2f} s, "
          f"{in_batches / batch_seconds:.0f} rows/s in batches [{written} rows, {len(progress)} batches]",
          flush=True)
    if written != rows:
        raise SystemExit(f"{name} wrote {written} rows, expected {rows}")
    return written / elapsed, in_batches / batch_seconds


def bench_source(spark, addr: str, topic: str, rows: int, partitions: int, work: Path, options: dict,
                 daemon_pid: int | None) -> tuple[float, float]:
    reader = spark.readStream.format("nsq").option("nsqd.address", addr).option("topic", topic) \
        .option("channel", "bench").option("numPartitions", partitions)
    for key, value in options.items():
        reader = reader.option(key, value)
    cpu = cpu_seconds(daemon_pid) if daemon_pid else 0.0
    started = time.monotonic()
    query = reader.load().writeStream.format("parquet").option("path", str(work / "out")) \
        .option("checkpointLocation", str(work / "ck")).trigger(availableNow=True).start()
    query.awaitTermination()
    elapsed = time.monotonic() - started
    if daemon_pid:
        cpu = cpu_seconds(daemon_pid) - cpu
    figures = report("source", spark, query, work / "out", elapsed, rows)
    if daemon_pid:
        print(f"source daemon cpu: {cpu / rows * 1e6:.2f} us/msg", flush=True)
    return figures


def bench_rate(spark, rows: int, size: int, partitions: int, per_batch: int, work: Path) -> tuple[float, float]:
    """Spark's rate-micro-batch source with the nsq source's columns, into Parquet, until ``rows`` are in."""
    batches = -(-rows // per_batch)
    started = time.monotonic()
    query = spark.readStream.format("rate-micro-batch").option("rowsPerBatch", min(per_batch, rows)) \
        .option("numPartitions", partitions).load() \
        .selectExpr("lpad(hex(value), 16, '0') AS id",
                    f"CAST(concat(lpad(CAST(value AS STRING), 12, '0'), repeat('x', {size - 12})) AS BINARY) AS body",
                    "timestamp", "1 AS attempts", "'spark_bench' AS topic", "'bench' AS channel") \
        .writeStream.format("parquet").option("path", str(work / "out")) \
        .option("checkpointLocation", str(work / "ck")).start()
    while query.lastProgress is None or query.lastProgress["batchId"] < batches - 1:
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    query.stop()
    return report("rate-micro-batch", spark, query, work / "out", elapsed, batches * min(per_batch, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsqd-tcp-address", help="an nsqd to use instead of --spawn")
    parser.add_argument("--nsqd-pid", type=int, help="that daemon's pid, for its CPU time per message")
    parser.add_argument("--spawn", action="store_true", help="start a daemon on free ports with a fresh data dir")
    parser.add_argument("--nsqd-args", default="--mem-queue-size=4000000",
                        help="daemon flags with --spawn (default: the backlog stays in memory, as a channel whose "
                             "consumer keeps up; give '' for nsqd's defaults, which spill it to disk)")
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--size", type=int, default=200, help="body bytes")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--topic", default="spark_bench")
    parser.add_argument("--warm-up", type=int, default=500_000,
                        help="rows sent through every phase first, so the JVM (its JIT) and the Python workers "
                             "are warm, as in a long-running pipeline (0: none)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="rounds of sink, source and rate-micro-batch (the last two in turn first)")
    parser.add_argument("--max-in-flight", default="2500", help="source option maxInFlight")
    parser.add_argument("--max-per-trigger", default="500000", help="source option maxMessagesPerTrigger")
    parser.add_argument("--max-trigger-delay", default="30s", help="source option maxTriggerDelay")
    args = parser.parse_args()
    if not args.spawn and not args.nsqd_tcp_address:
        parser.error("give --spawn or --nsqd-tcp-address")

    work = Path(tempfile.mkdtemp(prefix="spark_bench_"))
    daemon = None
    try:
        if args.spawn:
            daemon, addr = spawn_daemon(work / "nsqd", args.nsqd_args.split())
        else:
            addr = args.nsqd_tcp_address
        spark = session(args.partitions)
        options = {"maxInFlight": args.max_in_flight, "maxMessagesPerTrigger": args.max_per_trigger,
                   "maxTriggerDelay": args.max_trigger_delay}
        pid = daemon.pid if daemon is not None else args.nsqd_pid
        per_batch = int(args.max_per_trigger)
        if args.warm_up:
            print(f"warm-up: {args.warm_up} rows through each phase", flush=True)
            bench_sink(spark, addr, f"{args.topic}_warm", args.warm_up, args.size, args.partitions)
            bench_source(spark, addr, f"{args.topic}_warm", args.warm_up, args.partitions, work / "warm", options,
                         None)
            bench_rate(spark, args.warm_up, args.size, args.partitions, per_batch, work / "warm_rate")
        load = os.getloadavg()[0]
        ratios = []
        for round_ in range(args.repeat):
            topic = f"{args.topic}_{round_}"
            bench_sink(spark, addr, topic, args.rows, args.size, args.partitions)

            def source():
                return bench_source(spark, addr, topic, args.rows, args.partitions, work / f"source{round_}",
                                    options, pid)

            def rate():
                return bench_rate(spark, args.rows, args.size, args.partitions, per_batch, work / f"rate{round_}")

            if round_ % 2:
                theirs, ours = rate(), source()
            else:
                ours, theirs = source(), rate()
            ratios.append((ours[1] / theirs[1], ours[0] / theirs[0]))
            print(f"source / rate-micro-batch: {ratios[-1][0]:.2f} in batches, {ratios[-1][1]:.2f} over the query",
                  flush=True)
        print(f"machine: {os.cpu_count()} cpus, load average {load:.1f} before the phases, "
              f"{os.getloadavg()[0]:.1f} after", flush=True)
        spark.stop()
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
