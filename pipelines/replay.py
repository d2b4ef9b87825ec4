#!/usr/bin/env python3
"""Replay job: publish a Parquet archive of messages back into a topic through the nsq sink.

Reads the archive that ``pipelines/page_views.py`` keeps (any Parquet with a
``body`` column will do), optionally only the messages published in a time
range, and writes their bodies to ``--topic`` with ``df.write.format("nsq")``:
each partition publishes over its own connection in MPUB batches. A failed
task is run again and publishes its rows again: the sink is at-least-once, so
consumers of a replay should be idempotent (the message ids are new; keep an
id in the body if consumers must recognise a replayed message).

Locally::

    python pipelines/replay.py --nsqd 127.0.0.1:4150 --archive out/page_views/archive \\
        --topic page_views_replay --since 2024-05-01T00:00:00

On a cluster::

    spark-submit --master spark://head:7077 --py-files dist/nsq_spark.zip \\
        pipelines/replay.py --nsqd nsqd-1:4150 --archive s3a://bucket/page_views/archive --topic page_views
"""

from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import nsq_spark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsqd", default="127.0.0.1:4150", help="nsqd TCP address(es), comma separated")
    parser.add_argument("--archive", default="out/page_views/archive", help="Parquet with a body column")
    parser.add_argument("--topic", default="page_views_replay", help="topic to publish to")
    parser.add_argument("--since", help="only messages published at or after this time (ISO 8601)")
    parser.add_argument("--until", help="only messages published before this time (ISO 8601)")
    parser.add_argument("--partitions", type=int, default=2, help="publish from this many partitions")
    parser.add_argument("--log-level", default="ERROR", help="Spark's log level (WARN, INFO, ...)")
    args = parser.parse_args()

    # the sort's shuffle makes the partitions that publish: a few, not Spark's default 200
    spark = (SparkSession.builder.appName("replay")
             .config("spark.sql.shuffle.partitions", str(args.partitions))
             .config("spark.log.level", args.log_level)
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    nsq_spark.register(spark)
    archive = spark.read.parquet(args.archive)
    if args.since:
        archive = archive.where(F.col("timestamp") >= F.to_timestamp(F.lit(args.since)))
    if args.until:
        archive = archive.where(F.col("timestamp") < F.to_timestamp(F.lit(args.until)))
    bodies = archive.orderBy("timestamp").select("body")
    count = bodies.count()
    bodies.write.format("nsq").option("nsqd.address", args.nsqd).option("topic", args.topic).mode("append").save()
    print(f"replayed {count} messages into {args.topic}")
    spark.stop()


if __name__ == "__main__":
    main()
