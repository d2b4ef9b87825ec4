"""The daemon's start-up: builds the core and starts the services around it.

:class:`NSQD` is the :class:`~nsqd.broker.Broker` (topics, publishing,
subscriptions, storage) plus the services that make it a daemon: the NSQ TCP
listener, the HTTP and HTTPS API, the AMQP gateway, nsqlookupd registration
and statsd. Dependencies point one way: this module imports the front ends
and the core, the front ends import the core, and the core imports neither.

Lifecycle::

    serve()
      broker.running() ...... storage, metadata, core loops (see nsqd.broker)
        services nursery .... listeners, connections, lookupd, statsd,
                              option changes applied at run time
        wait for SIGTERM/SIGINT, drain, stop the services
      (the broker then writes what memory holds to disk)
"""

from __future__ import annotations

import gc
import signal
from contextlib import contextmanager
from functools import partial

import structlog
import trio

from . import gc_pauses
from .broker import Broker, MetadataError
from .diskq import DiskQueueError
from .logs import configure_logging
from .options import Options, join_host_port, split_host_port
from .version import version_string

log = structlog.get_logger("nsqd")


class NSQD(Broker):
    def __init__(self, options: Options) -> None:
        super().__init__(options)
        gc_pauses.install()  # /stats, /metrics and statsd report the collector's pauses
        self.connections_nursery: trio.Nursery | None = None
        self._shutdown = trio.Event()
        self.ready = trio.Event()

    async def _run_connections(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.connections_nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def _apply_option_changes(self) -> None:
        """Options changed at run time reach what uses them (the log level here; lookupd peers watch too)."""
        seen = self.options_version
        level = self.options.log_level
        while True:
            seen = await self.wait_options_changed(seen)
            if self.options.log_level != level and structlog.is_configured():  # not when embedded
                level = self.options.log_level
                configure_logging(self.options)

    def request_shutdown(self) -> None:
        self._shutdown.set()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from amqp_gateway import serve_amqp

        from .http_api import serve_http
        from .lookup import lookup_loop
        from .statsd import statsd_loop
        from .tcp import serve_tcp

        log.info(version_string())
        log.info(f"ID: {self.options.node_id}")
        async with self.running():
            async with trio.open_nursery() as services:
                await services.start(self._run_connections)
                host, port = split_host_port(self.options.tcp_address)
                with _bind_errors(self.options.tcp_address):
                    tcp_listeners = await trio.open_tcp_listeners(port, host=host or None)
                self.tcp_addresses = [l.socket.getsockname()[:2] for l in tcp_listeners]
                await services.start(serve_tcp, self, tcp_listeners, self.connections_nursery)
                _listening("TCP", self.tcp_addresses)
                if self.options.http_address:
                    with _bind_errors(self.options.http_address):
                        self.http_addresses = await services.start(serve_http, self, self.options.http_address)
                    _listening("HTTP", self.http_addresses)
                if self.options.https_address and self.tls_context is not None:  # as Go: only with a cert
                    with _bind_errors(self.options.https_address):
                        self.https_addresses = await services.start(
                            partial(serve_http, https=True), self, self.options.https_address)
                    _listening("HTTPS", self.https_addresses)
                if self.options.amqp_address:
                    with _bind_errors(self.options.amqp_address):
                        self.amqp_addresses = await services.start(serve_amqp, self, self.options.amqp_address)
                    _listening("AMQP", self.amqp_addresses)
                if self.options.amqps_address:  # validate() made sure there is a certificate
                    with _bind_errors(self.options.amqps_address):
                        self.amqps_addresses = await services.start(
                            partial(serve_amqp, tls_context=self.tls_context), self, self.options.amqps_address)
                    _listening("AMQPS", self.amqps_addresses)
                services.start_soon(lookup_loop, self)
                services.start_soon(statsd_loop, self)
                services.start_soon(self._apply_option_changes)
                self.ready.set()
                task_status.started(self)
                await self._shutdown.wait()
                await self.drain()
                for kind, addresses in (("TCP", self.tcp_addresses), ("HTTP", self.http_addresses),
                                        ("HTTPS", self.https_addresses), ("AMQP", self.amqp_addresses),
                                        ("AMQPS", self.amqps_addresses)):
                    for host, port in addresses:
                        log.info(f"{kind}: closing {join_host_port(host, port)}")
                services.cancel_scope.cancel()


@contextmanager
def _bind_errors(address: str):
    """A listener that cannot bind fails as Go's does: ``listen (127.0.0.1:4150) failed - <reason>``."""
    try:
        yield
    except OSError as exc:
        raise OSError(f"listen ({address}) failed - {exc.strerror or exc}") from exc


def _listening(kind: str, addresses: list[tuple[str, int]]) -> None:
    """Go nsqd's ``TCP: listening on 127.0.0.1:4150``, one per bound socket: tools read the ports from it."""
    for host, port in addresses:
        log.info(f"{kind}: listening on {join_host_port(host, port)}")


#: the garbage collector's thresholds while the daemon runs. A single PUB and
#: its answer allocate a few dozen container objects, so Python's default
#: (700, 10, 10) ran a young collection every couple of dozen PUBs; with
#: 10,000 a collection looks at more objects but at fewer survivors each
#: time. Durable single PUBs from 100 publishers: 31.9-32.5 -> 29.9-30.8
#: us of daemon CPU each; MPUB rates and the RSS of a 200k backlog unchanged.
GC_THRESHOLDS = (10_000, 20, 20)


def run(options: Options) -> int:
    """Run the daemon until SIGINT or SIGTERM; returns the exit status."""

    daemon: list[NSQD] = []

    async def main() -> None:
        nsqd = NSQD(options)
        daemon.append(nsqd)
        async with trio.open_nursery() as nursery:
            async def on_signals() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        log.info("signal received", signal=signal.Signals(signum).name)
                        nsqd.request_shutdown()
                        return

            nursery.start_soon(on_signals)
            await nsqd.serve()
            nursery.cancel_scope.cancel()

    failures: list[BaseException] = []
    gc.freeze()  # what start-up made (modules, options) lives as long as the process: never scan it again
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        trio.run(main)
    except* (OSError, MetadataError, DiskQueueError) as group:  # a port in use, bad nsqd.dat or queue: one line
        failures = list(_leaves(group))
    if failures:
        started = bool(daemon) and daemon[0].ready.is_set()
        log.critical(str(failures[0]) if started else f"failed to start nsqd - {failures[0]}")
        return 1
    log.info("NSQ: bye")
    return 0


def _leaves(error: BaseException):
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error
