"""Message ids: format, order, uniqueness across batches and restarts."""

from nsqd.guid import GUIDFactory


def test_ids_are_16_hex_digits_consecutive_across_prefix_boundaries():
    factory = GUIDFactory(7)
    batches = [factory.new_ids(n) for n in (1, 255, 256, 300, 1000)]
    ids = [i for batch in batches for i in batch]
    values = [int(i, 16) for i in ids]
    assert all(len(i) == 16 and i == i.lower() for i in ids)
    assert values == sorted(values) and len(set(values)) == len(values)
    assert all(b - a == 1 for a, b in zip(values, values[1:]) if b - a < 1000)
    assert ids == [b"%016x" % v for v in values]


def test_restart_with_saved_floor_never_repeats():
    first = GUIDFactory(3)
    last = int(first.new_ids(5000)[-1], 16)
    assert first.last == last
    again = GUIDFactory(3, floor=first.last + 1)
    assert int(again.new_id(), 16) > last


def test_a_floor_at_the_top_of_the_id_space_goes_back_to_the_clock():
    # a floor from an edited nsqd.dat near 2**64 minted 17-digit ids, which overran the frame's id field
    near_top = GUIDFactory(3, floor=(1 << 64) - 3)
    ids = near_top.new_ids(2) + near_top.new_ids(10) + [near_top.new_id() for _ in range(300)]
    assert ids[:2] == [b"fffffffffffffffd", b"fffffffffffffffe"]
    assert all(len(i) == 16 for i in ids) and len(set(ids)) == len(ids)
    clock_based = int(GUIDFactory(3).new_id(), 16)
    assert clock_based <= int(ids[2], 16) < 1 << 63  # past the top: clock values, as a fresh start mints
