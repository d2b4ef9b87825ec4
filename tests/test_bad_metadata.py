"""A garbled nsqd.dat stops start-up with one line that names the file, what is wrong and
what to do, exit status 1, and leaves the file as it was."""

import subprocess
import sys

import pytest

from .support import free_port


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
    (b'{"topics": [], "last_message_id": "x"}', "last_message_id is not a number"),
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
