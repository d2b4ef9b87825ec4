"""The in-flight map's view for the disk queue's checkpoints (unit tests of nsqd.in_flight)."""

from nsqd.in_flight import InFlight


def ids(count):
    return [b"%016d" % n for n in range(count)]


def test_a_batch_is_one_interval_at_first_then_only_its_unfinished_runs():
    in_flight = InFlight()
    positions = [1000 + 100 * n for n in range(10)]
    in_flight.add(ids(10), [b"frame"] * 10, positions, deadline=5, now=0)
    for msg_id in ids(10)[:3] + ids(10)[5:6]:
        in_flight.finish(msg_id)
    # the first checkpoint that sees it keeps it whole (cheap: most batches are finished by the next)
    assert in_flight.kept("n") == ([(1000, 1900, "n")], 10)
    # from then on only what is still in flight, as runs of neighbours
    assert in_flight.kept("n") == ([(1300, 1400, "n"), (1600, 1900, "n")], 6)
    for msg_id in ids(10)[6:]:
        in_flight.finish(msg_id)
    assert in_flight.kept("n") == ([(1300, 1400, "n")], 2)
    in_flight.take(ids(10)[3])
    assert in_flight.kept("n") == ([(1400, 1400, "n")], 1)
    in_flight.finish(ids(10)[4])
    assert in_flight.kept("n") == ([], 0)
    assert in_flight.deliveries == []  # forgotten once nothing of it is left


def test_a_batch_a_message_left_unfinished_is_never_kept_whole():
    """A message REQ'd, touched or timed out before the first checkpoint that sees its batch is
    listed by its new holder (the queue, the deferred heap, its own delivery): keeping the batch
    whole counted it twice, and after a SIGKILL the disk queue's depth counted records that were
    read back once (logged as diskq_depth_reconciled once the reader reached the end)."""
    in_flight = InFlight()
    positions = [1000 + 100 * n for n in range(10)]
    in_flight.add(ids(10), [b"frame"] * 10, positions, deadline=5, now=0)
    assert in_flight.take(ids(10)[0]) == (b"frame", 1000)  # REQ: the channel lists it from now on
    assert in_flight.touch(ids(10)[1], now=1, timeout=5, max_timeout=100)  # its own delivery lists it
    in_flight.finish(ids(10)[2])
    assert in_flight.kept("n") == ([(1300, 1900, "n"), (1100, 1100, "n")], 8)

    # REQ'd and delivered again before the first checkpoint: counted once, under its new delivery
    again = InFlight()
    again.add(ids(4), [b"frame"] * 4, positions[:4], deadline=5, now=0)
    frame, pos = again.take(ids(4)[0])
    again.add([ids(4)[0]], [frame], (pos,), deadline=6, now=1)
    assert again.kept("n") == ([(1100, 1300, "n"), (1000, 1000, "n")], 4)

    # a mass timeout is given back a step at a time: the rest of the batch is still in flight
    timed_out = InFlight()
    timed_out.add(ids(4), [b"frame"] * 4, positions[:4], deadline=5, now=0)
    assert [pos for _, pos in timed_out.expire(5, limit=3)] == [1000, 1100, 1200]  # back in the queue
    assert timed_out.kept("n") == ([(1300, 1300, "n")], 1)


def test_a_touched_message_is_kept_once_under_its_new_delivery():
    in_flight = InFlight()
    in_flight.add(ids(3), [b"f"] * 3, [10, 20, 30], deadline=5, now=0)
    in_flight.kept(None)
    assert in_flight.touch(ids(3)[1], now=1, timeout=5, max_timeout=100)
    in_flight.finish(ids(3)[0])
    in_flight.finish(ids(3)[2])
    assert in_flight.kept(None) == ([(20, 20, None)], 1)


def test_touching_a_message_again_and_again_keeps_one_delivery_for_it():
    """Every TOUCH of a disk-backed message made a new delivery, and the one it replaced was
    never forgotten while the message lived: a consumer re-touching 2,500 messages grew the
    daemon by 1.7 GB in 30 s. A message touched again keeps its one delivery, and a batch whose
    messages all moved on to later deliveries is forgotten."""
    in_flight = InFlight()
    in_flight.add(ids(3), [b"f"] * 3, [10, 20, 30], deadline=5, now=0)
    for now in range(1, 1001):
        for msg_id in ids(3):
            assert in_flight.touch(msg_id, now=now, timeout=5, max_timeout=10**9)
    assert len(in_flight.deliveries) == 4  # the batch, and one for each message
    assert in_flight.kept(None) == ([(10, 10, None), (20, 20, None), (30, 30, None)], 3)
    assert len(in_flight.deliveries) == 3  # the batch is forgotten
    assert in_flight.next_deadline() == 1005
    assert in_flight.expire(1004) == []
    assert [pos for _, pos in in_flight.expire(1005)] == [10, 20, 30]  # items: (frame, position)
