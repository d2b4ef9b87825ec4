"""An exclusive lock on a queue's files.

Two queue objects appending to the same segments would interleave records
and fight over the metadata; an ``flock`` on a lock file turns that mistake
into a clear error. The kernel drops the lock when the process dies.
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
