"""The nsq sink, in real PySpark (local mode); what it published is read back by a plain NSQ consumer."""

from __future__ import annotations

import json

import pytest

from .test_spark_support import address, consume, daemon, json_bodies, publish, spark, wait_for  # noqa: F401

pytestmark = pytest.mark.slow


def test_batch_sink_publishes_a_dataframe(spark, daemon):
    addr = address(daemon)
    consume(addr, "out1", "check", idle=0.1)  # the channel exists before the publishing
    df = spark.range(0, 5000, numPartitions=2).selectExpr("to_json(named_struct('n', id)) AS body")
    df.write.format("nsq").option("nsqd.address", addr).option("topic", "out1").mode("append").save()
    got = consume(addr, "out1", "check")
    assert sorted(json.loads(body)["n"] for _, _, body in got) == list(range(5000))


def test_topic_column_and_deferred_rows(spark, daemon):
    addr = address(daemon)
    for topic in ("out2a", "out2b"):
        consume(addr, topic, "check", idle=0.1)
    # deferred long enough that the first reads end before it is due, even when Spark's tasks are slow
    rows = [(b"a%d" % i, "out2a" if i % 2 else "out2b", 0) for i in range(10)] + [(b"late", "out2a", 6000)]
    spark.createDataFrame(rows, "body binary, topic string, deferMs int").write.format("nsq") \
        .option("nsqd.address", addr).mode("append").save()
    assert sorted(b for _, _, b in consume(addr, "out2a", "check", idle=0.5)) == [b"a1", b"a3", b"a5", b"a7", b"a9"]
    assert len(consume(addr, "out2b", "check", idle=0.5)) == 5
    assert [b for _, _, b in consume(addr, "out2a", "check", idle=7.0)] == [b"late"]


def test_stream_to_stream_through_the_sink(spark, daemon, tmp_path):
    addr = address(daemon)
    consume(addr, "out3", "check", idle=0.1)
    publish(addr, "in3", json_bodies(0, 2000))
    query = (spark.readStream.format("nsq").option("nsqd.address", addr).option("topic", "in3")
             .option("channel", "spark").option("numPartitions", 2).load()
             .selectExpr("upper(CAST(body AS STRING)) AS body")
             .writeStream.format("nsq").option("nsqd.address", addr).option("topic", "out3")
             .option("checkpointLocation", str(tmp_path / "ck")).start())
    got = []
    try:
        wait_for(lambda: got.extend(consume(addr, "out3", "check", idle=0.2)) or len(got) >= 2000, 90)
    finally:
        query.stop()
    assert sorted(json.loads(b)["I"] for _, _, b in got) == list(range(2000))


@pytest.mark.parametrize("columns, message", [
    ("CAST(id AS STRING) AS payload", "got column 'payload'"),
    ("id AS body", "column 'body' must be binary or string"),
    ("CAST(id AS STRING) AS body", "needs option 'topic' or a 'topic' column"),
])
def test_sink_column_errors(spark, daemon, columns, message):
    with pytest.raises(Exception, match=message):
        spark.range(3).selectExpr(columns).write.format("nsq").option("nsqd.address", address(daemon)) \
            .mode("append").save()


def test_error_response_fails_the_write(spark, daemon):
    df = spark.createDataFrame([("ok",), ("x" * (1024 * 1024 + 1),)], "body string")  # over --max-msg-size
    with pytest.raises(Exception, match="E_BAD_MESSAGE"):
        df.write.format("nsq").option("nsqd.address", address(daemon)).option("topic", "out5") \
            .mode("append").save()


def test_an_invalid_topic_option_is_refused_before_publishing(spark, daemon):
    addr = address(daemon)
    consume(addr, "bad", "check", idle=0.1)
    with pytest.raises(Exception, match="option 'topic' is 'bad topic!', not a valid nsq topic name"):
        spark.createDataFrame([("a",)], "body string").write.format("nsq").option("nsqd.address", addr) \
            .option("topic", "bad topic!").mode("append").save()
    assert consume(addr, "bad", "check", idle=0.3) == []


def test_a_row_with_an_invalid_topic_fails_the_write_naming_the_row(spark, daemon):
    addr = address(daemon)
    consume(addr, "orders_us", "check", idle=0.1)
    rows = [("a", "orders_us"), ("b", "orders_us extra"), ("c", "orders_us")]
    with pytest.raises(Exception, match="row 1 of partition 0 has topic 'orders_us extra', not a valid nsq topic"):
        spark.createDataFrame(rows, "body string, topic string").coalesce(1).write.format("nsq") \
            .option("nsqd.address", addr).mode("append").save()
    assert consume(addr, "orders_us", "check", idle=0.3) == []  # not even the good rows of that batch


def test_overwrite_is_not_a_mode_of_the_sink(spark, daemon):
    with pytest.raises(Exception, match=r"cannot overwrite a topic: use mode\('append'\)"):
        spark.createDataFrame([("a",)], "body string").write.format("nsq").option("nsqd.address", address(daemon)) \
            .option("topic", "out6").mode("overwrite").save()
