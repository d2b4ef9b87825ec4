"""Crash safety: a real writer process is SIGKILLed at random moments.

After every kill the queue is reopened: every record confirmed by
wait_durable(), and every record whose put returned, must be there (or have
been consumed before the kill), in order, with no gap, no duplicate and no
garbage.
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nsqd.diskq import DiskQueue
from tests.diskq_helpers.crash_writer import QUEUE_NAME, QUEUE_OPTIONS, make_payload

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def start_writer(data_dir, first_seq, mode, seed, log_path, stdout):
    with open(log_path, "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.diskq_helpers.crash_writer", str(data_dir), str(first_seq), mode, str(seed)],
            cwd=PROJECT_ROOT,
            stdout=stdout,
            stderr=log,
            text=True,
            env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
        )


def run_and_kill(data_dir, first_seq, mode, seed, delay):
    """Start the writer, SIGKILL it ``delay`` seconds after its first output; returns its lines."""
    log_path = data_dir.parent / "writer.log"
    process = start_writer(data_dir, first_seq, mode, seed, log_path, subprocess.PIPE)
    lines = []
    started = threading.Event()

    def collect():
        for line in process.stdout:
            if line.endswith("\n"):  # the kill may cut the last line short
                lines.append(line.split())
                started.set()

    collector = threading.Thread(target=collect)
    collector.start()
    assert started.wait(30), log_path.read_text()
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait()
    collector.join()
    assert process.returncode == -signal.SIGKILL, log_path.read_text()
    return lines


def recovered_sequence(data_dir):
    queue = DiskQueue(QUEUE_NAME, data_dir, **QUEUE_OPTIONS)
    depth = queue.depth
    seqs = []
    while chunk := queue.read_many(500):
        for record in chunk:
            seq = int.from_bytes(record[:8], "big")
            assert record == make_payload(seq), f"garbage record after seq {seqs[-1:] or None}"
            seqs.append(seq)
    assert depth == len(seqs)
    queue.close()
    return seqs


def check_round(seqs, first_seq, lines):
    confirmed = [int(value) for kind, value in lines if kind in ("d", "w")]
    consumed = [int(value) for kind, value in lines if kind == "c"]
    if seqs:
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "gap, duplicate or reordering"
        assert first_seq <= seqs[0] <= (consumed[-1] + 1 if consumed else first_seq)
    if confirmed:
        assert seqs, f"confirmed up to {confirmed[-1]} but nothing recovered"
        assert seqs[-1] >= confirmed[-1], f"lost confirmed records {seqs[-1] + 1}..{confirmed[-1]}"
    elif consumed:
        assert not seqs or seqs[0] <= consumed[-1] + 1


@pytest.mark.slow
def test_sigkill_never_loses_confirmed_records(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    rng = random.Random(20240611)
    rounds = [("durable", rng.uniform(0.0, 0.5)) for _ in range(6)]
    rounds += [("written", rng.uniform(0.05, 0.3)) for _ in range(3)]
    confirmations = 0
    for number, (mode, delay) in enumerate(rounds):
        first_seq = number * 10_000_000
        lines = run_and_kill(data_dir, first_seq, mode, seed=number, delay=delay)
        seqs = recovered_sequence(data_dir)
        check_round(seqs, first_seq, lines)
        confirmations += sum(1 for kind, _ in lines if kind in ("d", "w"))
        if mode == "written" and seqs:
            assert seqs[0] == first_seq, "a writer's first records are lost or reordered"
    assert confirmations > 0


def test_killed_during_open_and_recovery(tmp_path):
    """Kill soon after start, often while the queue is still being opened and repaired."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    run_and_kill(data_dir, 0, "durable", seed=99, delay=0.3)
    for number in range(1, 4):
        process = start_writer(
            data_dir, number * 10_000_000, "written", number, tmp_path / "writer.log", subprocess.DEVNULL
        )
        time.sleep(0.1 * number)
        process.send_signal(signal.SIGKILL)
        process.wait()
    run_and_kill(data_dir, 4 * 10_000_000, "written", seed=4, delay=0.2)
    seqs = recovered_sequence(data_dir)
    runs = [seq // 10_000_000 for seq in seqs]
    assert runs == sorted(runs)
    assert 4 in runs, "the last writer never got to write"
    for run in set(runs):
        mine = [seq for seq in seqs if seq // 10_000_000 == run]
        first = mine[0] if run == 0 else run * 10_000_000  # run 0 had a consumer
        assert mine == list(range(first, first + len(mine)))
