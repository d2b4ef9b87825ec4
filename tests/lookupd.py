"""A minimal nsqlookupd for tests: what daemons register over TCP, answered over HTTP.

TCP speaks nsqlookupd's V1 protocol, as nsqd uses it: the magic ``"  V1"``,
``IDENTIFY`` with a size-prefixed JSON body (the producer's broadcast address,
ports, version), then ``REGISTER topic [channel]``, ``UNREGISTER topic
[channel]`` and ``PING`` lines; every answer is ``size(4) | data``. A
producer is forgotten with its connection.

HTTP answers what consumers ask nsqlookupd: ``GET /lookup?topic=`` with the
topic's channels and the producers that registered it (404 TOPIC_NOT_FOUND
when none did), ``GET /ping``, ``GET /channels?topic=``, ``GET /topics`` and ``GET /nodes``, in
nsqlookupd 1.x's JSON.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

import h11
import trio

VERSION = "1.3.0"


@dataclass
class Producer:
    remote_address: str
    info: dict
    registrations: set[tuple[str, str]] = field(default_factory=set)

    def peer_info(self) -> dict:
        return {
            "remote_address": self.remote_address,
            "hostname": self.info.get("hostname", ""),
            "broadcast_address": self.info.get("broadcast_address", ""),
            "tcp_port": self.info.get("tcp_port", 0),
            "http_port": self.info.get("http_port", 0),
            "version": self.info.get("version", ""),
            "topology_zone": self.info.get("topology_zone", ""),
            "topology_region": self.info.get("topology_region", ""),
        }


class NSQLookupd:
    def __init__(self) -> None:
        self.tcp_port = 0
        self.http_port = 0
        self.producers: dict[int, Producer] = {}
        self.requests: list[str] = []  # HTTP request targets, in order
        self._changed = trio.Event()

    # ----------------------------------------------------------- queries
    def topics(self) -> list[str]:
        return sorted({t for p in self.producers.values() for t, c in p.registrations if not c})

    def lookup(self, topic: str) -> dict | None:
        producers = [p for p in self.producers.values() if (topic, "") in p.registrations]
        if not producers:
            return None
        channels = sorted({c for p in self.producers.values() for t, c in p.registrations if t == topic and c})
        return {"channels": channels, "producers": [p.peer_info() for p in producers]}

    async def wait_for(self, predicate, timeout: float = 10) -> None:
        with trio.fail_after(timeout):
            while not predicate():
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------- serve
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        tcp = await trio.open_tcp_listeners(0, host="127.0.0.1")
        http = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.tcp_port = tcp[0].socket.getsockname()[1]
        self.http_port = http[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._tcp_client, tcp)
            nursery.start_soon(trio.serve_listeners, self._http_client, http)
            task_status.started(self)

    # -------------------------------------------------------- TCP, V1
    async def _tcp_client(self, stream: trio.SocketStream) -> None:
        host, port = stream.socket.getpeername()[:2]
        reader = _Reader(stream)
        key = id(stream)
        try:
            if await reader.exactly(4) != b"  V1":
                return
            while True:
                verb, *args = (await reader.line()).split(" ")
                if verb == "IDENTIFY":
                    size = struct.unpack(">i", await reader.exactly(4))[0]
                    info = json.loads(await reader.exactly(size))
                    self.producers[key] = Producer(f"{host}:{port}", info)
                    answer = json.dumps({"tcp_port": self.tcp_port, "http_port": self.http_port, "version": VERSION,
                                         "broadcast_address": "127.0.0.1", "hostname": "lookupd"}).encode()
                elif verb in ("REGISTER", "UNREGISTER") and args and key in self.producers:
                    topic, channel = args[0], args[1] if len(args) > 1 else ""
                    registrations = self.producers[key].registrations
                    if verb == "REGISTER":
                        registrations.update({(topic, ""), (topic, channel)})
                    elif channel:
                        registrations.discard((topic, channel))
                    else:
                        registrations -= {r for r in registrations if r[0] == topic}
                    answer = b"OK"
                elif verb == "PING":
                    answer = b"OK"
                else:
                    answer = b"E_INVALID"
                await stream.send_all(struct.pack(">i", len(answer)) + answer)
                self._notify()
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if self.producers.pop(key, None) is not None:
                self._notify()

    # -------------------------------------------------------------- HTTP
    async def _http_client(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                    continue
                if isinstance(event, h11.Request):
                    target = event.target.decode()
                    self.requests.append(target)
                    status, body, content_type = self._answer(event.method.decode(), target)
                    headers = [("content-type", content_type), ("content-length", str(len(body))),
                               ("x-nsq-content-type", "nsq; version=1.0"), ("connection", "close")]
                    data = conn.send(h11.Response(status_code=status, headers=headers))
                    data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
                    await stream.send_all(data)
                    self._notify()
                    return
                if isinstance(event, h11.ConnectionClosed):
                    return
        except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    def _answer(self, method: str, target: str) -> tuple[int, bytes, str]:
        url = urlsplit(target)
        query = parse_qs(url.query)
        plain, as_json = "text/plain; charset=utf-8", "application/json; charset=utf-8"
        if method != "GET":
            return 405, b'{"message":"METHOD_NOT_ALLOWED"}', as_json
        if url.path == "/ping":
            return 200, b"OK", plain
        if url.path == "/lookup":
            if "topic" not in query:
                return 400, b'{"message":"MISSING_ARG_TOPIC"}', as_json
            found = self.lookup(query["topic"][0])
            if found is None:
                return 404, b'{"message":"TOPIC_NOT_FOUND"}', as_json
            return 200, json.dumps(found).encode(), as_json
        if url.path == "/channels":
            if "topic" not in query:
                return 400, b'{"message":"MISSING_ARG_TOPIC"}', as_json
            topic = query["topic"][0]
            channels = sorted({c for p in self.producers.values() for t, c in p.registrations if t == topic and c})
            return 200, json.dumps({"channels": channels}).encode(), as_json
        if url.path == "/topics":
            return 200, json.dumps({"topics": self.topics()}).encode(), as_json
        if url.path == "/nodes":
            return 200, json.dumps({"producers": [p.peer_info() for p in self.producers.values()]}).encode(), as_json
        return 404, b'{"message":"NOT_FOUND"}', as_json


class _Reader:
    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._buf = bytearray()

    async def _more(self) -> None:
        chunk = await self._stream.receive_some(65536)
        if not chunk:
            raise EOFError
        self._buf += chunk

    async def exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            await self._more()
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    async def line(self) -> str:
        while b"\n" not in self._buf:
            await self._more()
        index = self._buf.index(b"\n")
        data = bytes(self._buf[:index])
        del self._buf[:index + 1]
        return data.decode()
