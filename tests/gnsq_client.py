"""A gnsq (gevent) application, run as its own process by tests/test_gnsq.py.

It publishes with gnsq's Producer (PUB, MPUB, DPUB) to every nsqd given and
with its HTTP client (/pub, /mpub) to the first, asks nsqlookupd for the
topic's producers, then consumes the topic with a Consumer that knows only
the nsqlookupd address and finds the daemons through it. What it published,
received and looked up is printed as one JSON object.

    python tests/gnsq_client.py --topic T --channel C --lookupd-http URL \
        --nsqd-tcp HOST:PORT [--nsqd-tcp ...] --nsqd-http HOST:PORT
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

import gevent  # noqa: E402
import gnsq  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topic", required=True)
    parser.add_argument("--channel", required=True)
    parser.add_argument("--lookupd-http", required=True)
    parser.add_argument("--nsqd-tcp", action="append", required=True)
    parser.add_argument("--nsqd-http", required=True)
    parser.add_argument("--count", type=int, default=20, help="messages MPUB'd to each nsqd")
    parser.add_argument("--timeout", type=float, default=30)
    opts = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    topic = opts.topic

    published = []
    for index, address in enumerate(opts.nsqd_tcp):
        producer = gnsq.Producer(nsqd_tcp_addresses=[address])
        producer.start()
        batch = [f"tcp-{index}-{n}".encode() for n in range(opts.count)]
        assert producer.multipublish(topic, batch) == b"OK"
        assert producer.publish(topic, f"pub-{index}".encode()) == b"OK"
        assert producer.publish(topic, f"deferred-{index}".encode(), defer=200) == b"OK"
        producer.close()
        producer.join()
        published += [*batch, f"pub-{index}".encode(), f"deferred-{index}".encode()]

    host, port = opts.nsqd_http.rsplit(":", 1)
    http = gnsq.NsqdHTTPClient(host, int(port))
    http.publish(topic, b"http-pub")
    http.multipublish(topic, [b"http-mpub-1", b"http-mpub-2"])
    published += [b"http-pub", b"http-mpub-1", b"http-mpub-2"]
    info = http.info()

    lookupd = gnsq.LookupdClient.from_url(opts.lookupd_http)
    found = lookupd.lookup(topic)

    received = []
    consumer = gnsq.Consumer(topic, opts.channel, lookupd_http_addresses=[opts.lookupd_http],
                             max_in_flight=len(published), lookupd_poll_interval=1)

    @consumer.on_message.connect
    def handler(consumer, message):
        received.append(message.body)
        message.finish()
        if len(received) >= len(published):
            consumer.close()

    gevent.spawn_later(opts.timeout, consumer.close)
    consumer.start(block=True)

    print(json.dumps({
        "published": sorted(b.decode() for b in published),
        "received": sorted(b.decode() for b in received),
        "lookup": found,
        "info_version": info["version"],
    }))


if __name__ == "__main__":
    main()
