"""Publish batches (``nsqd/mpub.py``): big ones are validated whole, then handed out in steps."""

import itertools

import pytest
from hypothesis import given, strategies as st

from nsqd.mpub import BadBatch, LinesBatch, MpubBatch, split_lines, split_mpub

from .support import mpub_body


def _taken(batch) -> list[list[bytes]]:
    """Validate ``batch``, then take its steps as bytes."""
    for _pause in batch.validate():
        pass
    return [[bytes(b) for b in bodies] for bodies in batch.steps()]


@given(st.lists(st.binary(min_size=1, max_size=9), min_size=1, max_size=60), st.integers(1, 7))
def test_the_steps_of_a_binary_batch_are_its_messages_in_order(bodies, step):
    body = mpub_body(bodies)
    steps = _taken(MpubBatch(body, 100, 10_000, step))
    assert list(itertools.chain.from_iterable(steps)) == bodies == [bytes(b) for b in split_mpub(body, 100, 10_000)]
    assert all(1 <= len(s) <= step for s in steps)
    assert len(steps) == -(-len(bodies) // step)


def test_a_uniform_binary_batch_needs_no_validation_pass_and_is_cut_in_steps():
    batch = MpubBatch(mpub_body([b"abc"] * 10), 100, 10_000, 3)
    assert list(batch.validate()) == []  # every size checked at once
    assert _taken(batch) == [[b"abc"] * 3] * 3 + [[b"abc"]]


def test_a_mixed_binary_batch_pauses_while_it_is_validated():
    batch = MpubBatch(mpub_body([b"a", b"bb"] * 5), 100, 10_000, 4)
    assert len(list(batch.validate())) == 3  # 10 messages, 4 a step


@pytest.mark.parametrize("bad, error", [
    (mpub_body([b"a", b"bb"] * 5 + [b"x" * 101]), "MPUB message too big 101 > 100"),
    (mpub_body([b"a", b"bb"] * 5) + b"!", "MPUB body has 1 bytes after its 10 messages"),
    (mpub_body([b"a", b"bb"] * 5)[:-1], "MPUB failed to read message body"),
    (b"\x00\x00\x00\x0b" + mpub_body([b"a", b"bb"] * 5)[4:], r"MPUB failed to read message\(10\) body size"),
])
def test_a_big_batch_that_is_wrong_at_its_end_is_refused_before_any_step(bad, error):
    batch = MpubBatch(bad, 100, 10_000, 3)
    with pytest.raises(BadBatch, match=error):
        list(batch.validate())


def test_the_message_count_is_checked_first():
    with pytest.raises(BadBatch, match="MPUB invalid message count 0"):
        MpubBatch(b"\x00\x00\x00\x00", 100, 10_000)
    with pytest.raises(BadBatch, match="MPUB failed to read message count"):
        MpubBatch(b"\x00", 100, 10_000)
    assert not MpubBatch.is_big(mpub_body([b"a"] * 4), step=4) and MpubBatch.is_big(mpub_body([b"a"] * 5), step=4)


_LINES = st.lists(st.sampled_from([b"", b"a", b"bb", b"ccc", b"x" * 20]), max_size=80)


@given(_LINES, st.integers(1, 9))
def test_the_steps_of_a_batch_of_lines_are_its_non_empty_lines_in_order(lines, step):
    body = b"\n".join(lines)
    batch = LinesBatch(body, 100, step)
    steps = _taken(batch)
    assert list(itertools.chain.from_iterable(steps)) == split_lines(body, 100) == [x for x in lines if x]
    assert batch.count == len(split_lines(body, 100))
    assert all(1 <= len(s) <= step for s in steps)


def test_a_batch_of_lines_with_one_too_long_at_its_end_is_refused_before_any_step():
    body = b"a\n" * 50 + b"y" * 101
    assert LinesBatch.is_big(body, step=8)
    batch = LinesBatch(body, 100, 8)
    with pytest.raises(BadBatch) as caught:
        list(batch.validate())
    assert caught.value.code == "E_MSG_TOO_BIG"
    with pytest.raises(BadBatch):
        split_lines(body, 100)


def test_a_batch_of_lines_is_validated_window_by_window():
    batch = LinesBatch(b"a\n" * 100, 100, 10)
    assert len(list(batch.validate())) >= 5  # about 10 lines a window
    assert batch.count == 100
