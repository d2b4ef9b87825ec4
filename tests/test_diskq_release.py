"""Reading does not release: a keeper's records survive a restart or a crash, the rest do not come back."""

import trio
from structlog.testing import capture_logs

from nsqd.diskq import DiskQueue
from nsqd.diskq.records import SEGMENT_HEADER_SIZE


def payloads(count, start=0):
    return [b"%06d" % n + b"x" * 94 for n in range(start, start + count)]


def drain(queue):
    out = []
    while chunk := queue.read_many(7):
        out.extend(chunk)
    return out


class Keeper:
    """The owner's side: it holds some read records, by position, with optional notes."""

    def __init__(self):
        self.held: dict[int, object] = {}

    def __call__(self):
        return [(p, p, note) for p, note in sorted(self.held.items())], len(self.held)


def test_kept_records_come_back_after_close_and_finished_ones_do_not(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 3 * 108)
    keeper = queue.keeper = Keeper()
    queue.put_many(payloads(10))
    records, positions = queue.read_positioned(6)
    assert records == payloads(6)
    keeper.held = {positions[1]: None, positions[4]: {"attempts": 3}}  # the other four read ones finished
    queue.close()
    assert len(list(tmp_path.glob("*.dat"))) == 4  # segment 0 still holds a kept record

    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 3 * 108)
    assert queue.depth == 2 + 4
    assert queue.recovered_kept == ((positions[4], positions[4], {"attempts": 3}),)
    again, again_positions = queue.read_positioned(100)
    assert again == [payloads(10)[1], payloads(10)[4]] + payloads(4, start=6)
    assert list(again_positions[:2]) == [positions[1], positions[4]]
    assert queue.depth == 0
    queue.close()
    assert len(list(tmp_path.glob("*.dat"))) == 1  # nothing kept: everything before the read position went


async def test_a_crash_after_a_checkpoint_loses_no_kept_record(tmp_path):
    queue = DiskQueue("q", tmp_path, sync_every=1_000_000, sync_timeout=60)
    keeper = queue.keeper = Keeper()
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put_many(payloads(20))
        _, positions = queue.read_positioned(15)
        keeper.held = {p: None for p in positions[10:]}  # ten finished, five still held
        queue.request_checkpoint()
        await queue.wait_durable()
        with trio.fail_after(5):
            while queue.statistics().syncs < 1:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    queue._shut()  # no close: as after a SIGKILL
    queue = DiskQueue("q", tmp_path, sync_every=1_000_000, sync_timeout=60)
    assert drain(queue) == payloads(5, start=10) + payloads(5, start=15)
    queue.close()


def stop_with_kept(tmp_path, count, held):
    """Put ``count`` records, read them all, keep ``held`` (index: note) and stop; returns their positions."""
    queue = DiskQueue("q", tmp_path)
    queue.keeper = Keeper()
    queue.put_many(payloads(count))
    _, positions = queue.read_positioned(count)
    queue.keeper.held = {positions[index]: note for index, note in held.items()}
    queue.close()
    return positions


def test_a_kept_record_reopened_and_kept_again_survives_a_second_restart(tmp_path):
    positions = stop_with_kept(tmp_path, 5, {2: None})
    for _ in range(2):
        queue = DiskQueue("q", tmp_path)
        keeper = queue.keeper = Keeper()
        records, again = queue.read_positioned(5)
        assert records == [payloads(5)[2]] and again == (positions[2],)  # (a tuple: see read_positioned)
        keeper.held = {positions[2]: None}
        queue.close()
    queue = DiskQueue("q", tmp_path)
    assert drain(queue) == [payloads(5)[2]]
    queue.close()


def test_while_reading_kept_records_a_checkpoint_keeps_the_unread_ones(tmp_path):
    stop_with_kept(tmp_path, 10, {1: None, 5: None, 8: None})
    queue = DiskQueue("q", tmp_path)  # no keeper yet: only the first kept one is read, then a stop
    assert queue.read_many(1) == [payloads(10)[1]]
    queue.close()
    queue = DiskQueue("q", tmp_path)
    assert drain(queue) == [payloads(10)[5], payloads(10)[8]]
    queue.close()


def test_notes_on_kept_records_not_read_again_survive_a_second_restart(tmp_path):
    positions = stop_with_kept(tmp_path, 10, {1: {"a": 2}, 5: None, 8: {"a": 3}})
    queue = DiskQueue("q", tmp_path)  # reads one of them, then stops without reading the others
    queue.keeper = Keeper()
    assert queue.read_many(1) == [payloads(10)[1]]
    queue.close()
    queue = DiskQueue("q", tmp_path)
    assert queue.recovered_kept == ((positions[8], positions[8], {"a": 3}),)
    assert drain(queue) == [payloads(10)[5], payloads(10)[8]]
    queue.close()


def test_a_kept_count_above_the_records_kept_is_corrected_once_they_are_read_back(tmp_path):
    """A keeper that lists a record twice (an in-flight batch kept whole and a message of it REQ'd
    meanwhile) saved a count above the records kept: the depth rebuilt after a crash counted
    records that are read back once, /stats showed it until the reader reached the end of the
    data, and diskq_depth_reconciled then suggested damage."""

    class Twice(Keeper):
        def __call__(self):
            kept, count = super().__call__()
            return kept + [(kept[0][0], kept[0][0], {"d": 1})], count + 1  # the first one again

    queue = DiskQueue("q", tmp_path)
    queue.keeper = Twice()
    queue.put_many(payloads(10))
    _, positions = queue.read_positioned(6)
    queue.keeper.held = {positions[1]: None, positions[4]: None}
    queue.close()

    with capture_logs() as logs:
        queue = DiskQueue("q", tmp_path)
        assert queue.depth == 4 + 3  # as saved: reading the kept records back finds two of them
        assert [queue.read_many(1) for _ in range(3)] == [[payloads(10)[1]], [payloads(10)[4]], [payloads(10)[6]]]
        assert queue.depth == 3  # not 4: corrected as the reader passed the kept records
        assert drain(queue) == payloads(3, start=7)
        assert queue.depth == 0
        queue.close()
    assert not [log for log in logs if log["event"] == "diskq_depth_reconciled"]
    assert [log["records"] for log in logs if log["event"] == "diskq_kept_records_not_found"] == [1]


def test_held_records_stay_until_the_keeper_lets_them_go(tmp_path):
    queue = DiskQueue("q", tmp_path)
    keeper = queue.keeper = Keeper()
    held = queue.put_held(payloads(3))
    keeper.held = {held[0]: {"lease": "a"}}
    queue.close()
    queue = DiskQueue("q", tmp_path)
    assert queue.recovered_kept == ((held[0], held[0], {"lease": "a"}),)
    assert drain(queue) == payloads(1)
    queue.close()


def test_put_held_can_hold_only_the_head_of_a_batch(tmp_path):
    queue = DiskQueue("q", tmp_path)
    positions = queue.put_held(payloads(5), hold=2)
    assert queue.depth == 3
    records, read = queue.read_positioned(10)
    assert records == payloads(5)[2:] and read == positions[2:]
    queue.close()


def test_undo_takes_a_batch_back_even_across_segments(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 3 * 108)
    queue.put_many(payloads(2))
    mark = queue.mark()
    queue.put_many(payloads(7, start=2))  # spills into two more segments
    assert len(list(tmp_path.glob("*.dat"))) == 3
    queue.undo(mark)
    assert queue.depth == 2 and len(list(tmp_path.glob("*.dat"))) == 1
    assert queue.read_many(10) == payloads(2)
    held_mark = queue.mark()
    queue.put_held(payloads(2, start=200))  # moves the read position; undo moves it back
    queue.undo(held_mark)
    queue.put(payloads(1, start=100)[0])
    assert queue.read_many(10) == payloads(1, start=100)
    queue.close()
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 3 * 108)
    assert drain(queue) == []
    queue.close()


def test_read_at_reads_any_record_without_moving(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SEGMENT_HEADER_SIZE + 3 * 108)
    positions = queue.put_positioned(payloads(5))
    assert queue.read_at([positions[4], positions[0], positions[0] + 1]) == [payloads(5)[4], payloads(5)[0], None]
    assert queue.depth == 5 and drain(queue) == payloads(5)
    queue.close()


SMALL = SEGMENT_HEADER_SIZE + 3 * 108  # three records a segment


def segment_numbers(tmp_path):
    return sorted(int(path.name[-10:-4]) for path in tmp_path.glob("*.dat"))


async def test_segments_between_kept_records_go_at_a_checkpoint_and_stay_gone_after_a_crash(tmp_path):
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SMALL, sync_every=1_000_000, sync_timeout=60)
    keeper = queue.keeper = Keeper()
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.put_many(payloads(30))  # segments 0-9
        _, positions = queue.read_positioned(25)  # the read position in segment 8
        keeper.held = {positions[1]: {"d": 1}, positions[13]: None}  # in segments 0 and 4
        queue.request_checkpoint()
        with trio.fail_after(5):
            while segment_numbers(tmp_path) != [0, 4, 8, 9]:
                await trio.sleep(0.01)
        assert queue.retained_bytes == 2 * 3 * 108 + 5 * 108  # segments 0 and 4, then 8 and 9 from record 24
        nursery.cancel_scope.cancel()
    queue._shut()  # no close: as after a SIGKILL
    with capture_logs() as logs:
        queue = DiskQueue("q", tmp_path, max_bytes_per_file=SMALL)
        assert queue.recovered_kept == ((positions[1], positions[1], {"d": 1}),)
        records, again = queue.read_positioned(3)
        assert records == [payloads(30)[1]]
        assert type(again) is tuple  # read back after a restart: not neighbours (see read_positioned)
        assert drain(queue) == [payloads(30)[13]] + payloads(5, start=25)
    assert not [log for log in logs if log["log_level"] in ("warning", "error")], logs
    queue.close()


def test_segments_no_kept_record_needs_are_removed_at_start(tmp_path):
    """A crash after a checkpoint saved but before its segments were removed: they go at the start."""
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SMALL)
    keeper = queue.keeper = Keeper()
    queue.put_many(payloads(30))
    _, positions = queue.read_positioned(25)
    keeper.held = {positions[1]: None, positions[13]: None}
    queue.close()  # saves the kept records; the segments between them are still there
    assert segment_numbers(tmp_path) == list(range(10))
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SMALL)
    assert segment_numbers(tmp_path) == [0, 4, 8, 9]
    queue.keeper = Keeper()
    records, again = [], []
    while len(records) < 3:  # (a read of kept records may return fewer than asked for)
        more, more_positions = queue.read_positioned(3 - len(records))
        records += more
        again += more_positions
    assert records == [payloads(30)[1], payloads(30)[13], payloads(30)[25]]
    assert again[:2] == [positions[1], positions[13]]
    queue.keeper.held = {positions[13]: None}  # a second stop while segment 4 is still held
    queue.close()
    queue = DiskQueue("q", tmp_path, max_bytes_per_file=SMALL)
    assert drain(queue) == [payloads(30)[13]] + payloads(4, start=26)
    queue.close()
