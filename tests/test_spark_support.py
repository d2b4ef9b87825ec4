"""Shared pieces of the Spark tests: the daemon, one SparkSession, plain NSQ helpers.

Run as a script it is the child process of the crash tests: a streaming query
from a topic into Parquet that optionally stalls on a marked message, so the
parent can SIGKILL it in the middle of a batch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from nsq_spark.client import FRAME_MESSAGE, Connection, body_command, mpub_body  # noqa: E402
from tests.support import Daemon, free_port, wait_for_ports  # noqa: E402

pytestmark = pytest.mark.slow


def spark_env() -> None:
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def new_session():
    """A small local session; Spark's own log stays at errors."""
    spark_env()
    from pyspark.sql import SparkSession

    import nsq_spark

    spark = (SparkSession.builder.master("local[2]").appName("nsq-spark-tests")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.streaming.pollingDelay", "50ms")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    nsq_spark.register(spark)
    return spark


@pytest.fixture(scope="session")
def spark():
    session = new_session()
    yield session
    session.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("nsqd"), "--queue-scan-interval=50ms")
    d.wait_ready_sync()
    yield d
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0


def address(daemon) -> str:
    return f"127.0.0.1:{daemon.port}"


class RestartableDaemon:
    """``python -m nsqd`` that can be stopped (SIGTERM or SIGKILL) and started again on its port and data."""

    def __init__(self, data_path, *args: str) -> None:
        self.data_path = data_path
        self.args = args
        self.port = free_port()
        self.http_port = free_port()
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{self.port}",
             f"--http-address=127.0.0.1:{self.http_port}", "--amqp-address=", f"--data-path={self.data_path}",
             "--log-level=warn", *self.args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # both ports: a test may ask /stats first thing
        wait_for_ports(self.proc, (self.port, self.http_port), lambda: self.proc.stderr.read().decode())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(60)

    def restart(self, sig: int = signal.SIGTERM, pause: float = 0.0) -> None:
        self.stop(sig)
        time.sleep(pause)
        self.start()

    def channel_stats(self, topic: str, channel: str) -> dict:
        """The channel's entry in ``/stats`` (depth, in_flight_count, ...)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/stats?format=json&topic={topic}",
                                    timeout=10) as response:
            stats = json.load(response)
        for t in stats["topics"]:
            for c in t["channels"]:
                if t["topic_name"] == topic and c["channel_name"] == channel:
                    return c
        return {}


def publish(addr: str, topic: str, bodies: list[bytes], chunk: int = 1000) -> None:
    with Connection(addr) as conn:
        for i in range(0, len(bodies), chunk):
            conn.send(body_command(f"MPUB {topic}", mpub_body(bodies[i:i + chunk])))
            conn.expect_ok()


def json_bodies(start: int, stop: int) -> list[bytes]:
    return [json.dumps({"i": i, "key": f"k{i % 5}"}).encode() for i in range(start, stop)]


def consume(addr: str, topic: str, channel: str, idle: float = 1.0) -> list[tuple[bytes, int, bytes]]:
    """Drain a channel as a plain NSQ consumer (FIN every message): ``(id, attempts, body)``.

    Output buffering is off: nsqd may hold a few messages for its 250 ms
    output_buffer_timeout, longer than ``idle``, and they would be given back
    at every call.
    """
    got = []
    with Connection(addr) as conn:
        conn.identify(feature_negotiation=True, output_buffer_timeout=-1)
        conn.subscribe(topic, channel)
        conn.command("RDY 500")
        while True:
            frames = conn.read_frames(idle)
            if not frames:
                return got
            fins = []
            for kind, data in frames:
                assert kind == FRAME_MESSAGE, data
                got.append((data[10:26], int.from_bytes(data[8:10], "big"), data[26:]))
                fins.append(b"FIN " + data[10:26] + b"\n")
            conn.send(b"".join(fins))


def wait_for(predicate, timeout: float, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def committed_rows(path) -> int:
    """Rows in the files a Parquet sink has committed (its _spark_metadata log), without a Spark job."""
    import pyarrow.parquet as pq

    files = set()
    log = Path(path) / "_spark_metadata"
    entries = [e for e in log.iterdir() if not e.name.startswith(".")] if log.is_dir() else []
    for entry in sorted(entries, key=lambda e: int(e.name.split(".")[0])):
        for line in entry.read_text().splitlines()[1:]:
            record = json.loads(line)
            (files.add if record["action"] == "add" else files.discard)(record["path"])
    return sum(pq.ParquetFile(urllib.parse.urlparse(f).path).metadata.num_rows for f in files)


# ---------------------------------------------------------------- child query
def run_query(args: argparse.Namespace) -> None:
    """Topic → Parquet until ``args.expect`` rows are committed; optionally stall on a marked body."""
    spark = new_session()
    from pyspark.sql import functions as F

    reader = spark.readStream.format("nsq").option("nsqd.address", args.address) \
        .option("topic", args.topic).option("channel", args.channel)
    for key, value in json.loads(args.options).items():
        reader = reader.option(key, value)
    df = reader.load()
    if args.stall:
        stall_body, marker = args.stall.encode(), args.marker

        @F.udf("boolean")
        def stall(body):
            if body == stall_body:  # mid-batch: tell the parent, then hang until killed
                Path(marker).touch()
                time.sleep(600)
            return True

        df = df.withColumn("passed", stall("body"))
    query = df.writeStream.format("parquet").option("path", args.out) \
        .option("checkpointLocation", args.checkpoint).start()
    wait_for(lambda: committed_rows(args.out) >= args.expect, args.timeout, 0.2)
    query.stop()
    spark.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("address", "topic", "channel", "out", "checkpoint"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--options", default="{}")
    parser.add_argument("--expect", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--stall", default="")
    parser.add_argument("--marker", default="")
    run_query(parser.parse_args())
