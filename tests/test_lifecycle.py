"""What a SIGKILL leaves of queues whose messages were deferred, finished or given back (docs/durability.md)."""

import signal
import time

import pytest
import trio

from .support import Daemon, NSQConnection, consume_distinct, free_port


async def restarted(tmp_path, *flags) -> tuple[Daemon, NSQConnection]:
    daemon = Daemon(tmp_path, *flags)
    await daemon.wait_ready()
    conn = await NSQConnection.open(daemon.port)
    await conn.sub("t", "c")
    return daemon, conn


async def test_a_dpub_with_mem_queue_size_0_survives_sigkill_with_its_due_time(tmp_path):
    # --mem-queue-size=0 promises "nothing confirmed lost, in-flight and deferred messages included"
    flags = ("--mem-queue-size=0", "--sync-timeout=100ms")
    daemon, conn = await restarted(tmp_path, *flags)
    await conn.dpub("t", 2500, b"later")
    published = time.monotonic()
    await trio.sleep(0.5)
    assert await daemon.stop(signal.SIGKILL) == -signal.SIGKILL

    daemon, conn = await restarted(tmp_path, *flags)
    await conn.command("RDY 10")
    msg = await conn.read_message(timeout=5)
    assert (msg.body, msg.attempts) == (b"later", 1)
    assert time.monotonic() - published >= 2.4
    assert await daemon.stop() == 0


async def test_fin_and_req_after_a_quiet_period_are_checkpointed_before_sigkill(tmp_path):
    # "within --sync-timeout of a quiet period none at all" are delivered again
    flags = ("--mem-queue-size=0", "--sync-timeout=100ms")
    daemon, conn = await restarted(tmp_path, *flags)
    await conn.mpub("t", [b"finished", b"requeued"])
    await conn.command("RDY 2")
    finished, requeued = [await conn.read_message() for _ in range(2)]
    await trio.sleep(0.5)  # the reads are checkpointed while the messages are in flight
    await conn.command(b"FIN " + finished.id)
    await conn.command(b"REQ " + requeued.id + b" 60000")
    await trio.sleep(0.6)  # six sync timeouts
    assert await daemon.stop(signal.SIGKILL) == -signal.SIGKILL

    daemon, conn = await restarted(tmp_path, *flags)
    await conn.pub("t", b"marker")
    await conn.command("RDY 10")
    msg = await conn.read_message(timeout=3)
    assert msg.body == b"marker"  # neither the finished nor the requeued (not yet due) one came back
    assert await daemon.stop() == 0


async def test_what_the_http_api_created_or_deleted_holds_after_a_sigkill_right_after_its_200(tmp_path):
    """A deleted channel that came back would collect every new message for no one."""
    from .conftest import HTTPClient
    from .support import free_port

    port = free_port()
    daemon = Daemon(tmp_path, f"--http-address=127.0.0.1:{port}")
    await daemon.wait_ready()
    http = HTTPClient(port)
    for path in ["/topic/create?topic=t", "/channel/create?topic=t&channel=a",
                 "/channel/create?topic=t&channel=b", "/topic/create?topic=u",
                 "/channel/create?topic=u&channel=c"]:
        assert (await http.post(path)).status == 200
    await trio.sleep(0.3)  # all of that saved; now each change is killed right after its answer
    assert (await http.post("/channel/delete?topic=t&channel=b")).status == 200
    assert (await http.post("/topic/delete?topic=u")).status == 200
    assert (await http.post("/channel/create?topic=t&channel=new")).status == 200
    assert await daemon.stop(signal.SIGKILL) == -signal.SIGKILL

    daemon = Daemon(tmp_path, f"--http-address=127.0.0.1:{port}")
    try:
        await daemon.wait_ready()
        stats = (await http.get("/stats?format=json")).json()
        topics = {t["topic_name"]: sorted(c["channel_name"] for c in t["channels"]) for t in stats["topics"]}
        assert topics == {"t": ["a", "new"]}
    finally:
        assert await daemon.stop() == 0


@pytest.mark.parametrize("flags, durable_header", [
    (("--mem-queue-size=0",), False),  # accepted once written, as an NSQ OK
    (("--durable",), False),           # accepted once fsynced
    ((), True),                        # default flags: a message marked durable is fsynced before accepted
], ids=["mem-queue-size-0", "durable", "durable-header"])
async def test_what_amqp_accepted_survives_a_sigkill_right_after(tmp_path, flags, durable_header):
    """An AMQP publisher's ``accepted`` is the same promise as an NSQ OK (and a message whose header
    says durable is fsynced first, whatever the flags): a SIGKILL at once loses none of them."""
    from proton import Message
    from proton.utils import BlockingConnection

    amqp_port = free_port()
    daemon = Daemon(tmp_path, f"--amqp-address=127.0.0.1:{amqp_port}", *flags)
    await daemon.wait_ready()

    def publish() -> None:
        conn = BlockingConnection(f"127.0.0.1:{amqp_port}", timeout=10)
        sender = conn.create_sender("/topics/t")
        for i in range(300):  # each send returns once the daemon settled it accepted
            sender.send(Message(body=b"m%d" % i, durable=durable_header))
        conn.close()

    conn = await NSQConnection.open(daemon.port)
    await conn.sub("t", "c")  # the channel exists before the publishes
    await trio.to_thread.run_sync(publish)
    assert await daemon.stop(signal.SIGKILL) == -signal.SIGKILL

    daemon = Daemon(tmp_path, *flags)
    await daemon.wait_ready()
    got = await consume_distinct(daemon.port, "t", "c", 300)
    assert got == {b"m%d" % i for i in range(300)}
    assert await daemon.stop() == 0
