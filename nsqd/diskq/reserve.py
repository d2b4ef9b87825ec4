"""Reserving a segment's blocks ahead of its writes (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``).

An append into blocks the file does not have yet leaves the filesystem to
allocate them when the data is written back: in durable mode inside the
commit's ``fdatasync``, whose journal commit then carries the allocation.
Blocks reserved ahead (the file's size unchanged, so readers and recovery
see nothing new) take that work out of the commits: measured here on ext4,
durable ``MPUB`` rose by 3–5% and default-flag publishing by 2–5%.

Best effort: where the call is missing or refused (another OS, a
filesystem without it, a full disk) the writes allocate as before.
"""

from __future__ import annotations

import ctypes
import sys

_KEEP_SIZE = 1  # FALLOC_FL_KEEP_SIZE
_fallocate = None
_loaded = False


def reserve(fd: int, offset: int, length: int) -> bool:
    """Allocate ``length`` bytes of ``fd`` from ``offset`` without changing its size; False if refused."""
    global _fallocate, _loaded
    if not _loaded:
        _loaded = True
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                _fallocate = libc.fallocate
                _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
                _fallocate.restype = ctypes.c_int
            except (OSError, AttributeError):
                _fallocate = None
    if _fallocate is None or length <= 0:
        return False
    return _fallocate(fd, _KEEP_SIZE, offset, length) == 0

