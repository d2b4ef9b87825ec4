"""Channel and in-flight bookkeeping, driven directly (no sockets, no disk)."""

import pytest

from nsqd import message
from nsqd.channel import Channel
from nsqd.in_flight import InFlight

S = 1_000_000_000


class Consumer:
    """A consumer that takes what it is given (the unit-test stand-in for a client)."""

    def __init__(self, rdy=100):
        self.in_flight = InFlight()
        self.rdy = rdy
        self.woken = 0
        self.timed_out = 0
        self.closed = False

    def wake(self):
        self.woken += 1
        return max(self.rdy - len(self.in_flight), 0)

    def messages_timed_out(self, count):
        self.timed_out += count

    def close(self):
        self.closed = True

    def fill(self, channel, now, timeout=60 * S):
        got = []
        for ids, frames in channel.take(self.rdy - len(self.in_flight), self, now):
            self.in_flight.add(ids, frames, now + timeout, now)
            got += frames
        return got


def chunk(n, start=0, ts=1):
    ids = [b"%016x" % i for i in range(start, start + n)]
    return ids, [message.encode_frame(i, b"body-" + i, ts) for i in ids]


def ids_of(frames):
    return [message.frame_id(f) for f in frames]


def test_fan_out_chunk_is_shared_and_split_between_takes():
    a = Channel("t", "a", mem_queue_size=100, backend=None)
    b = Channel("t", "b", mem_queue_size=100, backend=None)
    ids, frames = chunk(10)
    a.put_chunk(ids, frames)
    b.put_chunk(ids, frames)
    ca, cb = Consumer(rdy=4), Consumer(rdy=10)
    a.add_consumer(1, ca)
    b.add_consumer(1, cb)
    first = ca.fill(a, 0)
    assert ids_of(first) == ids[:4]
    assert first[0] is frames[0]  # no copy of the message bytes
    assert ids_of(cb.fill(b, 0)) == ids
    ca.in_flight.map.clear()
    assert ids_of(ca.fill(a, 0)) == ids[4:8]
    assert a.depth == 2 and b.depth == 0
    assert a.in_flight_count == 4 and a.message_count == 10


def test_memory_bound_drops_ephemeral_overflow_and_counts_it():
    ch = Channel("t", "c#ephemeral", mem_queue_size=5, backend=None)
    ch.put_chunk(*chunk(8))
    assert ch.depth == 5 and ch.dropped_count == 3


def test_hungry_consumer_is_woken_once_messages_arrive():
    ch = Channel("t", "c", mem_queue_size=100, backend=None)
    c = Consumer()
    ch.add_consumer(1, c)
    assert c.fill(ch, 0) == []
    ch.put_chunk(*chunk(3))
    assert c.woken == 1
    ch.put_chunk(*chunk(3, 3))
    assert c.woken == 1  # only hungry consumers are woken


def test_wake_spreads_over_hungry_consumers_by_capacity():
    ch = Channel("t", "c", mem_queue_size=100, backend=None)
    small, other = Consumer(rdy=2), Consumer(rdy=2)
    ch.add_consumer(1, small)
    ch.add_consumer(2, other)
    small.fill(ch, 0)
    other.fill(ch, 0)
    ch.put_chunk(*chunk(1))
    assert (small.woken, other.woken) == (1, 0)
    ch.put_chunk(*chunk(4, 1))
    assert other.woken == 1


def test_timeout_requeues_to_front_with_attempts_bumped():
    ch = Channel("t", "c", mem_queue_size=100, backend=None)
    c = Consumer(rdy=2)
    ch.add_consumer(1, c)
    ids, frames = chunk(4)
    ch.put_chunk(ids, frames)
    c.fill(ch, 0, timeout=10)
    assert ch.process_in_flight(5) is False
    assert ch.process_in_flight(10) is True
    assert ch.timeout_count == 2 and c.timed_out == 2 and len(c.in_flight) == 0
    again = c.fill(ch, 11)
    assert ids_of(again) == ids[:2]
    assert [message.frame_attempts(f) for f in again] == [2, 2]


def test_touch_moves_deadline_and_respects_max():
    flight = InFlight()
    ids, frames = chunk(2)
    flight.add(ids, frames, 10, 0)
    assert flight.touch(ids[0], 8, 10, 15)
    assert flight.peek(2) == [(ids[1], 10), (ids[0], 15)]
    assert ids_of(flight.expire(14)) == [ids[1]]
    assert ids_of(flight.expire(15)) == [ids[0]]
    assert not flight.touch(ids[0], 0, 1, 1)


def test_req_with_delay_defers_then_releases():
    ch = Channel("t", "c", mem_queue_size=100, backend=None)
    c = Consumer(rdy=1)
    ch.add_consumer(1, c)
    ids, frames = chunk(1)
    ch.put_chunk(ids, frames)
    c.fill(ch, 0)
    frame = c.in_flight.take(ids[0])
    ch.requeue(frame, 5 * S, now_ns=0)
    assert ch.deferred_count == 1 and ch.depth == 0 and ch.requeue_count == 1
    assert ch.process_deferred(4 * S) is False
    assert ch.process_deferred(5 * S) is True
    assert ch.deferred_count == 0 and ch.depth == 1
    assert message.frame_attempts(c.fill(ch, 6 * S)[0]) == 2


def test_removed_consumer_gives_back_messages_in_order():
    ch = Channel("t", "c", mem_queue_size=100, backend=None)
    a, b = Consumer(rdy=3), Consumer(rdy=10)
    ch.add_consumer(1, a)
    ch.add_consumer(2, b)
    ids, frames = chunk(5)
    ch.put_chunk(ids, frames)
    a.fill(ch, 0)
    ch.remove_consumer(1)
    assert ch.requeue_count == 3
    assert ids_of(b.fill(ch, 0)) == ids


def test_paused_channel_delivers_nothing_until_unpaused():
    ch = Channel("t", "c", mem_queue_size=100, backend=None)
    c = Consumer()
    ch.add_consumer(1, c)
    ch.put_chunk(*chunk(2))
    ch.pause()
    assert c.fill(ch, 0) == []
    ch.unpause()
    assert c.woken >= 1 and len(c.fill(ch, 0)) == 2


def test_empty_drops_queued_deferred_and_in_flight():
    ch = Channel("t", "c", mem_queue_size=100, backend=None)
    c = Consumer(rdy=2)
    ch.add_consumer(1, c)
    ch.put_chunk(*chunk(5))
    ch.put_deferred(message.encode_frame(b"x" * 16, b"d", 1), 10 * S)
    c.fill(ch, 0)
    ch.empty()
    assert (ch.depth, ch.in_flight_count, ch.deferred_count) == (0, 0, 0)


def test_max_consumers_limit():
    ch = Channel("t", "c", mem_queue_size=1, backend=None)
    ch.add_consumer(1, Consumer(), max_consumers=1)
    try:
        ch.add_consumer(2, Consumer(), max_consumers=1)
    except ValueError as exc:
        assert "exceeds limit of 1" in str(exc)
    else:
        raise AssertionError("limit not enforced")


def test_disk_payload_round_trip_keeps_due_and_failed():
    frame = message.encode_frame(b"a" * 16, b"payload", 123, attempts=3)
    assert message.to_disk(frame) is frame  # a plain message is stored as its frame
    assert message.from_disk(frame) == (frame, 0, 0)
    assert message.from_disk(message.to_disk(frame, due_ns=99, failed=2)) == (frame, 99, 2)
    # an unknown extension field is skipped
    unknown = b"\x00\x00\x00\x00\x00\x00\x00\xff\x00\x04\x09\x02zz" + frame[8:]
    assert message.from_disk(unknown) == (frame, 0, 0)
    for bad in (b"", frame[:-1], b"\x00" * 8 + frame[8:], b"\x00\x00\x00\x00\x00\x00\x00\xff\x00\x09"):
        with pytest.raises(message.BadRecord):
            message.from_disk(bad)


def test_failed_deliveries_are_counted_apart_from_attempts():
    ch = Channel("t", "c", mem_queue_size=100, backend=None)
    c = Consumer(rdy=1)
    ch.add_consumer(1, c)
    ids, frames = chunk(1)
    ch.put_chunk(ids, frames)
    c.fill(ch, 0, timeout=10)
    ch.requeue(c.in_flight.take(ids[0]), 0, 0)  # REQ: a failed delivery
    c.fill(ch, 0, timeout=10)
    ch.process_in_flight(100)  # timeout: another
    assert ch.failed[ids[0]] == 2
    again = c.fill(ch, 100, timeout=10)
    assert message.frame_attempts(again[0]) == 3
    ch.requeue(c.in_flight.take(ids[0]), 0, 0, failed=False, count_attempt=False)  # released
    assert ch.failed[ids[0]] == 2 and message.frame_attempts(c.fill(ch, 100)[0]) == 3
    [payload] = list(ch.persistable())
    assert message.from_disk(payload)[2] == 2  # the count goes to disk with the message
    assert ch.failed == {}


def test_memory_bytes_follow_the_frames_in_memory():
    import random

    rng = random.Random(7)
    ch = Channel("t", "c", mem_queue_size=50, backend=None)
    c = Consumer(rdy=7)
    ch.add_consumer(1, c)
    start = 0
    for _ in range(300):
        op = rng.randrange(5)
        if op == 0:
            ids, frames = chunk(rng.randrange(1, 9), start)
            frames = [message.encode_frame(i, b"b" * rng.randrange(1, 50), 1) for i in ids]
            ch.put_chunk(ids, frames)
            start += len(ids)
        elif op == 1:
            c.fill(ch, 0, timeout=10)
        elif op == 2 and c.in_flight:
            ch.requeue(c.in_flight.take(next(iter(c.in_flight.map))), 0, 0)
        elif op == 3:
            ch.process_in_flight(rng.randrange(0, 20))
        else:
            ch.drop_oldest(rng.randrange(0, 3), 0)
        in_memory = [f for i, (_, frames) in enumerate(ch._chunks) for f in frames[ch._head if i == 0 else 0:]]
        assert ch.depth_bytes == sum(map(len, in_memory))
        assert ch.depth == len(in_memory)
