#!/usr/bin/env python3
"""AMQP 1.0 load generator for the gateway: publish and consume msgs/s.

The lean generator is the gateway's own engine used as a client
(``amqp_gateway.connection``) over one blocking socket: transfers come from
the engine's pre-encoded fast path (only frame size, delivery-id and tag
change per message), the message payload is encoded once, and consumed
deliveries are accepted with one disposition per range ``first..last`` per
read. A reference run uses python-qpid-proton's reactor, as an ordinary
client would.

Modes (``--mode``):

* ``pub``         ``--links`` sender links on one connection publish unsettled
                  ``--size``-byte messages for ``--duration`` s; a message
                  counts once the daemon accepted it (publisher confirm);
* ``sub``         one receiver link with ``--credit`` consumes ``--count``
                  messages (what ``pub`` left), accepting each;
* ``proton-pub``, ``proton-sub``  the same with proton's reactor;
* ``all``         pub, sub, proton-pub, proton-sub, then a summary.

``--spawn`` starts ``python -m nsqd`` on free ports with a fresh data dir and
reports the daemon's CPU per message from /proc (see nsq_bench.py).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from amqp_gateway import events as ev  # noqa: E402
from amqp_gateway.connection import Connection  # noqa: E402
from amqp_gateway.performatives import (  # noqa: E402
    RECEIVER, SENDER, SND_UNSETTLED, Accepted, Source, Target,
)
from amqp_gateway.sections import Data, Message, encode_message  # noqa: E402
from nsq_bench import BenchError, Daemon, free_port, machine_busy, proc_stats, wait_for_port  # noqa: E402

RECV_SIZE = 256 * 1024
TAG_POOL = [b"%08x" % i for i in range(1 << 16)]
ACCEPTED = Accepted()


class LeanClient:
    """Our engine as a blocking client: enough to attach links and move frames."""

    def __init__(self, address: tuple[str, int], name: str) -> None:
        self.sock = socket.create_connection(address, timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = Connection(client=True, container_id=name)
        self.conn.open()
        self.wait(lambda: self.conn.open_received)
        self.session = self.conn.begin()
        self.wait(lambda: self.session.begin_received)

    def flush(self) -> None:
        if self.conn.output:
            self.sock.sendall(self.conn.data_to_send())

    def read(self) -> list:
        data = self.sock.recv(RECV_SIZE)
        if not data:
            raise BenchError("connection closed by the daemon")
        events = self.conn.receive_data(data)
        for event in events:
            if isinstance(event, (ev.ConnectionClosed, ev.LinkDetached)):
                raise BenchError(f"daemon ended the link or connection: {event}")
        return events

    def wait(self, condition) -> None:
        while not condition():
            self.flush()
            self.read()

    def attach(self, name: str, role: bool, address: str):
        link = self.session.attach(name, role)
        if role is SENDER:
            link.attach(Source(), Target(address), snd_settle_mode=SND_UNSETTLED)
        else:
            link.attach(Source(address), Target())
        self.wait(lambda: link.attach_received)
        return link

    def close(self) -> None:
        self.conn.close()
        self.flush()
        self.sock.close()


def lean_pub(address, topic: str, duration: float, size: int, links: int) -> dict:
    client = LeanClient(address, "amqp-bench-pub")
    senders = [client.attach(f"pub-{i}", SENDER, f"/topics/{topic}") for i in range(links)]
    payload = encode_message(Message(body=[Data(b"x" * size)]))
    pool = len(TAG_POOL)
    sent = accepted = 0
    cpu0, t0 = time.process_time(), time.monotonic()
    end = t0 + duration
    sending = True
    while sending or accepted < sent:
        if sending:
            for link in senders:
                n = link.credit
                if n > 0:
                    k = sent % pool
                    tags = TAG_POOL[k:k + n] if k + n <= pool else TAG_POOL[k:] + TAG_POOL[:k + n - pool]
                    link.send_transfers(tags, [payload] * n, False)
                    sent += n
            client.flush()
        for event in client.read():
            if type(event) is ev.Settled:
                if type(event.state) is not Accepted:
                    raise BenchError(f"publish refused: {event.state}")
                accepted += len(event.tags)
        if sending and time.monotonic() >= end:
            sending = False
    t1 = time.monotonic()
    client.close()
    return {"msgs": accepted, "t0": t0, "t1": t1, "cpu": time.process_time() - cpu0}


def lean_sub(address, topic: str, channel: str, count: int, credit: int, timeout: float) -> dict:
    client = LeanClient(address, "amqp-bench-sub")
    link = client.attach("sub", RECEIVER, f"/topics/{topic}/channels/{channel}")
    cpu0, t0 = time.process_time(), time.monotonic()
    link.flow(credit)
    client.flush()
    got = 0
    last = t0
    client.sock.settimeout(timeout)
    while got < count:
        try:
            events = client.read()
        except socket.timeout:
            break
        dids = []
        for event in events:
            if type(event) is ev.Transfers:
                dids.extend(d[0] for d in event.deliveries)
        if dids:
            got += len(dids)
            last = time.monotonic()
            link.settle(dids, ACCEPTED)
            if link.credit < credit // 2:
                link.flow(credit)
            client.flush()
    client.close()
    return {"msgs": got, "t0": t0, "t1": last, "cpu": time.process_time() - cpu0}


def ensure_channel(address, topic: str, channel: str) -> None:
    """Create the channel (so published messages are kept for ``sub``) by attaching with no credit."""
    client = LeanClient(address, "amqp-bench-setup")
    client.attach("setup", RECEIVER, f"/topics/{topic}/channels/{channel}")
    client.close()


# ----------------------------------------------------------------- proton
def proton_pub(address, topic: str, duration: float, size: int) -> dict:
    from proton import Message as ProtonMessage
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class Pub(MessagingHandler):
        def __init__(self) -> None:
            super().__init__()
            self.sent = self.accepted = 0
            self.body = b"x" * size
            self.end = 0.0

        def on_start(self, event) -> None:
            conn = event.container.connect(f"{address[0]}:{address[1]}")
            event.container.create_sender(conn, f"/topics/{topic}")
            self.t0 = time.monotonic()
            self.end = self.t0 + duration

        def on_sendable(self, event) -> None:
            sender = event.sender
            while sender.credit and time.monotonic() < self.end:
                sender.send(ProtonMessage(body=self.body, inferred=True))
                self.sent += 1

        def on_accepted(self, event) -> None:
            self.accepted += 1
            if self.accepted == self.sent and time.monotonic() >= self.end:
                self.t1 = time.monotonic()
                event.connection.close()

        def on_rejected(self, event) -> None:
            raise BenchError("publish rejected")

    handler = Pub()
    cpu0 = time.process_time()
    Container(handler).run()
    return {"msgs": handler.accepted, "t0": handler.t0, "t1": handler.t1, "cpu": time.process_time() - cpu0}


def proton_sub(address, topic: str, channel: str, count: int, credit: int, timeout: float) -> dict:
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class Sub(MessagingHandler):
        def __init__(self) -> None:
            super().__init__(prefetch=credit, auto_accept=True)
            self.got = 0
            self.t1 = 0.0

        def on_start(self, event) -> None:
            self.conn = event.container.connect(f"{address[0]}:{address[1]}")
            event.container.create_receiver(self.conn, f"/topics/{topic}/channels/{channel}")
            self.t0 = self.t1 = time.monotonic()
            self.timer = event.container.schedule(timeout, self)

        def on_message(self, event) -> None:
            self.got += 1
            self.t1 = time.monotonic()
            if self.got >= count:
                self.timer.cancel()
                event.connection.close()

        def on_timer_task(self, event) -> None:
            if time.monotonic() - self.t1 >= timeout:
                self.conn.close()
            else:
                self.timer = event.container.schedule(timeout, self)

    handler = Sub()
    cpu0 = time.process_time()
    Container(handler).run()
    return {"msgs": handler.got, "t0": handler.t0, "t1": handler.t1, "cpu": time.process_time() - cpu0}


# ----------------------------------------------------------------- phases
def run_phase(name: str, what: str, pid: int | None, work) -> dict:
    before, busy0, wall0 = proc_stats(pid), machine_busy(), time.monotonic()
    result = work()
    after, busy1, wall1 = proc_stats(pid), machine_busy(), time.monotonic()
    msgs, elapsed = result["msgs"], max(result["t1"] - result["t0"], 1e-9)
    result["rate"] = msgs / elapsed
    print(f"{name} {what}: {result['rate']:.0f} msgs/s over {elapsed:.2f} s "
          f"[{msgs} msgs, generator cpu {result['cpu']:.2f} s]", flush=True)
    if before and after:
        cpu = after["cpu"] - before["cpu"]
        result["us_per_msg"] = cpu / max(msgs, 1) * 1e6
        span = max(wall1 - wall0, 1e-9)
        busy = (busy1 - busy0) / span
        print(f"{name} daemon: cpu {cpu:.2f} s, {result['us_per_msg']:.2f} us/msg, rss {after['VmRSS']:.1f} MB, "
              f"peak rss {after['VmHWM']:.1f} MB", flush=True)
        print(f"{name} machine: busy {busy:.2f} = nsqd {cpu / span:.2f} + generator {result['cpu'] / span:.2f} "
              f"+ other {busy - cpu / span - result['cpu'] / span:.2f} (cpus, averaged over {span:.1f} s)",
              flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="all", choices=("all", "pub", "sub", "proton-pub", "proton-sub"))
    parser.add_argument("--spawn", action="store_true", help="start a daemon on free ports for the run")
    parser.add_argument("--nsqd-args", default="", help="extra flags for the spawned daemon")
    parser.add_argument("--keep", action="store_true", help="keep the spawned daemon's data and log")
    parser.add_argument("--amqp-address", default="127.0.0.1:5672")
    parser.add_argument("--pid", type=int, help="the daemon's pid, for its CPU figures")
    parser.add_argument("--topic", default="amqp_bench")
    parser.add_argument("--channel", default="ch")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--links", type=int, default=1, help="sender links of the lean publisher")
    parser.add_argument("--credit", type=int, default=1000, help="link credit of the consumers")
    parser.add_argument("--count", type=int, default=0, help="messages to consume (default: what pub left)")
    parser.add_argument("--timeout", type=float, default=5.0, help="consumers stop after this long without a message")
    opts = parser.parse_args(argv)

    daemon = None
    pid = opts.pid
    host, _, port = opts.amqp_address.rpartition(":")
    address = (host, int(port))
    if opts.spawn:
        address = ("127.0.0.1", free_port())
        daemon = Daemon([f"--amqp-address=127.0.0.1:{address[1]}", "--log-level=warn", *opts.nsqd_args.split()],
                        opts.keep)
        wait_for_port(address, daemon.proc, daemon.log_path)
        pid = daemon.pid
    try:
        results = {}
        modes = ("pub", "sub", "proton-pub", "proton-sub") if opts.mode == "all" else (opts.mode,)
        for mode in modes:
            topic = opts.topic if mode in ("pub", "sub") else opts.topic + "_proton"
            if mode.endswith("pub"):
                ensure_channel(address, topic, opts.channel)
                if mode == "pub":
                    work = lambda: lean_pub(address, topic, opts.duration, opts.size, opts.links)  # noqa: E731
                else:
                    work = lambda: proton_pub(address, topic, opts.duration, opts.size)  # noqa: E731
                results[mode] = run_phase(mode, "publish (unsettled, accepted)", pid, work)
            else:
                published = results.get(mode.replace("sub", "pub"), {}).get("msgs", 0)
                count = opts.count or published or 1_000_000
                if mode == "sub":
                    work = lambda: lean_sub(address, topic, opts.channel, count, opts.credit, opts.timeout)  # noqa: E731
                else:
                    work = lambda: proton_sub(address, topic, opts.channel, count, opts.credit, opts.timeout)  # noqa: E731
                results[mode] = run_phase(mode, "consume (accepted)", pid, work)
        if len(results) > 1:
            print("\nsummary")
            for mode, r in results.items():
                cpu = f"{r['us_per_msg']:.2f} us/msg" if "us_per_msg" in r else "-"
                print(f"  {mode:<11} {r['rate']:>9.0f} msgs/s  daemon {cpu}")
    finally:
        if daemon is not None:
            daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
