"""Channel, subscription and in-flight bookkeeping, driven directly (no sockets, no disk)."""

import time

import pytest
from structlog.testing import capture_logs

from nsqd import message
from nsqd.channel import Channel
from nsqd.in_flight import InFlight
from nsqd.logs import LogThrottle
from nsqd.policy import ChannelPolicy
from nsqd.subscription import NOT_IN_FLIGHT, NOT_OWNED, Budget

S = 1_000_000_000


class Consumer:
    """The connection side of a subscription (the unit-test stand-in for a client)."""

    def __init__(self):
        self.woken = 0
        self.closed = False
        self.write_blocked = False

    def wake(self):
        self.woken += 1

    def close(self):
        self.closed = True

    def drain(self):
        pass

    def timed_out(self, count):
        pass


def subscribe(channel, rdy=100, timeout=60 * S, budget=None, sub_id=None):
    consumer = Consumer()
    budget = budget or Budget(rdy)
    sub = channel.subscribe(consumer, sub_id or len(channel.subscriptions) + 1, budget, msg_timeout_ns=timeout,
                            max_msg_timeout_ns=15 * 60 * S)
    return sub, consumer


def fill(sub, now=0):
    return [f for _, frames, _ in sub.take(sub.budget.limit, now) for f in frames]


def chunk(n, start=0, ts=1):
    ids = [b"%016x" % i for i in range(start, start + n)]
    return ids, [message.encode_frame(i, b"body-" + i, ts) for i in ids]


def ids_of(frames):
    return [message.frame_id(f) for f in frames]


def channel(mem_queue_size=100, name="c", **kwargs):
    return Channel("t", name, mem_queue_size=mem_queue_size, backend=None, **kwargs)


def test_fan_out_chunk_is_shared_and_split_between_takes():
    a, b = channel(name="a"), channel(name="b")
    ids, frames = chunk(10)
    a.put_chunk(ids, frames)
    b.put_chunk(ids, frames)
    sa, _ = subscribe(a, rdy=4)
    sb, _ = subscribe(b, rdy=10)
    first = fill(sa)
    assert ids_of(first) == ids[:4]
    assert first[0] is frames[0]  # no copy of the message bytes
    assert ids_of(fill(sb)) == ids
    assert sa.finish(ids[:4]) == []
    assert ids_of(fill(sa)) == ids[4:8]
    assert a.depth == 2 and b.depth == 0
    assert a.in_flight_count == 4 and a.message_count == 10


def test_memory_bound_drops_ephemeral_overflow_and_counts_it():
    ch = channel(mem_queue_size=5, name="c#ephemeral")
    ch.put_chunk(*chunk(8))
    assert ch.depth == 5 and ch.dropped_count == 3


def test_ephemeral_drops_are_logged_once_a_second_with_their_count():
    """A stalled ephemeral consumer under many publishes: one warning, not one per publish."""
    ch = channel(mem_queue_size=5, name="c#ephemeral")
    with capture_logs() as logs:
        for n in range(1000):
            ch.put_chunk(*chunk(3, start=3 * n))
    drops = [line for line in logs if line["event"] == "ephemeral channel full, dropping"]
    assert ch.dropped_count == 2995
    assert len(drops) == 1 and drops[0]["dropped"] == 1  # the first drop; the rest go in the next line


def test_log_throttle_reports_what_it_held_back():
    throttle = LogThrottle(interval=0.05)
    assert throttle.due(2) == 2
    assert [throttle.due(3) for _ in range(4)] == [0, 0, 0, 0]
    time.sleep(0.06)
    assert throttle.due(1) == 13


def test_hungry_consumer_is_woken_once_messages_arrive():
    ch = channel()
    sub, consumer = subscribe(ch)
    assert fill(sub) == []
    ch.put_chunk(*chunk(3))
    assert consumer.woken == 1
    ch.put_chunk(*chunk(3, 3))
    assert consumer.woken == 1  # only hungry consumers are woken


def test_wake_spreads_over_hungry_consumers_by_capacity():
    ch = channel()
    small, small_consumer = subscribe(ch, rdy=2)
    other, other_consumer = subscribe(ch, rdy=2)
    fill(small)
    fill(other)
    ch.put_chunk(*chunk(1))
    assert (small_consumer.woken, other_consumer.woken) == (1, 0)
    ch.put_chunk(*chunk(4, 1))
    assert other_consumer.woken == 1


def test_a_consumer_whose_connection_waits_to_send_is_passed_over_by_a_wake_up():
    """It would take nothing until its send is done (its client may never read): the next
    hungry consumer is woken instead, and the first asks anew once it fills again."""
    ch = channel()
    stuck, stuck_consumer = subscribe(ch, rdy=2)
    idle, idle_consumer = subscribe(ch, rdy=2)
    fill(stuck)
    fill(idle)
    stuck_consumer.write_blocked = True
    ch.put_chunk(*chunk(1))
    assert (stuck_consumer.woken, idle_consumer.woken) == (0, 1)
    assert ids_of(fill(idle)) == [b"%016x" % 0]
    stuck_consumer.write_blocked = False
    assert fill(stuck) == []  # hungry again, behind the idle one (room for 1 more)
    ch.put_chunk(*chunk(3, 1))
    assert (stuck_consumer.woken, idle_consumer.woken) == (1, 2)


def test_a_deleted_channel_is_never_scanned():
    """The scan loop may hold a channel deleted meanwhile: as Go's processInFlightQueue and
    processDeferredQueue, an exiting channel is left alone (its queue is gone: reading its
    deferred records back logged them as lost, and its counts kept moving)."""
    ch = channel()
    sub, _ = subscribe(ch, rdy=2, timeout=5 * S)
    ids, frames = chunk(2)
    ch.put_chunk(ids, frames)
    fill(sub)
    assert sub.requeue(ids[0], 5 * S, 0) is None
    ch.exiting = True  # Topic.delete_channel
    assert ch.process_deferred(60 * S) is False and ch.process_in_flight(60 * S) is False
    assert (ch.deferred_count, ch.timeout_count) == (1, 0)


def test_finish_checks_ownership():
    ch = channel()
    ids, frames = chunk(2)
    ch.put_chunk(ids, frames)
    first, _ = subscribe(ch, rdy=1)
    second, _ = subscribe(ch, rdy=1)
    fill(first)
    fill(second)
    assert second.finish([ids[0], b"f" * 16]) == [(ids[0], NOT_OWNED), (b"f" * 16, NOT_IN_FLIGHT)]
    assert first.finish([ids[0]]) == [] and first.finish_count == 1
    assert second.requeue(ids[0], 0, 0) == NOT_IN_FLIGHT


def test_a_mass_timeout_is_requeued_a_step_at_a_time():
    """100,000 messages timing out at once were requeued in one go (250 ms of the event loop):
    a call requeues at most EXAMINE_STEP, over subscriptions and leases, and says whether it
    stopped there (the scan's worker comes back after other tasks ran)."""
    from nsqd.channel import EXAMINE_STEP

    ch = channel(mem_queue_size=20_000)
    ch.put_chunk(*chunk(10_000))
    first, _ = subscribe(ch, rdy=3_000, timeout=10)
    second, _ = subscribe(ch, rdy=7_000, timeout=10)
    fill(first)
    second.take(6_000, 0)
    second.open_lease("l", 0)
    fill(second)  # the last 1,000, in a lease
    assert ch.in_flight_count == 10_000
    steps = []
    while True:
        before = ch.timeout_count
        ch.process_in_flight(10)
        steps.append(ch.timeout_count - before)
        if not ch.timeouts_left:
            break
    assert steps == [EXAMINE_STEP, EXAMINE_STEP, 10_000 - 2 * EXAMINE_STEP]
    assert ch.in_flight_count == 0 and ch.depth == 10_000
    assert first.timeout_count + second.timeout_count == 9_000


def test_timeout_requeues_to_back_with_attempts_bumped():
    """As nsqd's ``put``: the messages waiting go first, then the timed-out ones."""
    ch = channel()
    sub, _ = subscribe(ch, rdy=2, timeout=10)
    ids, frames = chunk(4)
    ch.put_chunk(ids, frames)
    fill(sub)
    assert ch.process_in_flight(5) is False
    assert ch.process_in_flight(10) is True
    assert ch.timeout_count == 2 and sub.timeout_count == 2 and len(sub.in_flight) == 0
    waiting = fill(sub, 11)
    assert ids_of(waiting) == ids[2:]
    assert [message.frame_attempts(f) for f in waiting] == [1, 1]
    sub.in_flight.drain()
    again = fill(sub, 12)
    assert ids_of(again) == ids[:2]
    assert [message.frame_attempts(f) for f in again] == [2, 2]


def test_touch_moves_deadline_and_respects_max():
    flight = InFlight()
    ids, frames = chunk(2)
    flight.add(ids, frames, None, 10, 0)
    assert flight.touch(ids[0], 8, 10, 15)
    assert flight.peek(2) == [(ids[1], 10), (ids[0], 15)]
    assert ids_of([f for f, _ in flight.expire(14)]) == [ids[1]]
    assert ids_of([f for f, _ in flight.expire(15)]) == [ids[0]]
    assert not flight.touch(ids[0], 0, 1, 1)


def test_req_with_delay_defers_then_releases():
    ch = channel()
    sub, _ = subscribe(ch, rdy=1)
    ids, frames = chunk(1)
    ch.put_chunk(ids, frames)
    fill(sub)
    assert sub.requeue(ids[0], 5 * S, 0) is None
    assert ch.deferred_count == 1 and ch.depth == 0 and ch.requeue_count == 1
    assert ch.process_deferred(4 * S) is False
    assert ch.process_deferred(5 * S) is True
    assert ch.deferred_count == 0 and ch.depth == 1
    assert message.frame_attempts(fill(sub, 6 * S)[0]) == 2


def test_closed_subscription_gives_back_messages_in_order():
    ch = channel()
    a, _ = subscribe(ch, rdy=3)
    b, _ = subscribe(ch, rdy=10)
    ids, frames = chunk(5)
    ch.put_chunk(ids, frames)
    fill(a)
    a.close()
    assert (ch.timeout_count, ch.requeue_count) == (3, 0)  # as nsqd counts them once they time out
    assert ids_of(fill(b)) == ids


def test_paused_channel_delivers_nothing_until_unpaused():
    ch = channel()
    sub, consumer = subscribe(ch)
    ch.put_chunk(*chunk(2))
    ch.pause()
    assert fill(sub) == []
    ch.unpause()
    assert consumer.woken >= 1 and len(fill(sub)) == 2


def test_empty_drops_queued_deferred_and_in_flight():
    ch = channel()
    sub, _ = subscribe(ch, rdy=2)
    ch.put_chunk(*chunk(5))
    ch.commit_put(ch.prepare_put([b"x" * 16], [message.encode_frame(b"x" * 16, b"d", 1)], False, due_ns=10 * S))
    fill(sub)
    ch.empty()
    assert (ch.depth, ch.in_flight_count, ch.deferred_count) == (0, 0, 0)


def test_max_consumers_limit():
    ch = channel(mem_queue_size=1)
    ch.subscribe(Consumer(), 1, Budget(1), msg_timeout_ns=S, max_msg_timeout_ns=S, max_consumers=1)
    with pytest.raises(ValueError, match="exceeds limit of 1"):
        ch.subscribe(Consumer(), 2, Budget(1), msg_timeout_ns=S, max_msg_timeout_ns=S, max_consumers=1)


def test_one_budget_bounds_every_subscription_of_a_connection():
    a, b = channel(name="a"), channel(name="b")
    a.put_chunk(*chunk(10))
    b.put_chunk(*chunk(10, 100))
    budget = Budget(6)
    sa, _ = subscribe(a, budget=budget)
    sb, _ = subscribe(b, budget=budget)
    assert len(fill(sa)) == 6  # asks for its limit: gets the whole budget
    assert fill(sb) == []
    sa.finish(ids_of(chunk(2)[1]))
    assert len(sb.take(100, 0)[0][0]) == 2
    assert budget.used == 6


def test_a_budget_counted_once_for_a_round_follows_the_takes_and_forgets_in_it():
    """An AMQP connection's fill round counts what its links hold once (1,024 links summed 1,024
    counts for each link's fill: a quarter of a second a round); the round's takes keep it true."""
    a, b, c = channel(name="a"), channel(name="b"), channel(name="c")
    for n, ch in enumerate((a, b, c)):
        ch.put_chunk(*chunk(10, 100 * n))
    budget = Budget(12)
    sa, sb, sc = (subscribe(ch, budget=budget)[0] for ch in (a, b, c))
    with budget.counted():
        assert len(ids_of([f for _, frames, _ in sa.take(5, 0) for f in frames])) == 5
        taken = [f for _, frames, _ in sb.take(10, 0) for f in frames]
        assert len(taken) == 7  # 12 - 5
        sb.forget_in_flight(ids_of(taken[:3]))  # pre-settled: out of flight at once
        assert len(sc.take(10, 0)[0][0]) == 3
        assert budget.used == 12
    assert budget.held is None and budget.used == 12 == sum(s.in_flight_count for s in (sa, sb, sc))


def test_leases_count_in_the_budget_that_opened_them():
    ch = channel()
    ch.put_chunk(*chunk(50))
    sub, _ = subscribe(ch, rdy=10)
    for number in range(20):  # a new lease name per batch: still 10 in flight in all
        sub.open_lease(f"l{number}", 0)
        fill(sub)
    assert sub.in_flight_count == 10 and ch.in_flight_count == 10
    assert sub.finish_lease("l0") == 10
    assert sub.in_flight_count == 0
    sub.open_lease("next", 0)
    assert len(fill(sub)) == 10


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
    ch = channel()
    sub, _ = subscribe(ch, rdy=1, timeout=10)
    ids, frames = chunk(1)
    ch.put_chunk(ids, frames)
    fill(sub)
    sub.requeue(ids[0], 0, 0)  # REQ: a failed delivery
    fill(sub)
    ch.process_in_flight(100)  # timeout: another
    assert ch.failed[ids[0]] == 2
    again = fill(sub, 100)
    assert message.frame_attempts(again[0]) == 3
    sub.requeue(ids[0], 0, 0, count_attempt=False)  # released
    assert ch.failed[ids[0]] == 2 and message.frame_attempts(fill(sub, 100)[0]) == 3
    assert sub.failures(ids) == [2]


def test_ttl_drops_old_messages_instead_of_delivering_them():
    ch = channel(policy=ChannelPolicy(ttl_ns=5 * S))
    sub, _ = subscribe(ch)
    ch.put_chunk(*chunk(2, ts=0))
    ch.put_chunk(*chunk(2, 2, ts=8 * S))
    assert ids_of(fill(sub, 10 * S)) == chunk(2, 2)[0]
    assert ch.expired_count == 2



@pytest.mark.parametrize("drop", ["ttl", "sample_rate"])
def test_a_take_that_drops_goes_through_one_step_of_messages_and_says_it_stopped_short(drop):
    """A TTL over a big backlog, or a sample_rate of 1, dropped it all in one take while every
    other client waited (123,000 messages, 264 ms). One take goes through at most EXAMINE_STEP
    messages, is not counted hungry (nothing would wake it) and says the taker must come back."""
    from nsqd.channel import EXAMINE_STEP

    backlog = 5 * EXAMINE_STEP // 1000 * 1000
    ch = channel(mem_queue_size=backlog + 1, policy=ChannelPolicy(ttl_ns=5 * S if drop == "ttl" else 0))
    sub, _ = subscribe(ch, rdy=2500)
    if drop == "sample_rate":
        sub.sample_rate = 1  # keeps 2 in 100 (Go: a draw of 0..99 <= rate)
    for start in range(0, backlog, 1000):
        ch.put_chunk(*chunk(1000, start, ts=0 if drop == "ttl" else 1))
    if drop == "ttl":
        ch.put_chunk(*chunk(1, backlog, ts=8 * S))  # the one that is still fresh, at the end
    takes = 0
    delivered = []
    while True:
        before = ch.depth
        got = fill(sub, 10 * S)
        delivered += got
        takes += 1
        assert before - ch.depth <= EXAMINE_STEP + 2500  # one step, then at most the last batch it read
        if not sub.stopped_short:
            break
        assert sub not in ch._hungry  # a taker that stopped short is not woken: it comes back
    assert takes >= 4 and ch.depth == 0
    if drop == "ttl":
        assert ids_of(delivered) == chunk(1, backlog)[0] and ch.expired_count == backlog
    else:
        assert 0 < len(delivered) < backlog // 20

def test_memory_bytes_follow_the_frames_in_memory():
    import random

    rng = random.Random(7)
    ch = channel(mem_queue_size=50)
    sub, _ = subscribe(ch, rdy=7, timeout=10)
    start = 0
    for _ in range(300):
        op = rng.randrange(5)
        if op == 0:
            ids, frames = chunk(rng.randrange(1, 9), start)
            frames = [message.encode_frame(i, b"b" * rng.randrange(1, 50), 1) for i in ids]
            ch.put_chunk(ids, frames)
            start += len(ids)
        elif op == 1:
            fill(sub)
        elif op == 2 and sub.in_flight:
            sub.requeue(next(iter(sub.in_flight.map)), 0, 0)
        elif op == 3:
            ch.process_in_flight(rng.randrange(0, 20))
        else:
            ch.drop_oldest(rng.randrange(0, 3))
        in_memory = [f for i, (_, frames, _) in enumerate(ch._chunks) for f in frames[ch._head if i == 0 else 0:]]
        assert ch.depth_bytes == sum(map(len, in_memory))
        assert ch.depth == len(in_memory)


def test_single_publishes_are_coalesced_into_few_chunks():
    ch = channel(mem_queue_size=1000)
    for i in range(200):
        ch.put_chunk(*chunk(1, i))
    assert len(ch._chunks) == 4  # 64 + 64 + 64 + 8
    sub, _ = subscribe(ch, rdy=1000)
    assert ids_of(fill(sub)) == chunk(200)[0]


def test_ephemeral_deferred_messages_are_bounded_as_its_memory_queue():
    ch = channel(mem_queue_size=3, name="c#ephemeral")
    sub, _ = subscribe(ch, rdy=3)
    for round_ in range(3):
        ids, _ = chunk(3, start=3 * round_)
        ch.put_chunk(*chunk(3, start=3 * round_))
        fill(sub)
        for msg_id in ids:
            sub.requeue(msg_id, 60 * S, 0)
    assert ch.deferred_count == 3 and ch.dropped_count == 6
    put = ch.prepare_put(*chunk(5, start=100), False, 60 * S)
    ch.commit_put(put)
    assert ch.deferred_count == 3 and ch.dropped_count == 11
