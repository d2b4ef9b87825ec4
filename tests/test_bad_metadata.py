"""A garbled nsqd.dat stops start-up with one line that names the file, what is wrong and
what to do, exit status 1, and leaves the file as it was."""

import subprocess
import sys

import pytest
import trio

from .support import Daemon, NSQConnection, consume_distinct, free_port


@pytest.mark.parametrize("content,reason", [
    (b"garbage{", "not JSON: Expecting value: line 1 column 1 (char 0)"),
    (b"", "not JSON: Expecting value: line 1 column 1 (char 0)"),
    (b"\xff\xfe\x00", "not JSON: "),
    (b"[" * 100_000 + b"]" * 100_000, "not JSON: maximum recursion depth exceeded"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"topics": 5}', "topics is not a list"),
    (b'{"topics": [{"name": "no spaces allowed"}]}', 'bad topic entry {"name": "no spaces allowed"}'),
    (b'{"topics": [{"name": "t", "channels": [{"name": ""}]}]}', 'bad channel entry {"name": ""} in topic t'),
    (b'{"topics": [{"name": "t", "policy": {"max_messages": "lots"}}]}', "policy of topic t has a bad max_messages"),
    (b'{"topics": [], "last_message_id": "x"}', "last_message_id is not a 64-bit message id"),
    (b'{"topics": [], "last_message_id": 18446744073709551616}', "last_message_id is not a 64-bit message id"),
    (b'{"topics": [{"name": "t", "policy": {"max_messages": 1000000000000000000000000000000}}]}',
     "policy of topic t has a bad max_messages"),  # over int64, as HTTP refuses it
], ids=lambda v: v[:24].decode(errors="replace") if isinstance(v, bytes) else "")
def test_garbled_metadata_stops_start_up_with_one_line(tmp_path, content, reason):
    data = tmp_path / "data"
    data.mkdir()
    (data / "nsqd.dat").write_bytes(content)
    proc = subprocess.run(
        [sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{free_port()}", "--http-address=",
         "--amqp-address=", f"--data-path={data}"],
        capture_output=True, timeout=60)
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == 1, proc.stderr.decode()
    # Go's start-up lines (version, ID), then one line that says it all
    assert [line.split(": ", 1)[0].split()[-1] for line in lines[:-1]] == ["INFO", "INFO"], lines
    assert "FATAL: failed to start nsqd - " in lines[-1], lines
    assert f"{data / 'nsqd.dat'} is not valid nsqd metadata ({reason}" in lines[-1]
    assert "move it aside to start without it" in lines[-1] and "Traceback" not in proc.stderr.decode()
    assert (data / "nsqd.dat").read_bytes() == content  # not overwritten on the way out


async def _queue_of_five(data) -> None:
    """Topic ``t`` with five messages in its disk queue, the daemon stopped."""
    daemon = Daemon(data, "--mem-queue-size=0")
    await daemon.wait_ready()
    conn = await NSQConnection.open(daemon.port)
    await conn.mpub("t", [b"m%d" % i for i in range(5)])
    await conn.close()
    assert await daemon.stop() == 0


async def test_a_damaged_segment_version_is_repaired_and_the_daemon_starts(tmp_path):
    """One flipped bit in a segment's version bytes stopped the whole daemon with a traceback."""
    data = tmp_path / "data"
    await _queue_of_five(data)
    with open(data / "t.diskq.000000.dat", "r+b") as stream:
        stream.seek(9)
        stream.write(b"\x03")  # version 1 with its second bit flipped
    daemon = Daemon(data, "--mem-queue-size=0")
    await daemon.wait_ready()
    got = await consume_distinct(daemon.port, "t", "c", 5)
    assert sorted(got) == [b"m%d" % i for i in range(5)]
    assert await daemon.stop() == 0


async def test_a_segment_of_another_format_stops_start_up_with_one_line(tmp_path):
    data = tmp_path / "data"
    await _queue_of_five(data)
    segment = data / "t.diskq.000000.dat"
    with open(segment, "r+b") as stream:
        stream.seek(8)
        stream.write(b"\x00\x07")
        stream.seek(20)  # the first record's checksum: not ours
        stream.write(b"\x00\x00\x00\x00")
    before = segment.read_bytes()
    daemon = Daemon(data, "--mem-queue-size=0")
    assert await trio.to_thread.run_sync(daemon.proc.wait, 60) == 1
    stderr = daemon.proc.stderr.read().decode()
    assert "Traceback" not in stderr, stderr
    last = stderr.splitlines()[-1]
    assert "FATAL: failed to start nsqd - " in last and "segment format version 7 is not supported" in last
    assert "move the queue's files aside" in last
    assert segment.read_bytes() == before
