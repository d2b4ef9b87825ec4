"""Reserving a segment's blocks ahead of its writes (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``).

An append into blocks the file does not have yet leaves the filesystem to
allocate them when the data is written back: in durable mode inside the
commit's ``fdatasync``, whose journal commit then carries the allocation.
Blocks reserved ahead (the file's size unchanged, so readers and recovery
see nothing new) take that work out of the commits: measured here on ext4,
durable ``MPUB`` rose by 3–5% and default-flag publishing by 2–5%, for about
6 µs per 4 MiB reserved.

Not on tmpfs: there reserving means allocating and zeroing the pages now
(a millisecond per 4 MiB, in the event loop) and there is no journal to
spare. Best effort elsewhere too: where the call is missing or refused
(another OS, a filesystem without it, a full disk) the writes allocate as
before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

_KEEP_SIZE = 1  # FALLOC_FL_KEEP_SIZE
_TMPFS_MAGIC = 0x01021994
_fallocate = None
_fstatfs = None
_loaded = False
#: per device (``st_dev``): whether reserving blocks there is worth a call
_worth: dict[int, bool] = {}


def reserve(fd: int, offset: int, length: int) -> bool:
    """Allocate ``length`` bytes of ``fd`` from ``offset`` without changing its size; False if not done."""
    if not _loaded:
        _load()
    if _fallocate is None or length <= 0:
        return False
    device = os.fstat(fd).st_dev
    worth = _worth.get(device)
    if worth is None:
        worth = _worth[device] = not _in_memory(fd)
    return worth and _fallocate(fd, _KEEP_SIZE, offset, length) == 0


def reserve_now(fd: int, offset: int, length: int) -> None:
    """Allocate blocks as :func:`reserve` does, on any filesystem; raises OSError when there is no
    room (a write into them then cannot fail for space). Does nothing where the call is missing."""
    if not _loaded:
        _load()
    if _fallocate is None or length <= 0:
        return
    if _fallocate(fd, _KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code))


def _in_memory(fd: int) -> bool:
    """Whether ``fd`` lives on tmpfs (its statfs magic)."""
    if _fstatfs is None:
        return False
    buffer = (ctypes.c_long * 32)()  # struct statfs starts with f_type; room to spare
    return _fstatfs(fd, buffer) == 0 and buffer[0] & 0xFFFFFFFF == _TMPFS_MAGIC


def _load() -> None:
    global _fallocate, _fstatfs, _loaded
    _loaded = True
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _fallocate = libc.fallocate
        _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        _fallocate.restype = ctypes.c_int
        _fstatfs = libc.fstatfs
        _fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
        _fstatfs.restype = ctypes.c_int
    except (OSError, AttributeError):
        _fallocate = _fstatfs = None
