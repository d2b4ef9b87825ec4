"""The daemon's outgoing HTTP requests (auth servers, nsqlookupd): one request per connection, over h11."""

from __future__ import annotations

import h11
import trio

#: the largest response body read (each chunk also counts CHUNK_COST: a body of 1-byte chunks was
#: 40 MB of Python objects within the limit)
MAX_RESPONSE = 1024 * 1024
CHUNK_COST = 64
#: events handled between two yields to the event loop
EVENTS_PER_TURN = 256
#: ``100 Continue`` and the like taken before the answer (a server could send them forever)
MAX_INFORMATIONAL = 16
#: what failing requests raise besides OSError and trio's timeouts
FAILURES = (OSError, trio.TooSlowError, trio.BrokenResourceError, h11.ProtocolError)


class ResponseError(Exception):
    """The server answered, but not with a usable 200."""


async def exchange(stream: trio.abc.Stream, method: str, target: str, headers, body: bytes = b"") -> bytes:
    """Send one request and return the body of its 200 answer; ResponseError for another status."""
    conn = h11.Connection(h11.CLIENT)
    data = conn.send(h11.Request(method=method, target=target, headers=headers))
    if body:
        data += conn.send(h11.Data(data=body))
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)
    status, chunks, size, events = 0, [], 0, 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
            continue
        events += 1
        if events % EVENTS_PER_TURN == 0:  # one read of tiny chunks is thousands of events
            await trio.lowlevel.checkpoint()
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.InformationalResponse):
            if events > MAX_INFORMATIONAL:
                raise ResponseError("too many informational responses")
        elif isinstance(event, h11.Data):
            size += len(event.data) + CHUNK_COST
            if size > MAX_RESPONSE:
                raise ResponseError("reply too large")
            chunks.append(event.data)
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    if status != 200:
        raise ResponseError(f"got response {status}")
    return b"".join(chunks)


async def get(host: str, port: int, target: str, headers, connect_timeout: float, request_timeout: float) -> bytes:
    """A plain-HTTP GET with the daemon's connect and request timeouts."""
    with trio.fail_after(connect_timeout):
        stream = await trio.open_tcp_stream(host, port)
    try:
        with trio.fail_after(request_timeout):
            return await exchange(stream, "GET", target, headers)
    finally:
        await stream.aclose()
