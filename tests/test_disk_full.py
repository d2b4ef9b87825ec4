"""A full disk never kills the daemon: publishes are refused, nothing confirmed is lost.

The data directory is a real tmpfs of a few MiB, filled by publishing (and a
ballast file); the daemon is a real subprocess. Mounting needs root: where it
fails the tests are skipped with that reason.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess

import pytest
import trio

from .conftest import HTTPClient
from .support import Daemon, NSQConnection, consume_distinct, consume_until_quiet, free_port, mpub_body


@pytest.fixture
def small_fs(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the disk-full test: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def grow(mount_point, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mount_point)], check=True)


async def fill_up(conn: NSQConnection, topic: str, confirmed: list[bytes]) -> bytes:
    """MPUB until the daemon refuses; returns the error frame."""
    for batch in range(10_000):
        bodies = [b"%06d-%04d" % (batch, i) + b"." * 200 for i in range(20)]
        await conn.command(f"MPUB {topic}", _mpub(bodies))
        kind, data = await conn.read_non_heartbeat()
        if kind == 1:
            return data
        assert data == b"OK"
        confirmed += bodies
    raise AssertionError("the disk never filled up")


async def fill_last_page(conn: NSQConnection, topic: str, confirmed: list[bytes]) -> None:
    """Single small PUBs until refused: an MPUB refused may leave part of a page free."""
    for n in range(10_000):
        body = b"small-%05d" % n
        await conn.command(f"PUB {topic}", body)
        kind, data = await conn.read_non_heartbeat()
        if kind == 1:
            assert data.startswith(b"E_PUB_FAILED PUB failed"), data
            return
        confirmed.append(body)
    raise AssertionError("the last page never filled up")


def _mpub(bodies):
    from .support import mpub_body

    return mpub_body(bodies)


async def test_full_disk_refuses_publishes_keeps_serving_and_recovers(small_fs):
    http_port = free_port()
    args = ["--mem-queue-size=0", "--max-bytes-per-file=262144", "--sync-timeout=200ms",
            f"--http-address=127.0.0.1:{http_port}"]
    daemon = Daemon(small_fs, *args)
    await daemon.wait_ready()
    http = HTTPClient(http_port)
    try:
        conn = await NSQConnection.open(daemon.port)
        await conn.sub("t", "c")
        confirmed: list[bytes] = []
        error = await fill_up(conn, "t", confirmed)
        assert error.startswith(b"E_MPUB_FAILED MPUB failed cannot store") and b"No space left" in error
        await conn.command("NOP")  # non-fatal: the connection is still usable
        ping = await http.get("/ping")
        assert ping.status == 500 and ping.body.startswith(b"NOK - ") and b"No space left" in ping.body

        # the last free page taken by small messages, a new topic and a new channel while full:
        # refused, and the daemon lives on
        await fill_last_page(conn, "t", confirmed)
        other = await NSQConnection.open(daemon.port)
        await other.command("PUB brand-new", b"x")
        await other.expect_error("E_PUB_FAILED PUB failed")
        response = await http.post("/channel/create?topic=t&channel=late")
        assert response.status in (200, 503)
        response = await http.post("/pub?topic=t", b"y")
        assert response.status == 503 and response.json()["message"].startswith("PUB_FAILED: ")
        assert daemon.proc.poll() is None
        with trio.fail_after(4):  # nsqd.dat cannot be saved: the pause holds in memory, answered all the same
            assert (await http.post("/channel/pause?topic=t&channel=c")).status == 200
            assert (await http.post("/channel/unpause?topic=t&channel=c")).status == 200

        # space comes back: publishing works again and /ping says OK once more
        grow(small_fs, "64m")
        await conn.mpub("t", [b"after"])
        confirmed.append(b"after")
        with trio.fail_after(10):
            while (await http.get("/ping")).status != 200:
                await trio.sleep(0.2)
    finally:
        if daemon.proc.poll() is None:
            assert await daemon.stop() == 0

    daemon = Daemon(small_fs, *args)
    await daemon.wait_ready()
    conn = await NSQConnection.open(daemon.port)
    await conn.sub("t", "c")
    await conn.command("RDY 500")
    got = set()
    while len(got) < len(confirmed):
        msg = await conn.read_message()
        got.add(msg.body)
        await conn.command(b"FIN " + msg.id)
    assert got == set(confirmed)
    assert await daemon.stop() == 0


@pytest.mark.parametrize("mode,kill", [("--mem-queue-size=0", None), ("--durable", "before"),
                                       ("--mem-queue-size=0", "midway"), ("--mem-queue-size=0", "defer")])
async def test_a_backlog_that_filled_the_disk_reaches_its_consumers_and_gives_the_room_back(small_fs, mode, kill):
    """Published before any channel existed, the backlog is all in the topic's queue. Copying it to
    the new channel needs room the disk lacks, and only reading it would make room: the daemon
    lends it to the channel in memory, and the space comes back once it is read. One segment holds
    it all (the default --max-bytes-per-file), so the room comes back only if a drained segment goes.
    A SIGKILL before or while it is read loses nothing."""
    http_port = free_port()
    args = [mode, "--sync-timeout=200ms", f"--http-address=127.0.0.1:{http_port}"]
    daemon = Daemon(small_fs, *args)
    await daemon.wait_ready()
    http = HTTPClient(http_port)

    async def restart():
        nonlocal daemon
        daemon.proc.kill()
        await trio.to_thread.run_sync(daemon.proc.wait, 10)
        daemon = Daemon(small_fs, *args)
        await daemon.wait_ready()

    try:
        conn = await NSQConnection.open(daemon.port)
        confirmed: list[bytes] = []
        error = await fill_up(conn, "t", confirmed)
        assert b"No space left" in error and len(confirmed) > 2000
        if kill == "before":  # killed, and started again on the full disk
            await restart()
        conn = await NSQConnection.open(daemon.port)
        await conn.sub("t", "c")
        await conn.command("RDY 300")
        got = set()
        with trio.fail_after(60):
            while len(got) < len(confirmed):
                msg = await conn.read_message()
                got.add(msg.body)
                if kill == "defer" and len(got) % 1000 == 1:  # held for ten minutes: the rest goes on
                    await conn.command(b"REQ " + msg.id + b" 600000")
                else:
                    await conn.command(b"FIN " + msg.id)
                if kill == "midway" and len(got) == len(confirmed) // 2:
                    await trio.sleep(0.5)  # a checkpoint or two of what was finished
                    await restart()
                    kill = None
                    conn = await NSQConnection.open(daemon.port)
                    await conn.sub("t", "c")
                    await conn.command("RDY 300")
        assert got == set(confirmed)
        if kill == "defer":
            return  # the deferred ones hold their records (and the segment) for ten minutes
        with trio.fail_after(15):  # the drained segments went: /ping is OK and publishing works again
            while (await http.get("/ping")).status != 200:
                await trio.sleep(0.2)
        await conn.command("MPUB t", mpub_body([b"after"]))
        frames = {await conn.read_non_heartbeat() for _ in range(2)}  # durable: delivered before its OK
        assert (0, b"OK") in frames and any(kind == 2 and data.endswith(b"after") for kind, data in frames)
        stats = (await http.get("/stats?format=json")).json()
        topic = stats["topics"][0]
        assert topic["depth"] == 0 and topic["channels"][0]["depth"] == 0
    finally:
        if daemon.proc.poll() is None:
            assert await daemon.stop() == 0


async def test_emptying_a_topic_keeps_what_it_lent_its_channels_through_a_crash(small_fs):
    """/topic/empty drops the topic's own backlog, as in Go; the copies it lent its channels on the
    full disk are the channels' now, and their only disk copy is the topic's records."""
    http_port = free_port()
    args = ["--mem-queue-size=0", "--sync-timeout=200ms", f"--http-address=127.0.0.1:{http_port}"]
    daemon = Daemon(small_fs, *args)
    await daemon.wait_ready()
    http = HTTPClient(http_port)
    try:
        conn = await NSQConnection.open(daemon.port)
        confirmed: list[bytes] = []
        await fill_up(conn, "t", confirmed)
        assert (await http.post("/channel/create?topic=t&channel=c")).status == 200
        with trio.fail_after(10):
            while not (lent := (await http.get("/stats?format=json")).json()["topics"][0]["channels"][0]["depth"]):
                await trio.sleep(0.1)
        assert (await http.post("/topic/empty?topic=t")).status == 200
        await trio.sleep(0.5)  # checkpoints after the empty
        daemon.proc.kill()
        await trio.to_thread.run_sync(daemon.proc.wait, 10)
        daemon = Daemon(small_fs, *args)
        await daemon.wait_ready()
        got = await consume_distinct(daemon.port, "t", "c", lent)
        assert got <= set(confirmed) and len(got) >= lent
    finally:
        if daemon.proc.poll() is None:
            assert await daemon.stop() == 0


@pytest.mark.parametrize("kill", [False, True])
async def test_dead_letters_the_full_disk_refuses_stay_in_their_channel_until_they_can_go(small_fs, kill):
    """--max-attempts=1: a REQ sends the message to t.dead, whose disk is full. It stays in its
    channel (with its record) and goes once there is room; a crash meanwhile brings it back."""
    http_port = free_port()
    args = ["--mem-queue-size=0", "--max-attempts=1", "--sync-timeout=200ms", "--queue-scan-interval=50ms",
            f"--http-address=127.0.0.1:{http_port}"]
    daemon = Daemon(small_fs, *args)
    await daemon.wait_ready()
    http = HTTPClient(http_port)
    try:
        for path in ("/topic/create?topic=t", "/channel/create?topic=t&channel=c",
                     "/topic/create?topic=t.dead", "/channel/create?topic=t.dead&channel=d"):
            assert (await http.post(path)).status == 200
        conn = await NSQConnection.open(daemon.port)
        doomed = [b"doomed-%02d" % i for i in range(50)]
        await conn.mpub("t", doomed)
        await fill_up(conn, "t", [])
        await conn.sub("t", "c")
        await conn.command("RDY 50")
        for _ in doomed:
            msg = await conn.read_message()
            assert msg.body in doomed
            await conn.command(b"REQ " + msg.id + b" 0")
        await trio.sleep(1)
        stats = (await http.get("/stats?format=json")).json()
        dead = next(t for t in stats["topics"] if t["topic_name"] == "t.dead")
        assert dead["channels"][0]["depth"] == 0  # refused by the full disk, and not dropped:
        grow(small_fs, "64m")
        if kill:
            daemon.proc.kill()
            await trio.to_thread.run_sync(daemon.proc.wait, 10)
            daemon = Daemon(small_fs, *args)
            await daemon.wait_ready()
            conn = await NSQConnection.open(daemon.port)  # back in t:c: refused again, to t.dead now
            await conn.sub("t", "c")
            await conn.command("RDY 300")
            seen = 0
            with trio.fail_after(30):
                while seen < len(doomed):
                    msg = await conn.read_message()
                    if msg.body in doomed:
                        seen += 1
                        await conn.command(b"REQ " + msg.id + b" 0")
                    else:
                        await conn.command(b"FIN " + msg.id)
        assert await consume_distinct(daemon.port, "t.dead", "d", len(doomed), timeout=20) == set(doomed)
    finally:
        if daemon.proc.poll() is None:
            assert await daemon.stop() == 0


async def test_after_a_restart_on_a_full_disk_reading_gives_the_room_back_before_any_write_fails(small_fs):
    """Started on a full disk, the daemon has seen no write fail: a queue read to its end must still
    give its segment back (the disk is nearly full), not only once a publish has failed."""
    import os

    args = ["--mem-queue-size=0", "--sync-timeout=200ms"]
    daemon = Daemon(small_fs, *args)
    await daemon.wait_ready()
    conn = await NSQConnection.open(daemon.port)
    await conn.sub("t", "c")
    confirmed: list[bytes] = []
    await fill_up(conn, "t", confirmed)
    daemon.proc.kill()
    await trio.to_thread.run_sync(daemon.proc.wait, 10)

    def free() -> int:
        stat = os.statvfs(small_fs)
        return stat.f_bavail * stat.f_frsize

    assert free() < 64 * 1024
    daemon = Daemon(small_fs, *args)
    await daemon.wait_ready()
    try:
        assert await consume_distinct(daemon.port, "t", "c", len(confirmed), timeout=60) == set(confirmed)
        with trio.fail_after(10):
            while free() < 1 << 20:
                await trio.sleep(0.1)
    finally:
        assert await daemon.stop() == 0


async def test_ping_says_ok_again_once_there_is_room_even_with_nothing_written_since(small_fs):
    """A queue whose last write failed and that then goes quiet kept /ping NOK for good."""
    http_port = free_port()
    daemon = Daemon(small_fs, "--mem-queue-size=0", "--max-bytes-per-file=262144",
                    f"--http-address=127.0.0.1:{http_port}")
    await daemon.wait_ready()
    http = HTTPClient(http_port)
    try:
        conn = await NSQConnection.open(daemon.port)
        await fill_up(conn, "t", [])
        with trio.fail_after(5):  # stays NOK while full: the probe finds no room
            for _ in range(12):
                assert (await http.get("/ping")).status == 500
                await trio.sleep(0.25)
        grow(small_fs, "64m")  # nothing is published, paused or created from here on
        with trio.fail_after(10):
            while (await http.get("/ping")).status != 200:
                await trio.sleep(0.2)
        await conn.mpub("t", [b"after"])
        assert (await http.get("/ping")).body == b"OK"
    finally:
        if daemon.proc.poll() is None:
            assert await daemon.stop() == 0


async def test_shutdown_on_a_full_disk_exits_0_and_keeps_what_it_confirmed(small_fs):
    args = ["--sync-timeout=200ms", "--max-bytes-per-file=262144"]  # memory queues on: shutdown must write them
    daemon = Daemon(small_fs, *args)
    await daemon.wait_ready()
    conn = await NSQConnection.open(daemon.port)
    await conn.sub("t", "c")
    confirmed = [b"%05d" % i + b"m" * 300 for i in range(2000)]
    for start in range(0, len(confirmed), 200):
        await conn.mpub("t", confirmed[start:start + 200])  # all in memory: the disk is still empty
    ballast = small_fs / "ballast"
    with open(ballast, "wb", buffering=0) as f:  # now fill the disk so the shutdown cannot write everything
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    with open(ballast, "r+b") as f:  # ... but leave room for a part of it
        f.truncate(max(ballast.stat().st_size - 256 * 1024, 0))
    daemon.proc.send_signal(signal.SIGTERM)
    status = await trio.to_thread.run_sync(daemon.proc.wait, 30)
    stderr = daemon.proc.stderr.read().decode()
    assert status == 0, stderr
    assert "could not be written at shutdown" in stderr  # said clearly, not a traceback
    assert "Traceback" not in stderr

    ballast.unlink()
    daemon = Daemon(small_fs, *args)
    await daemon.wait_ready()
    saved = json.loads((small_fs / "nsqd.dat").read_bytes())
    assert [t["name"] for t in saved["topics"]] == ["t"]
    got = await consume_until_quiet(daemon.port, "t")
    assert got and got == confirmed[:len(got)]  # what fitted was written, in order, each once
    assert await daemon.stop() == 0


def fill_with_ballast(mount_point) -> None:
    with open(mount_point / "ballast", "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


async def answered_while_full(small_fs):
    """A daemon whose nsqd.dat lists kept/c and gone, then (the disk full) kept paused, gone
    deleted and fresh created, each answered 200; returns it and its HTTP client."""
    http_port = free_port()
    daemon = Daemon(small_fs, "--mem-queue-size=0", f"--http-address=127.0.0.1:{http_port}")
    await daemon.wait_ready()
    http = HTTPClient(http_port)
    for path in ("/topic/create?topic=kept", "/channel/create?topic=kept&channel=c", "/topic/create?topic=gone"):
        assert (await http.post(path, b"")).status == 200
    with trio.fail_after(10):
        while [t["name"] for t in json.loads((small_fs / "nsqd.dat").read_bytes())["topics"]] != ["gone", "kept"]:
            await trio.sleep(0.05)
    fill_with_ballast(small_fs)
    for path in ("/topic/pause?topic=kept", "/topic/delete?topic=gone", "/topic/create?topic=fresh"):
        assert (await http.post(path, b"")).status == 200
    fill_with_ballast(small_fs)  # what the deletion freed
    return daemon, http


async def test_changes_answered_while_the_disk_is_full_and_not_saved_at_shutdown_are_named(small_fs):
    daemon, _ = await answered_while_full(small_fs)
    started = trio.current_time()
    assert await daemon.stop() == 0
    assert trio.current_time() - started >= 2 * 0.9  # tried three times, a second apart
    lines = [line for line in daemon.proc.stderr.read().decode().splitlines() if "metadata could not be saved" in line]
    assert len(lines) == 1, lines
    assert 'created=fresh deleted=gone paused=kept' in lines[0]
    saved = json.loads((small_fs / "nsqd.dat").read_bytes())
    assert [(t["name"], t["paused"]) for t in saved["topics"]] == [("gone", False), ("kept", False)]


async def test_a_full_disk_at_shutdown_with_nsqd_dat_up_to_date_says_nothing_is_missed(small_fs):
    """The line said a restart would not see "these changes" and named none."""
    http_port = free_port()
    daemon = Daemon(small_fs, "--mem-queue-size=0", f"--http-address=127.0.0.1:{http_port}")
    await daemon.wait_ready()
    http = HTTPClient(http_port)
    for path in ("/topic/create?topic=kept", "/channel/create?topic=kept&channel=c"):
        assert (await http.post(path, b"")).status == 200
    with trio.fail_after(10):
        while [t["name"] for t in json.loads((small_fs / "nsqd.dat").read_bytes())["topics"]] != ["kept"]:
            await trio.sleep(0.05)
    fill_with_ballast(small_fs)
    assert await daemon.stop() == 0
    log = daemon.proc.stderr.read().decode()
    lines = [line for line in log.splitlines() if "metadata could not be saved" in line]
    assert len(lines) == 1 and "the saved one already holds every change" in lines[0], lines
    assert "a restart will not see" not in log


async def test_metadata_is_saved_at_shutdown_once_the_disk_has_room_again(small_fs):
    daemon, _ = await answered_while_full(small_fs)
    daemon.proc.send_signal(signal.SIGTERM)
    await trio.sleep(0.5)  # the first save has failed; the next is a second after it
    (small_fs / "ballast").unlink()
    assert await trio.to_thread.run_sync(daemon.proc.wait, 30) == 0
    assert "metadata could not be saved" not in daemon.proc.stderr.read().decode()
    saved = json.loads((small_fs / "nsqd.dat").read_bytes())
    assert [(t["name"], t["paused"]) for t in saved["topics"]] == [("fresh", False), ("kept", True)]


async def test_shutdown_on_a_full_disk_with_a_lease_writes_what_fits_and_counts_the_rest(small_fs):
    """A lease's messages the disk refuses are written with the queued ones, without their lease:
    what fits comes back, the rest is counted as lost (they had been skipped, uncounted, with
    every other message of the channel)."""
    import re

    from .test_leases import lease_command, lease_consumer_at

    daemon = Daemon(small_fs)  # default flags: everything is in memory until the shutdown
    await daemon.wait_ready()
    reader = await lease_consumer_at(daemon.port)
    bodies = [b"%04d" % i + b"m" * 400 for i in range(400)]
    await reader.mpub("t", bodies)
    await lease_command(reader, "LEASE run:1:0")
    await reader.command("RDY 300")
    for _ in range(300):
        await reader.read_message()
    await reader.command("RDY 0")
    ballast = small_fs / "ballast"
    with open(ballast, "wb", buffering=0) as f:  # (unbuffered: nothing left to fail again at close)
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    with open(ballast, "r+b") as f:  # room for about a third of them
        f.truncate(max(ballast.stat().st_size - 64 * 1024, 0))
    daemon.proc.send_signal(signal.SIGTERM)
    assert await trio.to_thread.run_sync(daemon.proc.wait, 30) == 0
    stderr = daemon.proc.stderr.read().decode()
    assert "leased messages written without their lease" in stderr and "Traceback" not in stderr
    lost = sum(int(n) for n in re.findall(r"are lost .*?lost=(\d+)", stderr))
    assert 0 < lost < len(bodies)

    ballast.unlink()
    daemon = Daemon(small_fs)
    await daemon.wait_ready()
    got = await consume_until_quiet(daemon.port, "t")
    assert len(got) == len(bodies) - lost and set(got) <= set(bodies)
    assert await daemon.stop() == 0


async def test_a_big_mpub_the_disk_refuses_part_way_says_how_much_it_stored(small_fs):
    """An MPUB of more than STEP_MESSAGES is stored in steps: a full disk refuses a later step,
    the steps before it stay stored (each all or nothing), and the error says how many."""
    from nsqd.mpub import STEP_MESSAGES

    http_port = free_port()
    daemon = Daemon(small_fs, "--mem-queue-size=0", "--max-bytes-per-file=262144",
                    f"--http-address=127.0.0.1:{http_port}")
    await daemon.wait_ready()
    try:
        conn = await NSQConnection.open(daemon.port)
        await conn.sub("t", "c")
        count = 60_000  # about 5 MiB of records: more than the 3 MiB disk holds
        await conn.command("MPUB t", _mpub([b"%06d" % i + b"." * 30 for i in range(count)]))
        error = await conn.expect_error("E_MPUB_FAILED MPUB failed cannot store")
        stored = int(error.split(b"(")[-1].split()[0])
        assert error.endswith(b" of its %d messages were stored)" % count), error
        assert 0 < stored < count and stored % STEP_MESSAGES == 0, error
        stats = (await HTTPClient(http_port).get("/stats?format=json&topic=t")).json()
        assert stats["topics"][0]["channels"][0]["depth"] == stored
        await conn.command("RDY 1")  # the stored steps are there, in order, from the first message
        assert (await conn.read_message()).body.startswith(b"000000.")
    finally:
        assert await daemon.stop() == 0


def _hold_descriptors(pid: int) -> tuple[int, int]:
    """Let the process open no more files (its lowest free descriptor becomes its limit); the old limit."""
    open_fds = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
    lowest_free = next(fd for fd in range(len(open_fds) + 1) if fd not in open_fds)
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, old[1]))
    return old


@pytest.mark.parametrize("where", ["channel", "topic"])
async def test_a_disk_queue_that_cannot_be_read_for_a_while_is_read_again(tmp_path, where):
    """Out of descriptors, a read of the disk queue fails; its consumer, who asked for those
    messages, gets them once descriptors are free again (before, it waited for a publish)."""
    daemon = Daemon(tmp_path, "--mem-queue-size=0", "--log-level=error")
    await daemon.wait_ready()
    try:
        publisher = await NSQConnection.open(daemon.port)
        if where == "channel":
            await publisher.command("SUB t c")  # the channel exists: the messages go to its disk queue
            await publisher.expect_response()
        await publisher.mpub("t", [b"m%d" % i for i in range(10)])
        consumer = await NSQConnection.open(daemon.port)
        if where == "channel":
            await consumer.command("SUB t c")
            await consumer.expect_response()
        await trio.sleep(0.2)
        old = _hold_descriptors(daemon.proc.pid)
        if where == "topic":  # the new channel takes the topic's backlog, read from its disk queue
            await consumer.command("SUB t c")
            await consumer.expect_response()
        await consumer.command("RDY 10")
        with trio.move_on_after(1):
            frame = await consumer.read_non_heartbeat(timeout=1)
            pytest.fail(f"a frame came while the daemon could open no file: {frame}")
        resource.prlimit(daemon.proc.pid, resource.RLIMIT_NOFILE, old)
        got = set()
        with trio.fail_after(10):
            while len(got) < 10:
                msg = await consumer.read_message(timeout=10)
                got.add(msg.body)
                await consumer.command(b"FIN " + msg.id)
        assert got == {b"m%d" % i for i in range(10)}
    finally:
        await daemon.stop()
    assert "cannot read the %s's disk queue" % where in daemon.proc.stderr.read().decode()


def test_the_unsaved_changes_line_names_channels_policies_and_bounds_its_lists():
    from nsqd.broker import metadata_changes

    saved = {"topics": [{"name": "t", "paused": True, "channels": [{"name": "a"}, {"name": "b", "paused": False}]}]}
    now = {"topics": [{"name": "t", "channels": [{"name": "b", "paused": True, "policy": {"max_messages": 5}}]},
                      *({"name": f"n{i}"} for i in range(25))]}
    changes = metadata_changes(saved, now)
    assert changes == {"created": ",".join(f"n{i}" for i in range(20)) + " and 5 more", "deleted": "t/a",
                       "paused": "t/b", "unpaused": "t", "policy_changed": "t/b"}
    assert metadata_changes(now, now) == {}
