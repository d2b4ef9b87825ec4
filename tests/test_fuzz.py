"""Random and mutated input on all four ports of a daemon running as a subprocess.

A seeded generator (the seed is printed; ``NSQD_FUZZ_SEED`` fixes it) builds
valid NSQ V2 sessions (plain, deflate and snappy), HTTP requests and AMQP
sessions (plain, and over TLS on the amqps port), mutates them (bit flips, extreme numbers, cut, repeated and
inserted bytes) and throws them at the daemon, many connections at once.
After each batch: the process is alive, ``/ping`` answers within 100 ms,
a fresh client can publish and consume, and no TCP or AMQP connection has
failed with a traceback. About two minutes in all.
"""

from __future__ import annotations

import json
import os
import random
import ssl
import struct
import subprocess
import sys
import time
import zlib

from functools import partial

import snappy
import trio
import trustme

from amqp_gateway import performatives as p
from amqp_gateway.connection import Connection
from amqp_gateway.sasl import SaslClient, SaslServer
from amqp_gateway.sections import Data, Message, encode_message

from .conftest import HTTPClient
from .support import NSQConnection, free_port

BATCHES = 120
CONNECTIONS_PER_PORT = 12
#: how long a fuzz connection may take to send and read before it is dropped
CONNECTION_TIME = 0.3

INTERESTING_INTS = [0, 1, -1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, -(2**31), 5 * 1024 * 1024 + 1]
INTERESTING_TEXT = [b"0", b"-1", b"", b"4294967296", b"18446744073709551617", b"9" * 5000, b"1e400", b"NaN",
                    b"Infinity", b"\xff\xfe", b" ", b"\r", b"%00", b"../"]


# ----------------------------------------------------------------- mutation
def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 5)):
        if not out:
            out += rng.randbytes(rng.randint(1, 64))
            continue
        i = rng.randrange(len(out))
        op = rng.randrange(9)
        if op == 0:
            out[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            out[i] = rng.randrange(256)
        elif op == 2:
            del out[i:i + rng.randint(1, 32)]
        elif op == 3:
            out[i:i] = rng.randbytes(rng.randint(1, 32))
        elif op == 4:
            out[i:i] = bytes(out[i:i + rng.randint(1, 64)]) * rng.randint(2, 50)
        elif op == 5:
            out[i:i + 4] = struct.pack(">i" if rng.random() < 0.5 else "<i",
                                       max(-(2**31), min(2**31 - 1, rng.choice(INTERESTING_INTS))))
        elif op == 6:
            out[i:i + rng.randint(0, 8)] = rng.choice(INTERESTING_TEXT)
        elif op == 7:
            del out[i:]
        else:
            out[i:i] = b"\n" if rng.random() < 0.5 else b"\x00"
    return bytes(out)


def maybe_mutate(rng: random.Random, data: bytes) -> bytes:
    roll = rng.random()
    if roll < 0.15:
        return data  # valid input must keep working too
    if roll < 0.25:
        return rng.randbytes(rng.randint(1, 4096))
    return mutate(rng, data)


def chunks(rng: random.Random, data: bytes) -> list[bytes]:
    """The bytes split into the reads a slow or bursty client would cause."""
    if rng.random() < 0.6 or len(data) < 2:
        return [data]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 6))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


# ------------------------------------------------------------------ corpora
def nsq_body(data: bytes) -> bytes:
    return struct.pack(">i", len(data)) + data


def nsq_session(rng: random.Random) -> tuple[dict, bytes]:
    """An IDENTIFY (maybe negotiating compression) and the commands after it."""
    identify = {"client_id": rng.choice(["fz", "x" * 300, "\u00e9"]), "heartbeat_interval": rng.choice([1000, 30000, -1]),
                "feature_negotiation": rng.random() < 0.5}
    compression = rng.choice([None, None, "deflate", "snappy"])
    if compression and identify["feature_negotiation"]:
        identify[compression] = True
    else:
        compression = None
    topic = rng.choice(["fz", "fz#ephemeral", "fz.other"])
    mid = b"%016x" % rng.getrandbits(64)
    commands = [
        b"PUB " + topic.encode() + b"\n" + nsq_body(rng.randbytes(rng.randint(1, 200))),
        b"MPUB " + topic.encode() + b"\n" + nsq_body(struct.pack(">i", 2) + nsq_body(b"a") + nsq_body(b"bb")),
        b"DPUB " + topic.encode() + b" 100\n" + nsq_body(b"later"),
        b"SUB " + topic.encode() + b" ch\n", b"RDY 5\n", b"FIN " + mid + b"\n", b"REQ " + mid + b" 10\n",
        b"TOUCH " + mid + b"\n", b"NOP\n", b"CLS\n", b"AUTH\n" + nsq_body(b"secret"), b"LEASE l\n",
        b"LFIN l\n", b"IDENTIFY\n" + nsq_body(b"{}"),
    ]
    picked = b"".join(rng.choice(commands) for _ in range(rng.randint(1, 12)))
    return {"identify": identify, "compression": compression}, picked


def http_request(rng: random.Random, port: int) -> bytes:
    topic = rng.choice(["fz", "fz2", "bad topic", ""])
    method, path, body = rng.choice([
        ("GET", "/ping", b""), ("GET", "/info", b""), ("GET", "/stats?format=json", b""),
        ("GET", "/stats?format=text&topic=fz", b""), ("POST", f"/pub?topic={topic}", b"hello"),
        ("POST", f"/pub?topic={topic}&defer=100", b"later"), ("POST", f"/mpub?topic={topic}", b"a\nb\n\nc"),
        ("POST", f"/mpub?topic={topic}&binary=true", struct.pack(">i", 1) + nsq_body(b"x")),
        ("POST", f"/topic/create?topic={topic}", b""), ("POST", f"/channel/create?topic={topic}&channel=c", b""),
        ("POST", f"/channel/pause?topic={topic}&channel=c", b""), ("POST", f"/topic/empty?topic={topic}", b""),
        ("GET", "/config/max_msg_size", b""), ("GET", "/metrics", b""), ("GET", "/nope", b""),
    ])
    headers = [f"Host: 127.0.0.1:{port}"]
    if body or method == "POST":
        headers.append(f"Content-Length: {len(body)}")
    if rng.random() < 0.3:
        headers.append("Connection: close")
    request = f"{method} {path} HTTP/1.1\r\n{''.join(h + chr(13) + chr(10) for h in headers)}\r\n".encode() + body
    return request * rng.choice([1, 1, 2, 3])  # sometimes pipelined


def amqp_session(rng: random.Random) -> tuple[bytes, bytes]:
    """What a client sends: header (maybe SASL), open, begin and attaches; then (once the
    gateway granted credit) transfers, flows and the end.

    Our engine plays the client against an engine playing the server, in
    memory, so the bytes are those of a real exchange.
    """
    sasl = rng.random() < 0.3
    client = Connection(client=True, container_id="fuzz", sasl=SaslClient() if sasl else None,
                        idle_timeout=rng.choice([None, 30.0]))
    server = Connection(client=False, container_id="server", sasl=SaslServer() if sasl else None)
    sent = []

    def pump() -> None:
        while client.output or server.output:
            data = client.data_to_send()
            sent.append(data)
            server.receive_data(data)
            client.receive_data(server.data_to_send())

    client.open()
    pump()
    session = client.begin()
    pump()
    sender = session.attach("pub", p.SENDER)
    sender.attach(p.Source(), p.Target(rng.choice(["/topics/fz", "/topics/bad topic", "/nope", ""])),
                  snd_settle_mode=rng.choice([p.SND_UNSETTLED, p.SND_SETTLED]))
    receiver = session.attach("sub", p.RECEIVER)
    receiver.attach(p.Source(rng.choice(["/topics/fz/channels/c", "/topics/fz", "/x"])), p.Target())
    opening = b"".join(sent) + client.data_to_send()
    sender.credit = 10  # as the gateway grants
    payload = encode_message(Message(body=[Data(rng.randbytes(rng.randint(1, 100)))]))
    count = rng.randint(1, 5)
    sender.send_transfers([b"%d" % i for i in range(count)], [payload] * count, False)
    receiver.flow(rng.choice([0, 1, 10, 2**32 - 1]), echo=rng.random() < 0.5)
    if rng.random() < 0.5:
        sender.detach(closed=True)
        session.end()
        client.close()
    return opening, client.data_to_send()


def compress(kind: str, data: bytes) -> bytes:
    if kind == "deflate":
        c = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
        return c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)
    return snappy.StreamCompressor().add_chunk(data)


# --------------------------------------------------------------- the client
async def throw(port: int, parts: list[bytes], pause: float, tls: ssl.SSLContext | None = None) -> None:
    """Send, read whatever comes back for a moment, hang up; any network error is the fuzz's business.

    With ``tls`` the parts go over TLS (the handshake first)."""
    with trio.move_on_after(CONNECTION_TIME):
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            if tls is not None:
                stream = trio.SSLStream(stream, tls, server_hostname="127.0.0.1")
            async with stream:
                async with trio.open_nursery() as nursery:
                    async def read():
                        while await stream.receive_some(65536):
                            pass

                    nursery.start_soon(read)
                    for part in parts:
                        await stream.send_all(part)
                        if pause:
                            await trio.sleep(pause)
                    await trio.sleep(CONNECTION_TIME)
        except* (OSError, trio.BrokenResourceError, trio.ClosedResourceError):  # ssl.SSLError is an OSError
            pass


async def nsq_case(rng: random.Random, port: int) -> None:
    settings, commands = nsq_session(rng)
    identify = json.dumps(settings["identify"]).encode()
    head = b"  V2IDENTIFY\n" + nsq_body(identify)
    if settings["compression"]:
        # the upgrade happens after IDENTIFY's answer; what follows is compressed (or garbage)
        tail = compress(settings["compression"], maybe_mutate(rng, commands)) if rng.random() < 0.7 \
            else rng.randbytes(rng.randint(1, 2048))
        await throw(port, [head, maybe_mutate(rng, tail) if rng.random() < 0.3 else tail], pause=0.05)
    else:
        await throw(port, chunks(rng, maybe_mutate(rng, head + commands)), pause=0.01 * rng.random())


async def http_case(rng: random.Random, port: int) -> None:
    await throw(port, chunks(rng, maybe_mutate(rng, http_request(rng, port))), pause=0.01 * rng.random())


async def amqp_case(rng: random.Random, port: int, tls: ssl.SSLContext | None = None) -> None:
    opening, rest = amqp_session(rng)
    await throw(port, [maybe_mutate(rng, opening), maybe_mutate(rng, rest)], pause=0.05, tls=tls)


async def amqps_case(rng: random.Random, port: int, tls: ssl.SSLContext) -> None:
    """Mostly an AMQP session over TLS; sometimes plain bytes where the TLS handshake should be."""
    if rng.random() < 0.3:
        await amqp_case(rng, port)
    else:
        await amqp_case(rng, port, tls)


async def fresh_client_publishes_and_consumes(port: int, batch: int) -> None:
    topic = f"check{batch}"
    with trio.fail_after(10):
        pub = await NSQConnection.open(port)
        await pub.pub(topic, b"batch %d" % batch)
        sub = await NSQConnection.open(port)
        await sub.sub(topic, "c")
        await sub.command("RDY 1")
        msg = await sub.read_message()
        assert msg.body == b"batch %d" % batch
        await sub.command(b"FIN " + msg.id)
        await pub.close()
        await sub.close()


async def ping_time(http: HTTPClient) -> float:
    """The fastest of three /ping round trips: the machine is shared, and a daemon whose
    event loop some input holds fails all three."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        response = await http.get("/ping")
        assert (response.status, response.body) == (200, b"OK")
        best = min(best, time.perf_counter() - start)
    return best


def failed_connections(log_path) -> list[str]:
    text = log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if "connection failed" in line]


async def test_fuzz_all_four_ports(tmp_path):
    seed = int(os.environ.get("NSQD_FUZZ_SEED") or random.SystemRandom().getrandbits(32))
    print(f"fuzz seed {seed} (set NSQD_FUZZ_SEED={seed} to repeat)")
    rng = random.Random(seed)
    tcp, http_port, amqp, amqps = free_port(), free_port(), free_port(), free_port()
    log_path = tmp_path / "nsqd.log"
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    tls = ssl.create_default_context()
    ca.configure_trust(tls)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nsqd", f"--tcp-address=127.0.0.1:{tcp}", f"--http-address=127.0.0.1:{http_port}",
             f"--amqp-address=127.0.0.1:{amqp}", f"--amqps-address=127.0.0.1:{amqps}",
             f"--tls-cert={tmp_path / 'server.pem'}", f"--tls-key={tmp_path / 'server.pem'}",
             f"--data-path={tmp_path / 'data'}", "--shutdown-grace=0",
             "--log-level=warn"],
            stdout=subprocess.DEVNULL, stderr=log)
    try:
        http = HTTPClient(http_port)
        with trio.fail_after(20):
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    await http.get("/ping")
                    break
                except OSError:
                    await trio.sleep(0.05)
        for batch in range(BATCHES):
            where = f"seed {seed}, batch {batch}"
            cases = [(nsq_case, tcp), (http_case, http_port), (amqp_case, amqp),
                     (partial(amqps_case, tls=tls), amqps)]
            async with trio.open_nursery() as nursery:
                for case, port in cases:
                    for _ in range(CONNECTIONS_PER_PORT):
                        nursery.start_soon(case, random.Random(rng.getrandbits(64)), port)
            try:
                assert proc.poll() is None, "the daemon died"
                with trio.fail_after(10):
                    elapsed = await ping_time(http)
                assert elapsed < 0.1, f"/ping took {elapsed * 1000:.0f} ms"
                await fresh_client_publishes_and_consumes(tcp, batch)
                failed = failed_connections(log_path)
                assert not failed, failed[:3]
            except Exception as exc:
                with trio.move_on_after(2):  # a daemon on its way out: let it finish writing why
                    while proc.poll() is None:
                        await trio.sleep(0.05)
                raise AssertionError(f"{where}: {exc!r}; the daemon's log ends with:\n"
                                     f"{log_path.read_text(errors='replace')[-8000:]}") from None
    finally:
        proc.terminate()
        proc.wait(30)
