"""DiskQueue.depth_bytes: unread bytes across segments, after reopen."""

from hypothesis import given, settings, strategies as st

from nsqd.diskq import DiskQueue

HEADER = 8


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=60), reads=st.integers(0, 60))
def test_depth_bytes_counts_unread_records(tmp_path_factory, sizes, reads):
    path = tmp_path_factory.mktemp("dq")
    queue = DiskQueue("q", path, max_bytes_per_file=1024, min_msg_size=1, max_msg_size=300)
    payloads = [bytes([i % 256]) * n for i, n in enumerate(sizes)]
    queue.put_many(payloads)
    assert queue.depth_bytes == sum(len(p) + HEADER for p in payloads)
    got = queue.read_many(reads)
    left = payloads[len(got):]
    assert queue.depth_bytes == sum(len(p) + HEADER for p in left)
    queue.close()
    again = DiskQueue("q", path, max_bytes_per_file=1024, min_msg_size=1, max_msg_size=300)
    assert again.depth_bytes == sum(len(p) + HEADER for p in left)
    again.empty()
    assert again.depth_bytes == 0
    again.close()
