"""Publish batches: the binary body of ``MPUB`` (and ``/mpub?binary=true``) and ``/mpub``'s lines.

A batch is validated whole before any of it is published, as nsqd does, and
its message bodies are views into it or slices of it. Most batches hold
hundreds of messages and are taken in one go (:func:`split_mpub`,
:func:`split_lines`). A big one (more messages than a step holds:
``STEP_MESSAGES``, fewer on a topic with many channels, see
``Broker.messages_per_step``) is a :class:`MpubBatch` or
:class:`LinesBatch`: validated, then handed out a step at a time, so that
the front end lets every other client run between steps
(``nsqd.broker.PublishInSteps`` stores them). A 5 MiB body of one-byte
messages is about a million messages: taken in one go, it held the event
loop for about a second and the daemon's memory at half a gigabyte.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

#: messages per step of a big batch: about 10 ms of the event loop for one-byte messages
STEP_MESSAGES = 8192

_I32 = struct.Struct(">i")


class BadBatch(Exception):
    """A batch that is not valid, with nsqd's code (``E_BAD_BODY``, ``E_BAD_MESSAGE``, ``E_MSG_TOO_BIG``)."""

    def __init__(self, code: str, desc: str) -> None:
        super().__init__(f"{code} {desc}")
        self.code = code
        self.desc = desc


def message_count(body: bytes, max_body_size: int) -> int:
    """The message count an ``MPUB`` body starts with, checked as nsqd checks it."""
    if len(body) < 4:
        raise BadBatch("E_BAD_BODY", "MPUB failed to read message count")
    count = _I32.unpack_from(body, 0)[0]
    if count <= 0 or count > (max_body_size - 4) // 5:
        raise BadBatch("E_BAD_BODY", f"MPUB invalid message count {count}")
    return count


def split_mpub(body: bytes, max_msg_size: int, max_body_size: int) -> list[memoryview]:
    """Every message body of an ``MPUB`` body, in one go (views into it, no copies)."""
    count = message_count(body, max_body_size)
    size = _uniform_size(body, count, max_msg_size)
    if size:
        return _cut(memoryview(body), size, 0, count)
    bodies: list[memoryview] = []
    _check_end(body, _walk(body, 4, 0, count, max_msg_size, bodies.append), count)
    return bodies


#: messages :func:`cut_short` checks at most (about 20 ms): past them it names the last message
CUT_SHORT_WALK = 65536


def cut_short(body: bytes | memoryview, max_msg_size: int, max_body_size: int) -> tuple[str, str]:
    """What nsqd's reader fails on when an ``MPUB`` body ends early (``body``: what arrived of it).

    nsqd reads the count, then each size and message in turn, checking
    each as it comes, so the error names the first part it could not read
    (or found wrong): ``(code, description)``. A body whose messages all
    arrived but not its declared size is cut short in its last message (the
    body is its declared size here, see docs/compatibility.md). The
    exception is not returned: its traceback's frames would hold ``body`` in
    a reference cycle until a full collection.
    """
    try:
        count = message_count(body, max_body_size)
        _walk(body, 4, 0, min(count, CUT_SHORT_WALK), max_msg_size, None)
    except BadBatch as exc:
        return exc.code, exc.desc
    return "E_BAD_MESSAGE", "MPUB failed to read message body"


class MpubBatch:
    """A big ``MPUB`` body: :meth:`validate` it (a step at a time), then take its :meth:`steps`."""

    def __init__(self, body: bytes, max_msg_size: int, max_body_size: int, step: int = STEP_MESSAGES) -> None:
        self.body = body
        self.max_msg_size = max_msg_size
        self.step = step
        self.count = message_count(body, max_body_size)
        #: every message's size when they are all the same (checked in C at once), else 0
        self._size = _uniform_size(body, self.count, max_msg_size)

    @staticmethod
    def is_big(body: bytes, step: int = STEP_MESSAGES) -> bool:
        """Whether a body says it holds more than ``step`` messages (its count is checked later)."""
        return len(body) >= 4 and _I32.unpack_from(body, 0)[0] > step

    def validate(self) -> Iterator[None]:
        """Check every message; yields after each ``step`` of them. Raises BadBatch."""
        if self._size:
            return
        step = self.step
        pos = 4
        for first in range(0, self.count, step):
            pos = _walk(self.body, pos, first, min(first + step, self.count), self.max_msg_size, None)
            yield
        _check_end(self.body, pos, self.count)

    def steps(self) -> Iterator[list[memoryview]]:
        """The message bodies, ``step`` at a time (after :meth:`validate`)."""
        step = self.step
        view = memoryview(self.body)
        if self._size:
            for first in range(0, self.count, step):
                yield _cut(view, self._size, first, min(first + step, self.count))
            return
        pos = 4
        for first in range(0, self.count, step):
            bodies: list[memoryview] = []
            pos = _walk(self.body, pos, first, min(first + step, self.count), self.max_msg_size, bodies.append)
            yield bodies


def split_lines(body: bytes, max_msg_size: int) -> list[bytes]:
    """``/mpub``'s messages in one go: one per line, empty lines skipped (as nsqd)."""
    lines = [line for line in body.split(b"\n") if line]
    if lines and max(map(len, lines)) > max_msg_size:
        raise BadBatch("E_MSG_TOO_BIG", "a line is longer than --max-msg-size")
    return lines


class LinesBatch:
    """A big ``/mpub`` body of lines, cut into windows of about ``STEP_MESSAGES`` lines each."""

    def __init__(self, body: bytes, max_msg_size: int, step: int = STEP_MESSAGES) -> None:
        self.body = body
        self.max_msg_size = max_msg_size
        self.step = step
        #: messages (non-empty lines), known once validated
        self.count = 0
        # bytes that hold about ``step`` lines on average; a window ends at a newline
        self._width = max(len(body) * step // max(body.count(b"\n"), 1), step)

    @staticmethod
    def is_big(body: bytes, step: int = STEP_MESSAGES) -> bool:
        """Whether a body may hold more than ``step`` lines."""
        return body.count(b"\n") >= step

    def _windows(self) -> Iterator[list[bytes]]:
        body, end, start = self.body, len(self.body), 0
        while start < end:
            stop = body.find(b"\n", start + self._width)
            stop = end if stop < 0 else stop + 1
            yield body[start:stop].split(b"\n")
            start = stop

    def validate(self) -> Iterator[None]:
        """Check every line's length and count the messages; yields after each window."""
        count = 0
        for parts in self._windows():
            if max(map(len, parts)) > self.max_msg_size:
                raise BadBatch("E_MSG_TOO_BIG", "a line is longer than --max-msg-size")
            count += len(parts) - parts.count(b"")
            yield
        self.count = count

    def steps(self) -> Iterator[list[bytes]]:
        """The messages, at most ``step`` at a time (after :meth:`validate`)."""
        step = self.step
        for parts in self._windows():
            lines = [line for line in parts if line]
            for first in range(0, len(lines), step):
                yield lines[first:first + step]


def _uniform_size(body: bytes, count: int, max_msg_size: int) -> int:
    """The size of every message when all are the same and valid, checked without a Python loop; else 0."""
    if len(body) < 8:
        return 0
    size = _I32.unpack_from(body, 4)[0]
    stride = size + 4
    if 0 < size <= max_msg_size and len(body) - 4 == count * stride and _sizes_all(body, stride, count):
        return size
    return 0


def _sizes_all(body: bytes, stride: int, count: int) -> bool:
    """Whether every size field of a body of ``count`` messages ``stride - 4`` bytes long is the
    first one: each of the four bytes compared at once across the batch (strided slices)."""
    for j in range(4):
        if body[4 + j::stride] != body[4 + j:5 + j] * count:
            return False
    return True


def _cut(view: memoryview, size: int, first: int, stop: int) -> list[memoryview]:
    """Messages ``first`` to ``stop`` of a uniform body, cut in C."""
    stride = size + 4
    start, end = 8 + first * stride, 8 + stop * stride
    return list(map(view.__getitem__, map(slice, range(start, end, stride), range(start + size, end + 1, stride))))


def _walk(body: bytes, pos: int, first: int, stop: int, max_msg_size: int, append) -> int:
    """Check messages ``first`` to ``stop`` starting at ``pos`` (handing each to ``append``
    unless it is None); returns where the next one starts. Raises BadBatch."""
    view = memoryview(body)
    unpack = _I32.unpack_from
    end = len(body)
    last_size = None  # not -1: a size of -1 must be checked too
    for index in range(first, stop):
        if pos + 4 > end:
            raise BadBatch("E_BAD_MESSAGE", f"MPUB failed to read message({index}) body size")
        size = unpack(body, pos)[0]
        pos += 4
        if size != last_size:
            if size <= 0:
                raise BadBatch("E_BAD_MESSAGE", f"MPUB invalid message({index}) body size {size}")
            if size > max_msg_size:
                raise BadBatch("E_BAD_MESSAGE", f"MPUB message too big {size} > {max_msg_size}")
            last_size = size
        start, pos = pos, pos + size
        if pos > end:
            raise BadBatch("E_BAD_MESSAGE", "MPUB failed to read message body")
        if append is not None:
            append(view[start:pos])
    return pos


def _check_end(body: bytes, pos: int, count: int) -> None:
    if pos != len(body):
        raise BadBatch("E_BAD_BODY", f"MPUB body has {len(body) - pos} bytes after its {count} messages")
