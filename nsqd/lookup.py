"""Registration with nsqlookupd, so consumers that discover producers find us.

One task per ``--lookupd-tcp-address`` keeps a connection in nsqlookupd's V1
protocol: magic ``"  V1"``, ``IDENTIFY`` with our broadcast address and
ports, then ``REGISTER topic [channel]`` / ``UNREGISTER ...`` as topics and
channels come and go, and ``PING`` every 15 seconds. Each answer is
``size(4) | data``. Rather than queueing notifications, a peer compares the
registrations the daemon should have with what it has told nsqlookupd and
sends the difference, so a reconnect simply starts from an empty set and
re-registers everything.

A topic created while running (not loaded from ``nsqd.dat``) asks every
nsqlookupd that answered an ``IDENTIFY`` for the topic's channels
(:func:`topic_channels`, ``GET /channels`` at its broadcast address and HTTP
port) and starts with them, as nsqd's GetTopic does: channels other daemons'
consumers use then get the topic's first messages too. Until the answers
are in, the topic keeps what is published (``Topic.starting``).
"""

from __future__ import annotations

import json
import socket
import struct
from functools import partial
from typing import TYPE_CHECKING
from urllib.parse import urlencode

import structlog
import trio

from . import http_client
from .names import is_valid_channel_name
from .options import join_host_port, split_host_port
from .version import NSQD_VERSION

if TYPE_CHECKING:
    from .broker import Broker

log = structlog.get_logger("nsqd.lookup")

PING_INTERVAL = 15.0
#: nsqd's lookup peer gives the dial, and each read, a second
CONNECT_TIMEOUT = 1.0
RESPONSE_TIMEOUT = 1.0
#: channel queries (``GET /channels``, one connection each) under way at once, over all lookupds
MAX_CHANNEL_QUERIES = 64
#: the wait before reconnecting after a failure, doubled up to MAX_BACKOFF while failures go on
FIRST_BACKOFF = 1.0
MAX_BACKOFF = 15.0


def registrations(nsqd: Broker) -> set[tuple[str, str]]:
    """``(topic, "")`` for every topic and ``(topic, channel)`` for every channel."""
    wanted = set()
    for topic in nsqd.topics.values():
        wanted.add((topic.name, ""))
        wanted.update((topic.name, name) for name in topic.channels)
    return wanted


def identify_body(nsqd: Broker) -> bytes:
    # Go marshals a map: compact, keys sorted; v1.3.0 sends these five
    return json.dumps({
        "version": NSQD_VERSION,
        "tcp_port": nsqd.broadcast_tcp_port,
        "http_port": nsqd.broadcast_http_port,
        "hostname": socket.gethostname(),
        "broadcast_address": nsqd.options.broadcast_address,
    }, separators=(",", ":"), sort_keys=True).encode()


def command(verb: str, topic: str, channel: str) -> bytes:
    return f"{verb} {topic} {channel}\n".encode() if channel else f"{verb} {topic}\n".encode()


class LookupPeer:
    def __init__(self, nsqd: Broker, address: str) -> None:
        self.nsqd = nsqd
        self.address = address
        self.registered: set[tuple[str, str]] = set()
        self.info: dict = {}
        #: the current session got an answer to IDENTIFY
        self.identified = False
        self._changed = trio.lowlevel.ParkingLot()
        self._dirty = False

    @property
    def http_address(self) -> str | None:
        """nsqlookupd's HTTP address from its IDENTIFY answer (kept after a disconnect, as nsqd does)."""
        if not isinstance(self.info, dict):
            return None
        host, port = self.info.get("broadcast_address"), self.info.get("http_port")
        if not host or not isinstance(host, str) or type(port) is not int:
            return None
        return join_host_port(host, port)

    def notify(self) -> None:
        self._dirty = True
        self._changed.unpark_all()

    async def run(self) -> None:
        """Keep a session up: after a failure, wait ``FIRST_BACKOFF``, then twice as long each time
        up to ``MAX_BACKOFF``; a session that got as far as IDENTIFY starts the wait afresh."""
        backoff = FIRST_BACKOFF
        while True:
            self.identified = False
            try:
                await self._session()
            except (OSError, trio.BrokenResourceError, trio.TooSlowError, ValueError, RecursionError, EOFError) as exc:
                log.warning("lookupd connection failed", lookupd=self.address, error=str(exc) or type(exc).__name__)
            self.registered.clear()
            if self.identified:
                backoff = FIRST_BACKOFF
            await self._wait_to_reconnect(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _wait_to_reconnect(self, delay: float) -> None:
        """Back off, but reconnect at once for a topic or channel that came or went,
        as nsqd's lookup peer connects for the command announcing it."""
        if not self._dirty:
            with trio.move_on_after(delay):
                await self._changed.park()

    async def _session(self) -> None:
        self._dirty = False  # what changed from here on is told by this connection
        host, port = split_host_port(self.address)
        with trio.fail_after(CONNECT_TIMEOUT):
            stream = await trio.open_tcp_stream(host or "127.0.0.1", port)
        async with stream:
            reader = _Responses(stream)
            body = identify_body(self.nsqd)
            await _write(stream, b"  V1IDENTIFY\n" + struct.pack(">i", len(body)) + body)
            response = await reader.next()
            if response.startswith(b"E_"):
                raise ValueError(f"lookupd refused IDENTIFY: {response.decode(errors='replace')}")
            info = json.loads(response)
            if not isinstance(info, dict):  # it was kept, and every new topic's start read it
                raise ValueError(f"lookupd answered IDENTIFY with {type(info).__name__}, not an object")
            self.info = info
            self.identified = True
            log.info("lookupd connected", lookupd=self.address, info=self.info)
            await self._register_all(stream, reader)
            next_ping = trio.current_time() + PING_INTERVAL
            while True:
                self._dirty = False
                await self._sync(stream, reader)
                if not self._dirty:
                    await self._idle(stream, next_ping)
                if trio.current_time() >= next_ping:
                    await _write(stream, b"PING\n")
                    await reader.next()
                    next_ping = trio.current_time() + PING_INTERVAL

    async def _idle(self, stream: trio.SocketStream, deadline: float) -> None:
        """Wait for a change, the next ping, or the lookupd hanging up (noticed at once)."""
        hung_up = False
        async with trio.open_nursery() as nursery:
            async def changed() -> None:
                if not self._dirty:  # a change may land before this task first runs
                    await self._changed.park()
                nursery.cancel_scope.cancel()

            async def readable() -> None:
                nonlocal hung_up
                await trio.lowlevel.wait_readable(stream.socket)
                hung_up = True
                nursery.cancel_scope.cancel()

            nursery.cancel_scope.deadline = deadline
            nursery.start_soon(changed)
            nursery.start_soon(readable)
        if hung_up:
            if not await stream.receive_some(65536):
                raise EOFError("lookupd closed the connection")
            # it would be taken for the answer to our next command (and each wake-up went over
            # every registration)
            raise ValueError("lookupd sent what nothing asked for")

    async def _register_all(self, stream, reader) -> None:
        """Tell a fresh connection everything, as nsqd's connect callback does.

        A topic with channels is registered through its channels only (nsqlookupd
        registers the topic with each ``REGISTER topic channel``); a topic without
        any is registered alone.
        """
        wanted = registrations(self.nsqd)
        with_channels = {topic for topic, channel in wanted if channel}
        for topic, channel in sorted(wanted):
            if channel or topic not in with_channels:
                await self._send(stream, reader, "REGISTER", topic, channel)
            self.registered.add((topic, channel))

    async def _sync(self, stream, reader) -> None:
        wanted = registrations(self.nsqd)
        for topic, channel in sorted(self.registered - wanted, key=lambda r: (r[0], r[1] == "")):
            await self._send(stream, reader, "UNREGISTER", topic, channel)
            self.registered.discard((topic, channel))
        for topic, channel in sorted(wanted - self.registered):
            await self._send(stream, reader, "REGISTER", topic, channel)
            self.registered.add((topic, channel))

    async def _send(self, stream, reader, verb: str, topic: str, channel: str) -> None:
        await _write(stream, command(verb, topic, channel))
        response = await reader.next()
        if response != b"OK":
            log.warning("lookupd answered", lookupd=self.address, command=verb, topic=topic,
                        channel=channel, response=response.decode(errors="replace"))


async def _write(stream: trio.abc.Stream, data: bytes) -> None:
    """Send within ``RESPONSE_TIMEOUT``, as nsqd's one-second write deadline: a lookupd that stops
    reading fails the session, which reconnects, rather than wedging it for good."""
    with trio.fail_after(RESPONSE_TIMEOUT):
        await stream.send_all(data)


class _Responses:
    """``size(4) | data`` answers, bounded in size."""

    def __init__(self, stream: trio.abc.Stream, limit: int = 1024 * 1024) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._limit = limit

    async def next(self) -> bytes:
        with trio.fail_after(RESPONSE_TIMEOUT):
            while True:
                if len(self._buf) >= 4:
                    size = struct.unpack_from(">i", self._buf)[0]
                    if not 0 <= size <= self._limit:
                        raise ValueError(f"bad lookupd response size {size}")
                    if len(self._buf) >= 4 + size:
                        data = bytes(self._buf[4:4 + size])
                        del self._buf[:4 + size]
                        return data
                chunk = await self._stream.receive_some(65536)
                if not chunk:
                    raise EOFError("lookupd closed the connection")
                self._buf += chunk


async def lookup_loop(nsqd: Broker) -> None:
    """Run one peer per configured nsqlookupd until cancelled.

    A change of ``nsqlookupd_tcp_addresses`` at run time (``PUT /config``)
    stops the peers of addresses that went and starts peers for new ones,
    as Go nsqd's lookupLoop does on an options notification.
    """
    peers: dict[str, tuple[LookupPeer, trio.CancelScope]] = {}

    def notify() -> None:
        for peer, _ in peers.values():
            peer.notify()

    nsqd.on_topology_change.append(notify)
    nsqd.lookupd_http_addresses = lambda: [a for peer, _ in peers.values() if (a := peer.http_address)]
    nsqd.topic_channels = partial(topic_channels, connect_timeout=nsqd.options.http_client_connect_timeout,
                                  request_timeout=nsqd.options.http_client_request_timeout,
                                  limiter=trio.CapacityLimiter(MAX_CHANNEL_QUERIES))
    try:
        async with trio.open_nursery() as nursery:
            seen = -1
            while True:
                wanted = list(dict.fromkeys(nsqd.options.lookupd_tcp_addresses))
                for address in [a for a in peers if a not in wanted]:
                    peers.pop(address)[1].cancel()
                    log.info("lookupd removed", lookupd=address)
                for address in [a for a in wanted if a not in peers]:
                    peer = LookupPeer(nsqd, address)
                    scope = trio.CancelScope()
                    peers[address] = (peer, scope)
                    nursery.start_soon(_run_peer, peer, scope)
                seen = await nsqd.wait_options_changed(max(seen, nsqd.options_version))
    finally:
        nsqd.on_topology_change.remove(notify)
        nsqd.lookupd_http_addresses = list


async def _run_peer(peer: LookupPeer, scope: trio.CancelScope) -> None:
    with scope:
        await peer.run()


async def topic_channels(addresses: list[str], topic: str, *, connect_timeout: float,
                         request_timeout: float, limiter: trio.CapacityLimiter | None = None) -> list[str]:
    """The channels the nsqlookupds know for a topic (``GET /channels``), asked in parallel.

    What a new topic starts with, as nsqd's GetTopic asks: ``#ephemeral``
    ones are left out, and a lookupd that fails is logged and skipped, as is
    one asked while ``limiter``'s queries are all under way (each is a
    connection: 1,000 new topics and 50 slow lookupds had taken 19,000
    descriptors, and new clients were refused).
    """
    found: set[str] = set()
    target = "/channels?" + urlencode({"topic": topic})

    async def ask(address: str) -> None:
        headers = [("host", address), ("accept", "application/vnd.nsq; version=1.0")]
        if limiter is not None:
            try:
                limiter.acquire_on_behalf_of_nowait(token := object())
            except trio.WouldBlock:
                log.warning("lookupd channels query skipped: too many under way", lookupd=address, topic=topic,
                            limit=limiter.total_tokens)
                return
        try:
            host, port = split_host_port(address)
            body = await http_client.get(host, port, target, headers, connect_timeout, request_timeout)
            names = json.loads(body)["channels"]
            found.update(name for name in names if isinstance(name, str) and is_valid_channel_name(name)
                         and not name.endswith("#ephemeral"))
        except (http_client.ResponseError, ValueError, KeyError, TypeError, RecursionError,
                *http_client.FAILURES) as exc:
            log.warning("lookupd channels query failed", lookupd=address, topic=topic, error=str(exc) or type(exc).__name__)
        finally:
            if limiter is not None:
                limiter.release_on_behalf_of(token)

    async with trio.open_nursery() as nursery:
        for address in addresses:
            nursery.start_soon(ask, address)
    return sorted(found)
