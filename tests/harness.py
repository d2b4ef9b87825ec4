"""Start the daemon the way test harnesses and supervisors written for Go nsqd do.

Such a harness runs ``nsqd --version`` and matches it to learn the name and
the version (to decide, say, whether HTTPS exists), starts ``nsqd`` with
``--tcp-address 127.0.0.1:0`` and friends, reads stderr line by line until
it has seen ``TCP: listening on 127.0.0.1:PORT`` (and HTTP, HTTPS), takes
the ports from those lines, and stops the daemon with SIGTERM, reading
stderr until it closes. Nothing here knows it is not talking to Go nsqd.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import trio

#: ``nsqd --version``: a lower-case name, X.Y.Z with at most a letters-only
#: suffix, and one toolchain token of lower-case letters, digits, dots and
#: dashes, as harnesses (gnsq's among them) match it, from the start
VERSION = re.compile(r"(?P<name>[a-z]+) v(?P<version>[0-9]+\.[0-9]+\.[0-9]+)(?:-[a-z]+)? "
                     r"\(built w/(?P<toolchain>[a-z0-9.-]+)\)")

#: a listening line; harnesses search for it anywhere in a line that says
#: "listening on" and give up on one that does not match
LISTENING = re.compile(r"(?P<protocol>[A-Z]+): listening on "
                       r"(?P<address>(?:[0-9]{1,3}\.){3}[0-9]{1,3}):(?P<port>[0-9]+)")

#: Go's log package with nsqd's flags, and lg's level names
GO_LOG_LINE = re.compile(r"\[nsqd\] [0-9]{4}/[0-9]{2}/[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6} "
                         r"(?P<level>DEBUG|INFO|WARNING|ERROR|FATAL): (?P<message>.*)")


def nsqd_version(executable: list[str] | None = None) -> re.Match:
    out = subprocess.run([*(executable or [sys.executable, "-m", "nsqd"]), "--version"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    match = VERSION.match(out)
    assert match, f"--version printed {out!r}"
    return match


class ExitedPrematurely(Exception):
    """stderr closed before every wanted listening line was seen."""


class GoStyleNsqd:
    """``python -m nsqd *args`` as a subprocess, its ports read from stderr."""

    def __init__(self, *args: str, protocols: tuple[str, ...] = ("TCP", "HTTP")) -> None:
        self.args = args
        self.protocols = protocols
        self.ports: dict[str, int] = {}
        self.lines: list[str] = []
        self.proc: trio.Process | None = None
        self._buf = bytearray()
        self._eof = False

    async def start(self, timeout: float = 30) -> GoStyleNsqd:
        self.proc = await trio.lowlevel.open_process([sys.executable, "-m", "nsqd", *self.args],
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        with trio.fail_after(timeout):
            while not all(p in self.ports for p in self.protocols):
                line = await self.readline()
                if line is None:
                    raise ExitedPrematurely("\n".join(self.lines))
                if "listening on" not in line:
                    continue
                match = LISTENING.search(line)
                assert match, f"unexpected line: {line!r}"
                self.ports.setdefault(match["protocol"], int(match["port"]))
        return self

    async def readline(self) -> str | None:
        """The next stderr line without its newline; None once stderr is closed."""
        while b"\n" not in self._buf:
            if self._eof:
                return None
            chunk = await self.proc.stderr.receive_some(65536)
            if not chunk:
                self._eof = True
                if self._buf:  # a last line without a newline
                    self._buf += b"\n"
                continue
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        text = line.decode()
        self.lines.append(text)
        return text

    async def read_to_eof(self, timeout: float = 30) -> list[str]:
        """Every line until stderr closes (fails if it stays open past ``timeout``)."""
        rest = []
        with trio.fail_after(timeout):
            while (line := await self.readline()) is not None:
                rest.append(line)
        return rest

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> tuple[int, list[str]]:
        """Send ``sig``, read stderr until it closes, and return the exit status and those lines."""
        self.proc.send_signal(sig)
        rest = await self.read_to_eof(timeout)
        with trio.fail_after(timeout):
            status = await self.proc.wait()
        await self.proc.stderr.aclose()
        return status, rest

    async def kill(self) -> None:
        """Make sure the process is gone (cleanup after a failed test)."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await self.proc.stderr.aclose()
