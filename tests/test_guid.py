"""Message ids: nsqd's layout, format, order, uniqueness across batches, nodes and restarts."""

import time

from nsqd import guid
from nsqd.guid import TWEPOCH, GUIDFactory


def fields(msg_id: bytes) -> tuple[int, int, int]:
    """(tick, node id, sequence) as nsqd's guid lays them out."""
    value = int(msg_id, 16)
    return value >> 22, (value >> 12) & 0x3FF, value & 0xFFF


def test_ids_are_16_hex_digits_in_order_across_prefix_and_tick_boundaries():
    factory = GUIDFactory(7)
    batches = [factory.new_ids(n) for n in (1, 255, 256, 300, 1000, 5000, 1)]
    ids = [i for batch in batches for i in batch]
    values = [int(i, 16) for i in ids]
    assert all(len(i) == 16 and i == i.lower() for i in ids)
    assert values == sorted(values) and len(set(values)) == len(values)
    assert ids == [b"%016x" % v for v in values]
    assert factory.last == values[-1]


def test_ids_decode_as_nsqds_and_keep_their_node_id_in_big_batches():
    """A batch of more than 4,096 ids in one millisecond counted on into the node id's bits:
    100,000 ids from node 1 overlapped node 2's (884 ids delivered by both daemons)."""
    one, two = GUIDFactory(1), GUIDFactory(2)
    ids_one = one.new_ids(100_000) + one.new_ids(100_000)
    ids_two = [two.new_id() for _ in range(5000)] + two.new_ids(100_000)
    assert not set(ids_one) & set(ids_two)
    assert {fields(i)[1] for i in ids_one} == {1} and {fields(i)[1] for i in ids_two} == {2}
    tick = fields(ids_two[0])[0]
    assert abs(((tick + TWEPOCH) << 20) / 1e9 - time.time()) < 60  # Go: (tick + twepoch) << 20 is UnixNano


def test_restart_with_saved_floor_never_repeats():
    first = GUIDFactory(3)
    last = int(first.new_ids(1_000_000)[-1], 16)  # about 250 ticks ahead of the clock
    assert first.last == last
    again = GUIDFactory(3, floor=first.last + 1)
    assert int(again.new_id(), 16) > last
    assert int(again.new_ids(10)[0], 16) > last


def test_a_restart_after_a_crash_never_mints_the_ids_a_big_batch_ran_ahead_with(monkeypatch):
    """A crash saves no floor: the ids a big MPUB minted ahead of the clock must not come again
    from a daemon started at once (one that had run for a second or more: a daemon younger than
    that, crashed and started again within the batch's lead, about 0.3 s, is not covered)."""
    now = guid.clock_tick()
    monkeypatch.setattr(guid, "clock_tick", lambda: now - 2000)  # started two seconds ago
    before = GUIDFactory(3)
    monkeypatch.setattr(guid, "clock_tick", lambda: now)
    last = int(before.new_ids(1_000_000)[-1], 16)  # a 5 MiB MPUB of one-byte messages: 245 ticks ahead
    assert int(GUIDFactory(3).new_id(), 16) > last
    huge = 12 * 1024 * 1024  # --max-body-size=12MiB: an HTTP /mpub of 6.3 million one-byte lines
    monkeypatch.setattr(guid, "clock_tick", lambda: now - 5000)
    before = GUIDFactory(3, ahead=guid.start_ahead(huge))
    monkeypatch.setattr(guid, "clock_tick", lambda: now)
    last = int(before.new_ids(huge // 2)[-1], 16)  # 1,536 ticks ahead: more than the second
    assert int(GUIDFactory(3, ahead=guid.start_ahead(huge)).new_id(), 16) > last


def test_a_floor_far_ahead_of_the_clock_is_not_followed():
    """A floor from this daemon's earlier layout (unix ms << 22) or an edited nsqd.dat near 2**64:
    ids go on from the clock, 16 digits, never past the frame's id field."""
    for floor in ((1 << 64) - 3, (time.time_ns() // 1_000_000) << 22):
        factory = GUIDFactory(3, floor=floor)
        ids = factory.new_ids(2) + factory.new_ids(10) + [factory.new_id() for _ in range(300)]
        assert all(len(i) == 16 for i in ids) and len(set(ids)) == len(ids)
        assert abs(((fields(ids[0])[0] + TWEPOCH) << 20) / 1e9 - time.time()) < 60
