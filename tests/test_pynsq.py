"""pynsq, the official Python client, as a real publisher and consumer."""

import functools
import signal

import nsq
import pytest
import tornado.ioloop

from .support import Daemon


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    d.wait_ready_sync()
    yield d
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0


def run_loop(until, timeout=20.0):
    """Run tornado's loop until ``until()`` is true or the timeout passes."""
    loop = tornado.ioloop.IOLoop.current()
    checker = tornado.ioloop.PeriodicCallback(lambda: until() and loop.stop(), 20)
    checker.start()
    timer = loop.call_later(timeout, loop.stop)
    loop.start()
    checker.stop()
    loop.remove_timeout(timer)


def addr(daemon):
    return f"127.0.0.1:{daemon.port}"


def test_writer_mpub_and_reader_receive_everything(daemon):
    bodies = [b"msg-%04d" % i for i in range(500)]
    received = []
    published = []

    def handler(message):
        received.append(message.body)
        return True

    reader = nsq.Reader(topic="pynsq", channel="c", nsqd_tcp_addresses=[addr(daemon)],
                        message_handler=handler, max_in_flight=100, lookupd_poll_interval=1)
    writer = nsq.Writer([addr(daemon)])

    def publish():
        for i in range(0, 500, 100):
            writer.mpub("pynsq", bodies[i:i + 100], callback=lambda conn, data: published.append(data))

    tornado.ioloop.IOLoop.current().call_later(0.5, publish)
    run_loop(lambda: len(received) >= 500)
    reader.close()
    assert published and all(p == b"OK" for p in published)
    assert sorted(received) == bodies


def test_requeue_by_returning_false_counts_attempts(daemon):
    attempts = []

    def handler(message):
        attempts.append(message.attempts)
        return message.attempts >= 3  # fail twice, then finish

    reader = nsq.Reader(topic="retry", channel="c", nsqd_tcp_addresses=[addr(daemon)],
                        message_handler=handler, max_in_flight=1, max_tries=5,
                        requeue_delay=0, lookupd_poll_interval=1)
    writer = nsq.Writer([addr(daemon)])
    tornado.ioloop.IOLoop.current().call_later(0.5, lambda: writer.pub("retry", b"x"))
    run_loop(lambda: len(attempts) >= 3)
    reader.close()
    assert attempts[:3] == [1, 2, 3]


def test_async_handler_touch_and_finish_later(daemon):
    finished = []

    def handler(message):
        message.enable_async()
        loop = tornado.ioloop.IOLoop.current()
        loop.call_later(0.3, message.touch)
        loop.call_later(0.6, functools.partial(finish, message))

    def finish(message):
        message.finish()
        finished.append(message.body)

    reader = nsq.Reader(topic="slow", channel="c", nsqd_tcp_addresses=[addr(daemon)],
                        message_handler=handler, max_in_flight=10, lookupd_poll_interval=1)
    writer = nsq.Writer([addr(daemon)])
    tornado.ioloop.IOLoop.current().call_later(
        0.5, lambda: writer.mpub("slow", [b"a", b"b", b"c"]))
    run_loop(lambda: len(finished) >= 3)
    reader.close()
    assert sorted(finished) == [b"a", b"b", b"c"]


def test_deferred_publish_through_pynsq(daemon):
    got = []
    reader = nsq.Reader(topic="later", channel="c", nsqd_tcp_addresses=[addr(daemon)],
                        message_handler=lambda m: got.append(m.body) or True, max_in_flight=5,
                        lookupd_poll_interval=1)
    writer = nsq.Writer([addr(daemon)])
    loop = tornado.ioloop.IOLoop.current()
    start = []
    loop.call_later(0.5, lambda: (start.append(loop.time()), writer.dpub("later", 700, b"d")))
    run_loop(lambda: got)
    reader.close()
    assert got == [b"d"]
    assert loop.time() - start[0] >= 0.65
