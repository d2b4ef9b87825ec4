#!/usr/bin/env python3
"""Example pipeline: page views from an nsqd topic into Parquet, counted per page and window.

Two streaming queries read the topic, each on its own channel (each channel
gets every message):

* ``counts``  parses the JSON bodies (``{"page": ..., "user": ..., "ms": ...,
  "ts": <epoch ms>}``), counts views, distinct users and mean load time per
  page per ``--window`` of event time (``ts``, or the publish time when a
  body has none), and appends each window to ``<out>/counts`` once the
  watermark (the latest event time less ``--window``) has passed its end;
* ``archive`` keeps every raw message (id, body, publish time) in
  ``<out>/archive``, partitioned by day: ``pipelines/replay.py`` publishes it
  back into a topic.

Both write Parquet with a checkpoint under ``<out>/_checkpoints``: stop the
script and start it again and each query goes on where it stopped, without
losing or repeating a message (see docs/spark.md, "Semantics"). They keep
running across restarts of the daemon.

Locally (``--sample`` first declares both channels, then publishes that many
made-up page views spread over the last ``--sample-minutes``, so that the
first run already closes windows)::

    python pipelines/page_views.py --sample 20000 --seconds 90

On a cluster, with the package shipped alongside (see README.md)::

    spark-submit --master spark://head:7077 --py-files dist/nsq_spark.zip \\
        pipelines/page_views.py --nsqd nsqd-1:4150,nsqd-2:4150 --out s3a://bucket/page_views
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import datetime

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import nsq_spark
from nsq_spark.client import Connection, body_command, mpub_body

VIEW = "page STRING, user STRING, ms INT, ts BIGINT"
CHANNELS = ("counts", "archive")


def publish_sample(address: str, topic: str, count: int, minutes: float) -> None:
    """Made-up page views over the last ``minutes``, in batches of 1000, after declaring the channels.

    A topic keeps what is published before it has a channel for the first
    channel only: declaring both first makes each get every view.
    """
    for channel in CHANNELS:
        with Connection(address) as conn:
            conn.identify()
            conn.subscribe(topic, channel)
    pages = ["/", "/pricing", "/docs", "/blog", "/signup"]
    now_ms = int(time.time() * 1000)
    first_ms = now_ms - int(minutes * 60_000)
    stamps = sorted(random.randrange(first_ms, now_ms) for _ in range(count))
    with Connection(address) as conn:
        for start in range(0, count, 1000):
            bodies = [json.dumps({"page": random.choice(pages), "user": f"u{random.randrange(500)}",
                                  "ms": random.randrange(20, 900), "ts": ts}).encode()
                      for ts in stamps[start:start + 1000]]
            conn.send(body_command(f"MPUB {topic}", mpub_body(bodies)))
            conn.expect_ok()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsqd", default="127.0.0.1:4150", help="nsqd TCP address(es), comma separated")
    parser.add_argument("--topic", default="page_views")
    parser.add_argument("--out", default="out/page_views",
                        help="where Parquet and checkpoints go (not under the daemon's --data-path)")
    parser.add_argument("--window", default="1 minute", help="aggregation window (and watermark delay)")
    parser.add_argument("--partitions", type=int, default=2, help="source option numPartitions")
    parser.add_argument("--sample", type=int, default=0, help="publish this many sample page views first")
    parser.add_argument("--sample-minutes", type=float, default=10, help="the sample's event times span this long")
    parser.add_argument("--seconds", type=float, default=0, help="stop after this long (0: run until stopped)")
    parser.add_argument("--available-now", action="store_true",
                        help="process what the topic holds now, then stop (Trigger.AvailableNow)")
    parser.add_argument("--log-level", default="ERROR", help="Spark's log level (WARN, INFO, ...)")
    args = parser.parse_args()
    started = time.time()

    if args.sample:
        publish_sample(args.nsqd.split(",")[0], args.topic, args.sample, args.sample_minutes)
    # a few shuffle partitions: Spark's default 200 costs seconds per batch on a small machine
    spark = (SparkSession.builder.appName("page-views")
             .config("spark.sql.shuffle.partitions", str(max(args.partitions, 2)))
             .config("spark.log.level", args.log_level)
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    nsq_spark.register(spark)

    def source(channel: str):
        return (spark.readStream.format("nsq").option("nsqd.address", args.nsqd).option("topic", args.topic)
                .option("channel", channel).option("numPartitions", args.partitions).load())

    def sink(df, name: str, *partition_by: str):
        writer = (df.writeStream.format("parquet").queryName(name).partitionBy(*partition_by)
                  .option("path", f"{args.out}/{name}")
                  .option("checkpointLocation", f"{args.out}/_checkpoints/{name}"))
        if args.available_now:
            writer = writer.trigger(availableNow=True)
        return writer.start()

    views = (source("counts").select(F.from_json(F.col("body").cast("string"), VIEW).alias("v"), "timestamp")
             .select("v.*", F.coalesce(F.timestamp_millis("v.ts"), "timestamp").alias("event_time"))
             .where(F.col("page").isNotNull()))
    counts = (views.withWatermark("event_time", args.window)
              .groupBy(F.window("event_time", args.window), "page")
              .agg(F.count("*").alias("views"), F.approx_count_distinct("user").alias("users"),
                   F.avg("ms").alias("mean_ms"))
              .select(F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                      "page", "views", "users", "mean_ms"))
    archive = source("archive").select("id", "body", "timestamp", F.to_date("timestamp").alias("day"))
    queries = [sink(counts, "counts"), sink(archive, "archive", "day")]
    try:
        if args.available_now:
            for query in queries:
                query.awaitTermination()
        else:
            spark.streams.awaitAnyTermination(args.seconds or None)
    finally:
        for query in queries:
            query.stop()
    for query in queries:
        if query.exception() is not None:
            raise SystemExit(f"query {query.name} failed: {query.exception()}")
        report(query, started)
    spark.stop()


def report(query, started: float) -> None:
    """A line per query: what it read, and when its first batch was committed (seconds after start)."""
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    line = f"{query.name}: {sum(p['numInputRows'] for p in progress)} messages in {len(progress)} batches"
    if progress:
        first = progress[0]
        done = datetime.fromisoformat(first["timestamp"]).timestamp() + first["durationMs"]["triggerExecution"] / 1000
        line += f", the first committed {done - started:.1f} s after start"
    print(line, flush=True)


if __name__ == "__main__":
    main()
