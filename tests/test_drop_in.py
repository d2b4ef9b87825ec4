"""Started, found and stopped as tools written for Go nsqd do it: --version, stderr, SIGTERM.

The daemon runs as ``python -m nsqd`` with port 0 everywhere; the test knows
its ports only from the ``listening on`` lines, as a harness would, and
publishes and consumes through them.
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import trio
import trustme

from nsqd.version import __version__

from .conftest import HTTPClient
from .harness import GO_LOG_LINE, VERSION, ExitedPrematurely, GoStyleNsqd, nsqd_version
from .support import NSQConnection, consume_distinct, free_port


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    ca = trustme.CA()
    folder = tmp_path_factory.mktemp("certs")
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: str(folder / f"{name}.pem") for name in ("cert", "key", "ca")}
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    ca.cert_pem.write_to_path(paths["ca"])
    return paths


def test_version_is_go_nsqds_shape():
    match = nsqd_version()
    assert match["name"] == "nsqd"
    assert match["version"] == "1.3.0"  # the nsqd release we implement, compared against features
    assert tuple(map(int, match["version"].split("."))) >= (0, 2, 28)  # "has HTTPS", as harnesses decide
    python = "{}.{}.{}".format(*sys.version_info[:3])
    assert match["toolchain"] == f"nsqd-trio{__version__}-python{python}"
    # the whole output is that one line, as Go's fmt.Println prints it
    assert match.string == match.group(0) + "\n"
    # and the looser shape: nsqd vX.Y.Z(-suffix)? (built w/TOOLCHAIN), no space in the toolchain
    assert re.fullmatch(r"nsqd v\d+\.\d+\.\d+(-\S+)? \(built w/\S+\)\n", match.string)


async def test_started_found_used_and_stopped_like_go_nsqd(tmp_path, certs):
    # flags with spaces, and single-dash ones, as harnesses pass them
    daemon = GoStyleNsqd(
        "--tcp-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--https-address", "127.0.0.1:0",
        "--data-path", str(tmp_path / "data"), "--tls-cert", certs["cert"], "--tls-key", certs["key"],
        "-broadcast-address", "127.0.0.1", "-log-level=info",
        protocols=("TCP", "HTTP", "HTTPS"))
    try:
        await daemon.start()
        ports = daemon.ports
        assert len(set(ports.values())) == 3 and 0 not in ports.values()

        # the first line is the version line, every line so far is Go's log format
        first = GO_LOG_LINE.fullmatch(daemon.lines[0])
        assert first and first["level"] == "INFO" and VERSION.fullmatch(first["message"])
        assert first["message"] == nsqd_version().group(0)
        assert all(GO_LOG_LINE.fullmatch(line) for line in daemon.lines), daemon.lines
        listening = [GO_LOG_LINE.fullmatch(line)["message"] for line in daemon.lines if "listening on" in line]
        assert listening == [f"{kind}: listening on 127.0.0.1:{ports[kind]}" for kind in ("TCP", "HTTP", "HTTPS")]

        # publish through the TCP, HTTP and HTTPS ports read from stderr, consume through TCP
        pub = await NSQConnection.open(ports["TCP"])
        await pub.identify()
        await pub.pub("dropin", b"over tcp")
        await pub.close()
        http = HTTPClient(ports["HTTP"])
        assert (await http.post("/pub?topic=dropin", b"over http")).body == b"OK"
        context = ssl.create_default_context(cafile=certs["ca"])

        def https_pub() -> bytes:
            request = urllib.request.Request(f"https://127.0.0.1:{ports['HTTPS']}/pub?topic=dropin",
                                             data=b"over https", method="POST")
            with urllib.request.urlopen(request, context=context, timeout=10) as response:
                return response.read()

        assert await trio.to_thread.run_sync(https_pub) == b"OK"

        sub = await NSQConnection.open(ports["TCP"])
        await sub.identify()
        await sub.sub("dropin", "harness")
        await sub.command("RDY 10")
        got = [await sub.read_message() for _ in range(3)]
        assert [m.body for m in got] == [b"over tcp", b"over http", b"over https"]
        for m in got:
            await sub.command(b"FIN " + m.id)
        stats = json.loads((await http.get("/stats?format=json&topic=dropin")).body)
        (channel,) = stats["topics"][0]["channels"]
        assert (channel["depth"], channel["in_flight_count"], channel["message_count"]) == (0, 0, 3)
        await sub.close()

        # SIGTERM: the closing lines, "NSQ: bye" last, exit 0 and stderr closed (read_to_eof returned)
        status, rest = await daemon.stop()
        assert status == 0
        messages = [GO_LOG_LINE.fullmatch(line)["message"] for line in rest]
        for kind in ("TCP", "HTTP", "HTTPS"):
            assert f"{kind}: closing 127.0.0.1:{ports[kind]}" in messages
        assert messages[-1] == "NSQ: bye"
    finally:
        await daemon.kill()


async def test_a_port_in_use_exits_1_after_a_fatal_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = GoStyleNsqd("--tcp-address", "127.0.0.1:0", "--http-address", f"127.0.0.1:{port}",
                             "--data-path", str(tmp_path / "data"))
        try:
            with pytest.raises(ExitedPrematurely):  # stderr closed: a harness stops waiting
                await daemon.start()
            with trio.fail_after(30):
                assert await daemon.proc.wait() == 1
            last = GO_LOG_LINE.fullmatch(daemon.lines[-1])
            assert last["level"] == "FATAL"
            assert last["message"].startswith(f"failed to start nsqd - listen (127.0.0.1:{port}) failed - ")
        finally:
            await daemon.kill()


async def test_a_stderr_that_cannot_be_written_does_not_stop_the_daemon(tmp_path):
    """A harness handing the daemon ``open(os.devnull)`` (read-only) as stdout and stderr: every
    log write fails with EBADF, which Go's logger ignores; ours ended the daemon at its first line."""
    port = free_port()
    with open(os.devnull) as read_only:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{port}", "--http-address=",
             "--https-address=", "--amqp-address=", f"--data-path={tmp_path}"],
            stdout=read_only, stderr=read_only)
    try:
        with trio.fail_after(20):
            while True:
                assert proc.poll() is None, "the daemon exited"
                try:
                    conn = await NSQConnection.open(port)
                    break
                except OSError:
                    await trio.sleep(0.05)
        await conn.pub("t", b"logged nowhere")
        await conn.close()
        assert await consume_distinct(port, "t", "c", 1) == {b"logged nowhere"}
        proc.terminate()
        assert await trio.to_thread.run_sync(proc.wait, 30) == 0
    finally:
        proc.kill()


async def test_without_a_certificate_https_stays_off_and_amqp_is_opt_in(tmp_path):
    """Go's defaults: HTTPS on 0.0.0.0:4152 needs a certificate; Go opens no AMQP port."""
    daemon = GoStyleNsqd("--tcp-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
                         "--data-path", str(tmp_path / "data"))
    try:
        await daemon.start()
        config = HTTPClient(daemon.ports["HTTP"])
        assert (await config.get("/config/https_address")).body == b"0.0.0.0:4152"
        status, _ = await daemon.stop()
        assert status == 0
        said = daemon.lines
        assert not [line for line in said if "HTTPS" in line or "AMQP" in line], said
    finally:
        await daemon.kill()


async def test_the_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path):
    """Go programs raise RLIMIT_NOFILE's soft limit to the hard one at start; so do we, so a
    daemon started under a soft limit of 256 has the hard limit's room for topics and channels."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard open-file limit here is {hard}")

    def lower_soft_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    proc = subprocess.Popen([sys.executable, "-m", "nsqd", "--tcp-address", "127.0.0.1:0", "--http-address",
                             "127.0.0.1:0", "--data-path", str(tmp_path)], preexec_fn=lower_soft_limit,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "HTTP: listening on" in line:
                break
        limits = (Path("/proc") / str(proc.pid) / "limits").read_text()
        soft = re.search(r"^Max open files\s+(\S+)", limits, re.M)[1]
        assert soft == ("unlimited" if hard == resource.RLIM_INFINITY else str(hard))
    finally:
        proc.terminate()
        proc.wait(30)
