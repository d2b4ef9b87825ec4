"""Registration with nsqlookupd, against an nsqlookupd protocol peer on loopback."""

import json
import struct

import trio

from .conftest import HTTPClient
from .support import NSQConnection, running_nsqd, tcp_port


class Lookupd:
    """Speaks nsqlookupd's V1 TCP protocol and records what producers tell it."""

    def __init__(self):
        self.port = 0
        self.identify: dict | None = None
        #: the IDENTIFY body as sent
        self.identify_raw = b""
        self.registrations: set[tuple[str, str]] = set()
        self.commands: list[str] = []
        self.connections = 0
        self.streams = []
        self.changed = trio.Event()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream):
        self.connections += 1
        self.streams.append(stream)
        buf = bytearray()

        async def read(n):
            while len(buf) < n:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    raise EOFError
                buf.extend(chunk)
            data = bytes(buf[:n])
            del buf[:n]
            return data

        async def line():
            while b"\n" not in buf:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    raise EOFError
                buf.extend(chunk)
            i = buf.index(b"\n")
            data = bytes(buf[:i])
            del buf[:i + 1]
            return data.decode()

        async def respond(data: bytes):
            await stream.send_all(struct.pack(">i", len(data)) + data)

        try:
            assert await read(4) == b"  V1"
            while True:
                cmd = await line()
                self.commands.append(cmd)
                verb, *args = cmd.split(" ")
                if verb == "IDENTIFY":
                    size = struct.unpack(">i", await read(4))[0]
                    self.identify_raw = await read(size)
                    self.identify = json.loads(self.identify_raw)
                    await respond(json.dumps({"tcp_port": self.port, "http_port": 0, "version": "1.3.0",
                                              "broadcast_address": "lookupd", "hostname": "lookupd"}).encode())
                elif verb == "REGISTER":  # as nsqlookupd, a channel's registration registers its topic too
                    self.registrations.update({(args[0], ""), (args[0], args[1] if len(args) > 1 else "")})
                    await respond(b"OK")
                elif verb == "UNREGISTER":
                    self.registrations.discard((args[0], args[1] if len(args) > 1 else ""))
                    await respond(b"OK")
                elif verb == "PING":
                    await respond(b"OK")
                self.changed.set()
                self.changed = trio.Event()
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def wait_for(self, predicate, timeout=5):
        with trio.fail_after(timeout):
            while not predicate():
                await self.changed.wait()


async def test_registers_topics_and_channels_and_follows_changes(tmp_path):
    lookupd = Lookupd()
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.serve)
        async with running_nsqd(tmp_path, lookupd_tcp_addresses=[f"127.0.0.1:{lookupd.port}"],
                                broadcast_address="node-1") as nsqd:
            await lookupd.wait_for(lambda: lookupd.identify is not None)
            assert lookupd.identify["broadcast_address"] == "node-1"
            assert lookupd.identify["tcp_port"] == tcp_port(nsqd)
            assert lookupd.identify["version"] == "1.3.0"
            # Go marshals a map of these five: compact, keys sorted
            assert sorted(lookupd.identify) == ["broadcast_address", "hostname", "http_port", "tcp_port", "version"]
            assert lookupd.identify_raw == json.dumps(lookupd.identify, separators=(",", ":"), sort_keys=True).encode()

            conn = await NSQConnection.open(tcp_port(nsqd))
            await conn.sub("orders", "billing")
            await lookupd.wait_for(lambda: ("orders", "billing") in lookupd.registrations)
            assert ("orders", "") in lookupd.registrations

            nsqd.delete_channel(nsqd.topics["orders"], "billing")
            await lookupd.wait_for(lambda: ("orders", "billing") not in lookupd.registrations)
            nsqd.delete_topic("orders")
            await lookupd.wait_for(lambda: not lookupd.registrations)
            assert lookupd.commands[-1] == "UNREGISTER orders"

            # the lookupd drops the connection: we reconnect and register everything again
            nsqd.get_topic("a").get_channel("x")
            await lookupd.wait_for(lambda: ("a", "x") in lookupd.registrations)
            await lookupd.streams[0].aclose()
            lookupd.registrations.clear()
            await lookupd.wait_for(lambda: lookupd.connections == 2 and {("a", ""), ("a", "x")} <= lookupd.registrations)
        nursery.cancel_scope.cancel()


async def test_lookupd_addresses_changed_at_run_time_are_followed(tmp_path):
    """PUT /config/nsqlookupd_tcp_addresses: the daemon registers with the new ones and leaves the old."""
    first, second = Lookupd(), Lookupd()
    async with trio.open_nursery() as nursery:
        await nursery.start(first.serve)
        await nursery.start(second.serve)
        async with running_nsqd(tmp_path, http_address="127.0.0.1:0") as nsqd:
            nsqd.get_topic("t").get_channel("c")
            http = HTTPClient(nsqd.http_addresses[0][1])
            response = await http.put("/config/nsqlookupd_tcp_addresses",
                                      json.dumps([f"127.0.0.1:{first.port}"]).encode())
            assert response.status == 200
            await first.wait_for(lambda: {("t", ""), ("t", "c")} <= first.registrations)
            response = await http.put("/config/nsqlookupd_tcp_addresses",
                                      json.dumps([f"127.0.0.1:{second.port}"]).encode())
            assert response.json() == [f"127.0.0.1:{second.port}"]
            await second.wait_for(lambda: {("t", ""), ("t", "c")} <= second.registrations)
            with trio.fail_after(5):  # the first lookupd's connection is closed
                try:
                    while await first.streams[0].receive_some(100):
                        pass
                except trio.ClosedResourceError:
                    pass  # its handler saw the end already
            assert first.connections == 1
        nursery.cancel_scope.cancel()
