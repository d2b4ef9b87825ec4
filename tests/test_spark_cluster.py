"""The example pipeline on a real standalone Spark cluster, as the README sends it there.

A master and one worker are started from pyspark's bundled ``spark-class`` on
loopback, the package is zipped as the README says, and ``spark-submit
--py-files`` runs ``pipelines/page_views.py`` (``--available-now``) against a
daemon holding known page views. The archive must hold exactly what was
published and the counts must match the views of every window that closed.
Every process is started in its own session and killed with it afterwards.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nsq_spark.client import Connection

from .test_spark_support import REPO, address, daemon, publish, wait_for  # noqa: F401
from tests.support import free_port

pytestmark = pytest.mark.slow

SPARK_HOME = Path(__import__("pyspark").__file__).parent
WINDOW_MS = 60_000


def spark_env() -> dict:
    """A cluster node's environment: no PYTHONPATH (the package comes with --py-files), our python."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_HOME")}
    env.update(SPARK_HOME=str(SPARK_HOME), PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
               SPARK_NO_DAEMONIZE="1")
    return env


def _die_with_parent() -> None:
    """Linux's PR_SET_PDEATHSIG: the child is killed when the test process dies, however it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class Processes:
    """Processes each in a session of its own, all killed (with their children) by :meth:`kill_all`.

    Should the test process itself be killed, they go with it (:func:`_die_with_parent`).
    """

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *argv: str, cwd=REPO) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, cwd=cwd, env=spark_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)


def page_views(count: int, minutes: int) -> list[dict]:
    now = int(time.time() * 1000)
    pages = ["/", "/pricing", "/docs", "/blog", "/signup"]
    return [{"page": pages[i % 5], "user": f"u{i % 37}", "ms": 20 + i % 400,
             "ts": now - minutes * 60_000 + i * minutes * 60_000 // count} for i in range(count)]


def test_the_example_pipeline_on_a_standalone_cluster(daemon, tmp_path):
    addr = address(daemon)
    topic = "page_views_cluster"
    for channel in ("counts", "archive"):  # declared before publishing, as publish_sample does
        with Connection(addr) as conn:
            conn.identify()
            conn.subscribe(topic, channel)
    views = page_views(3000, 6)
    bodies = [json.dumps(v).encode() for v in views]
    publish(addr, topic, bodies)

    (tmp_path / "dist").mkdir()
    with zipfile.ZipFile(tmp_path / "dist" / "nsq_spark.zip", "w") as zf:  # python -m zipfile -c ... nsq_spark/
        for path in sorted((REPO / "nsq_spark").glob("*.py")):
            zf.write(path, f"nsq_spark/{path.name}")
    master_port, master_ui = free_port(), free_port()
    master = f"spark://127.0.0.1:{master_port}"
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    procs = Processes(tmp_path)
    try:
        procs.start("master", spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(master_port), "--webui-port", str(master_ui))
        procs.start("worker", spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                    "--webui-port", str(free_port()), "--cores", "2", "--memory", "1g",
                    "--work-dir", str(tmp_path / "work"), master)

        def alive_workers() -> int:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{master_ui}/json/", timeout=2) as response:
                    return json.load(response)["aliveworkers"]
            except (OSError, ValueError):  # not listening yet, or a starting UI's empty answer
                return 0

        assert wait_for(alive_workers, 90, 0.25), (tmp_path / "worker.log").read_text()[-3000:]
        submit = procs.start(
            "submit", str(SPARK_HOME / "bin" / "spark-submit"), "--master", master,
            "--conf", "spark.executor.memory=512m", "--conf", "spark.ui.enabled=false",
            "--py-files", str(tmp_path / "dist" / "nsq_spark.zip"), str(REPO / "pipelines" / "page_views.py"),
            "--nsqd", addr, "--topic", topic, "--available-now", "--out", str(tmp_path / "out"))
        assert submit.wait(240) == 0, (tmp_path / "submit.log").read_text()[-5000:]
    finally:
        procs.kill_all()

    archive = pq.read_table(tmp_path / "out" / "archive")
    assert sorted(archive.column("body").to_pylist()) == sorted(bodies)
    assert len(set(archive.column("id").to_pylist())) == len(bodies)

    expected = Counter((v["ts"] // WINDOW_MS * WINDOW_MS, v["page"]) for v in views)
    counts = pq.read_table(tmp_path / "out" / "counts")
    starts = counts.column("window_start").cast(pa.timestamp("ms")).cast(pa.int64()).to_pylist()  # UTC
    got = {(start, page): n for start, page, n in
           zip(starts, counts.column("page").to_pylist(), counts.column("views").to_pylist())}
    assert got and all(expected[key] == n for key, n in got.items())
    watermark = max(v["ts"] for v in views) - WINDOW_MS
    closed = {key for key in expected if key[0] + 2 * WINDOW_MS <= watermark}
    assert closed and closed <= got.keys()  # every window well behind the watermark was written
