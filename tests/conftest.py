"""Shared fixtures: the real daemon in-process, and a tiny HTTP/1.1 client for its API."""

from __future__ import annotations

import json
from dataclasses import dataclass

import h11
import pytest
import trio

from .support import SPAWNED, running_nsqd


@pytest.fixture(autouse=True)
def _no_daemon_left_behind():
    """Kill the subprocess daemons a test started and left running (it failed before it stopped
    them); those of module fixtures, started before it, are theirs to stop."""
    before = len(SPAWNED)
    yield
    for proc in SPAWNED[before:]:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    del SPAWNED[before:]
    SPAWNED[:] = [proc for proc in SPAWNED if proc.poll() is None]


@pytest.fixture
async def nsqd_server(request, tmp_path):
    """A daemon on ephemeral loopback TCP and HTTP ports, stopped after the test.

    Option overrides come from indirect parametrization:
    ``@pytest.mark.parametrize("nsqd_server", [{"max_msg_size": 64}], indirect=True)``.
    """
    overrides = {"http_address": "127.0.0.1:0", **getattr(request, "param", {})}
    async with running_nsqd(tmp_path / "nsqd", **overrides) as nsqd:
        yield nsqd


def http_port(nsqd) -> int:
    return nsqd.http_addresses[0][1]


@pytest.fixture
def http(nsqd_server) -> HTTPClient:
    """An HTTP client for ``nsqd_server``'s API."""
    return HTTPClient(http_port(nsqd_server))


@dataclass
class HTTPResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


class HTTPClient:
    """One request per connection, over h11; enough to check status, headers and bodies."""

    def __init__(self, port: int, host: str = "127.0.0.1", local_address: str | None = None) -> None:
        self.host = host
        self.port = port
        self.local_address = local_address

    async def request(self, method: str, target: str, body: bytes = b"", *, chunked: bool = False,
                      headers: tuple[tuple[str, str], ...] = ()) -> HTTPResponse:
        conn = h11.Connection(h11.CLIENT)
        fields = [("host", f"{self.host}:{self.port}"), *headers]
        if chunked:
            fields.append(("transfer-encoding", "chunked"))
        elif body or method in ("POST", "PUT"):
            fields.append(("content-length", str(len(body))))
        out = conn.send(h11.Request(method=method, target=target, headers=fields))
        if body:
            out += conn.send(h11.Data(data=body))
        out += conn.send(h11.EndOfMessage())
        with trio.fail_after(10):
            async with await trio.open_tcp_stream(self.host, self.port, local_address=self.local_address) as stream:
                await stream.send_all(out)
                return await self._read_response(conn, stream)

    @staticmethod
    async def _read_response(conn: h11.Connection, stream: trio.SocketStream) -> HTTPResponse:
        response = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                headers = {k.decode(): v.decode() for k, v in response.headers}
                return HTTPResponse(response.status_code, headers, bytes(body))

    async def get(self, target: str, **kwargs) -> HTTPResponse:
        return await self.request("GET", target, **kwargs)

    async def post(self, target: str, body: bytes = b"", **kwargs) -> HTTPResponse:
        return await self.request("POST", target, body, **kwargs)

    async def put(self, target: str, body: bytes = b"", **kwargs) -> HTTPResponse:
        return await self.request("PUT", target, body, **kwargs)


def pytest_terminal_summary(terminalreporter):
    """The crash rounds' figures: kills, confirmed messages, losses and duplicates per mode."""
    import sys

    crash = sys.modules.get("tests.test_crash")
    if crash is None or not crash.REPORT:
        return
    terminalreporter.section("crash rounds (SIGKILL under load)")
    for mode, figures in crash.REPORT.items():
        terminalreporter.write_line(
            f"{mode}: {figures['kills']} kills, {figures['confirmed']} confirmed, {figures['lost']} lost, "
            f"{figures['duplicates']} delivered twice")
