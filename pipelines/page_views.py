#!/usr/bin/env python3
"""Example pipeline: page views from an nsqd topic into Parquet, counted per page and window.

Two streaming queries read the topic, each on its own channel (each channel
gets every message):

* ``counts``  parses the JSON bodies (``{"page": ..., "user": ..., "ms": ...}``),
  counts views, distinct users and mean load time per page per ``--window``
  of publish time, and appends each window to ``<out>/counts`` once the
  watermark has passed it;
* ``archive`` keeps every raw message (id, body, publish time) in
  ``<out>/archive``, partitioned by day: ``pipelines/replay.py`` publishes it
  back into a topic.

Both write Parquet with a checkpoint under ``<out>/_checkpoints``: stop the
script and start it again and each query goes on where it stopped, without
losing or repeating a message (see docs/spark.md, "Semantics").

Locally (``--sample`` publishes that many made-up page views first)::

    python pipelines/page_views.py --nsqd 127.0.0.1:4150 --sample 20000 --seconds 90

On a cluster, the same file with the package shipped alongside::

    spark-submit --master spark://head:7077 --py-files dist/nsq_spark.zip \\
        pipelines/page_views.py --nsqd nsqd-1:4150,nsqd-2:4150 --out s3a://bucket/page_views
"""

from __future__ import annotations

import argparse
import json
import random

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import nsq_spark
from nsq_spark.client import Connection, body_command, mpub_body

VIEW = "page STRING, user STRING, ms INT"


def publish_sample(address: str, topic: str, count: int) -> None:
    """Made-up page views, published in batches of 1000 over a plain connection."""
    pages = ["/", "/pricing", "/docs", "/blog", "/signup"]
    with Connection(address.split(",")[0]) as conn:
        for start in range(0, count, 1000):
            bodies = [json.dumps({"page": random.choice(pages), "user": f"u{random.randrange(500)}",
                                  "ms": random.randrange(20, 900)}).encode()
                      for _ in range(min(1000, count - start))]
            conn.send(body_command(f"MPUB {topic}", mpub_body(bodies)))
            conn.expect_ok()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsqd", default="127.0.0.1:4150", help="nsqd TCP address(es), comma separated")
    parser.add_argument("--topic", default="page_views")
    parser.add_argument("--out", default="data/page_views", help="where Parquet and checkpoints go")
    parser.add_argument("--window", default="1 minute", help="aggregation window (and watermark delay)")
    parser.add_argument("--partitions", type=int, default=2, help="source option numPartitions")
    parser.add_argument("--sample", type=int, default=0, help="publish this many sample page views first")
    parser.add_argument("--seconds", type=float, default=0, help="stop after this long (0: run until stopped)")
    args = parser.parse_args()

    if args.sample:
        publish_sample(args.nsqd, args.topic, args.sample)
    spark = SparkSession.builder.appName("page-views").getOrCreate()
    nsq_spark.register(spark)

    def source(channel: str):
        return (spark.readStream.format("nsq").option("nsqd.address", args.nsqd).option("topic", args.topic)
                .option("channel", channel).option("numPartitions", args.partitions).load())

    def sink(df, name: str, *partition_by: str):
        return (df.writeStream.format("parquet").queryName(name).partitionBy(*partition_by)
                .option("path", f"{args.out}/{name}")
                .option("checkpointLocation", f"{args.out}/_checkpoints/{name}").start())

    views = source("counts").select(F.from_json(F.col("body").cast("string"), VIEW).alias("v"), "timestamp") \
        .select("v.*", "timestamp").where(F.col("page").isNotNull())
    counts = (views.withWatermark("timestamp", args.window)
              .groupBy(F.window("timestamp", args.window), "page")
              .agg(F.count("*").alias("views"), F.approx_count_distinct("user").alias("users"),
                   F.avg("ms").alias("mean_ms"))
              .select(F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                      "page", "views", "users", "mean_ms"))
    archive = source("archive").select("id", "body", "timestamp", F.to_date("timestamp").alias("day"))
    queries = [sink(counts, "counts"), sink(archive, "archive", "day")]
    try:
        spark.streams.awaitAnyTermination(args.seconds or None)
    finally:
        for query in queries:
            query.stop()
    for query in queries:
        if query.exception() is not None:
            raise SystemExit(f"query {query.name} failed: {query.exception()}")
    spark.stop()


if __name__ == "__main__":
    main()
