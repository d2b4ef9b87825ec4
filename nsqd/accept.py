"""Accepting connections in bursts: every connection waiting in the backlog per wake-up.

Trio's ``SocketListener.accept`` yields after each connection, and every
pass of the scheduler also serves each busy connection, so with 250 clients
pipelining requests a backlog drained at about 15 connections a second and
new clients waited 11-19 s to be accepted. Go accepts in a goroutine of its
own. Here an accept loop takes, after the connection it waited for, whatever
else is already waiting (at most :data:`BURST`), without yielding between.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import structlog
import trio

#: most connections taken from the backlog per wake-up of an accept loop
BURST = 64
#: how long an accept loop backs off after a failed accept (descriptors run out: EMFILE)
RETRY_AFTER = 0.1


async def accept_loop(listener: trio.SocketListener, admit: Callable[[trio.SocketStream], None],
                      log: structlog.BoundLogger, what: str = "") -> None:
    """Accept until cancelled, handing every connection to ``admit``; a failed accept is logged
    (once per run of failures) and retried every RETRY_AFTER, and serving goes on."""
    acceptor = Acceptor(listener)
    failing = False
    try:
        while True:
            try:
                streams = await acceptor.accept()
            except OSError as exc:
                if not failing:
                    log.error(f"{what}accept failed, retrying every {RETRY_AFTER} s", error=str(exc))
                failing = True
                await trio.sleep(RETRY_AFTER)
                continue
            failing = False
            for stream in streams:
                admit(stream)
    finally:
        acceptor.close()


class Acceptor:
    """Accepts from one listening socket; close it with the listener."""

    def __init__(self, listener: trio.SocketListener) -> None:
        self.listener = listener
        # a second descriptor of the same socket, non-blocking, for the accepts that must not wait
        self._now = socket.socket(fileno=os.dup(listener.socket.fileno()))
        self._now.setblocking(False)

    async def accept(self) -> list[trio.SocketStream]:
        """The next connection and any others already waiting; raises what accept raises
        (EMFILE and friends) only when it has none to return."""
        streams = [await self.listener.accept()]
        while len(streams) < BURST:
            try:
                sock, _ = self._now.accept()
            except OSError:  # none waiting (EAGAIN), or a failure the next accept() reports
                break
            streams.append(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
        return streams

    def close(self) -> None:
        self._now.close()
