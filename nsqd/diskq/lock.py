"""Exclusive locks on a queue's files, or on a whole data path.

Two queue objects appending to the same segments would interleave records
and fight over the metadata; an ``flock`` turns that mistake into a clear
error. The kernel drops the lock when the process dies. A daemon locks its
data path once (as Go nsqd's dirlock does) and opens its queues without
lock files of their own: a descriptor for each idle queue would let clients
that make topics run the process out of descriptors.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import DiskQueueError


def acquire_queue_lock(path: Path, name: str) -> int:
    """Lock ``path`` for this process and return the descriptor holding the lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskQueueError(f"disk queue {name!r} is already open ({path} is locked)") from None
    return fd


def acquire_directory_lock(path: Path) -> int:
    """Lock the directory ``path`` itself for this process; returns the descriptor holding the lock.

    Raises BlockingIOError if another process holds it (Go nsqd takes the
    same lock on its data path, so the two exclude each other too).
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd
