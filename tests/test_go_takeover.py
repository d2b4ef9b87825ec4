"""Taking over a data directory written by Go nsqd: metadata and diskqueue backlog."""

import json
import struct

from .conftest import HTTPClient
from .support import NSQConnection, running_nsqd, tcp_port


def go_message(msg_id: bytes, body: bytes, attempts: int = 1, ts: int = 1_700_000_000_000_000_000) -> bytes:
    return struct.pack(">qH", ts, attempts) + msg_id + body


def write_go_queue(data_path, name: str, payloads: list[bytes], read_index: int = 0) -> None:
    """Files in go-diskqueue's layout: one segment, 4-byte length prefixes, text metadata."""
    records = [struct.pack(">I", len(p)) + p for p in payloads]
    (data_path / f"{name}.diskqueue.000000.dat").write_bytes(b"".join(records))
    read_pos = sum(len(r) for r in records[:read_index])
    write_pos = sum(len(r) for r in records)
    depth = len(payloads) - read_index
    (data_path / f"{name}.diskqueue.meta.dat").write_text(f"{depth}\n0,{read_pos}\n0,{write_pos}\n")


def write_go_metadata(data_path, topics: dict[str, dict]) -> None:
    doc = {"topics": [
        {"channels": [{"name": c, "paused": p} for c, p in spec["channels"].items()],
         "name": name, "paused": spec.get("paused", False)}
        for name, spec in topics.items()], "version": "1.2.1"}
    (data_path / "nsqd.dat").write_text(json.dumps(doc))


async def test_go_data_directory_is_taken_over(tmp_path):
    write_go_metadata(tmp_path, {"t": {"channels": {"c": False, "p": True}}, "quiet": {"channels": {}, "paused": True}})
    channel_msgs = [go_message(b"%016x" % i, b"chan-%d" % i, attempts=2) for i in range(5)]
    write_go_queue(tmp_path, "t:c", channel_msgs, read_index=1)  # the first one was already read
    topic_msgs = [go_message(b"%016x" % (100 + i), b"topic-%d" % i) for i in range(3)]
    write_go_queue(tmp_path, "t", topic_msgs)

    async with running_nsqd(tmp_path) as nsqd:
        topic = nsqd.topics["t"]
        assert set(topic.channels) == {"c", "p"}
        assert topic.channels["p"].paused and nsqd.topics["quiet"].paused
        assert not list(tmp_path.glob("*.diskqueue.*"))  # Go files are gone once imported
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.sub("t", "c")
        await conn.command("RDY 20")
        got = {}
        for _ in range(7):
            msg = await conn.read_message()
            got[msg.body] = msg
            await conn.command(b"FIN " + msg.id)
        assert set(got) == {b"chan-%d" % i for i in range(1, 5)} | {b"topic-%d" % i for i in range(3)}
        # the Go id, timestamp and attempts come across (attempts count this delivery)
        assert got[b"chan-1"].id == b"%016x" % 1 and got[b"chan-1"].attempts == 2
        assert got[b"chan-1"].timestamp == 1_700_000_000_000_000_000
        assert topic.channels["p"].depth == 3  # the paused channel got the topic backlog too

    async with running_nsqd(tmp_path) as nsqd:  # no second import, no duplicates
        assert nsqd.topics["t"].channels["c"].depth == 0
        assert nsqd.topics["t"].channels["p"].depth == 3


async def test_go_files_that_cannot_be_read_refuse_the_publish_not_the_daemon(tmp_path):
    """A Go segment that cannot be read (here a directory where the file should be) makes the
    topic's storage fail: the publish is refused as any storage failure is (503 over HTTP,
    E_PUB_FAILED over TCP), Go's files stay for a later try, and other topics go on."""
    (tmp_path / "orders.diskqueue.000000.dat").mkdir()
    async with running_nsqd(tmp_path, http_address="127.0.0.1:0") as nsqd:
        http = HTTPClient(nsqd.http_addresses[0][1])
        response = await http.request("POST", "/pub?topic=orders", b"hello")
        assert response.status == 503
        assert "cannot take over Go nsqd's files" in response.json()["message"]
        conn = await NSQConnection.open(tcp_port(nsqd))
        await conn.command("PUB orders", b"hello")
        await conn.expect_error("E_PUB_FAILED")
        await conn.pub("payments", b"still served")  # the error was not fatal
        response = await http.request("POST", "/pub?topic=payments", b"hello")
        assert (response.status, response.body) == (200, b"OK")
    assert (tmp_path / "orders.diskqueue.000000.dat").is_dir()
