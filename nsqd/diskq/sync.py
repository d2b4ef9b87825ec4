"""The fsync work of one commit, run in a worker thread.

Everything a commit must make durable is gathered in the Trio thread into a
:class:`SyncPlan`; the worker thread only fsyncs and unlinks fully read
segments. The Trio thread closes descriptors only while holding
the gate's lock and bumps its generation when it does, so a plan never
touches a descriptor that was closed (and maybe reused) under it. Also
the file system's sync that closing many queues at once shares.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .metadata import Metadata, save_metadata
from .naming import QueueFiles, fsync_directory


class SyncGate:
    """Serialises descriptor closing in the Trio thread against plan execution."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation = 0


@dataclass
class SyncPlan:
    generation: int
    fds: list[int]
    retired: list[int]
    """The descriptors in ``fds`` of segments that are sealed and fully written."""
    sync_directory: bool
    metadata: Metadata | None = None
    """The checkpoint to save once the data is durable (saved in the Trio thread)."""
    consumed: list[int] = field(default_factory=list)
    """Fully read segments, removed once ``metadata`` (which no longer points at them) is saved."""
    checkpoint_fd: int | None = None
    """The checkpoint file saved last, in ``fds`` until a sync has covered it."""


def execute(plan: SyncPlan, files: QueueFiles, gate: SyncGate) -> None:
    """Make the plan's data durable; raises OSError. Does nothing if its descriptors were closed."""
    with gate.lock:
        if plan.generation != gate.generation:
            return
        for fd in plan.fds:
            os.fdatasync(fd)
        if plan.sync_directory:
            fsync_directory(files.directory)


def release(plan: SyncPlan, files: QueueFiles, gate: SyncGate) -> None:
    """Delete the plan's consumed segments, unless the queue was emptied or closed meanwhile."""
    with gate.lock:
        if plan.generation == gate.generation:
            unlink_segments(files, plan.consumed)


def save_and_release(files: QueueFiles, metadata: Metadata, released: list[int]) -> OSError | None:
    """Save the metadata file durably, then delete the released segments; returns the save's error.

    Saving first means a crash never leaves metadata pointing at a deleted
    segment. On a full disk the save itself needs space, so the released
    segments go first: if the process then dies, recovery starts from the
    oldest segment left and may deliver finished records again, but frees the
    space that lets the disk recover.
    """
    try:
        save_metadata(files.metadata_path, metadata)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return exc
        unlink_segments(files, released)
        try:
            save_metadata(files.metadata_path, metadata)
        except OSError as again:
            return again
        return None
    unlink_segments(files, released)
    return None


def unlink_segments(files: QueueFiles, segments: list[int]) -> None:
    """Remove segments whose records are all finished (those already gone are skipped)."""
    for segment in segments:
        try:
            os.unlink(files.segment_path(segment))
        except FileNotFoundError:
            pass


def sync_filesystem(directory: Path) -> None:
    """Make every file of ``directory``'s file system durable (``syncfs``; ``sync`` without it)."""
    global _syncfs
    if _syncfs is None:
        try:
            _syncfs = ctypes.CDLL(None, use_errno=True).syncfs
            _syncfs.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            _syncfs = False
    if _syncfs is False:
        os.sync()
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _syncfs(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        os.close(fd)


#: libc's syncfs once looked up (False: not there)
_syncfs = None
