"""Exceptions raised by the disk queue.

Callers catch :class:`DiskQueueError` to handle every queue failure; the
subclasses say whether the caller's input was wrong or the disk failed.
"""

from __future__ import annotations

import os


class DiskQueueError(Exception):
    """Base class for every error the disk queue raises."""


class MessageSizeError(DiskQueueError):
    """A payload is shorter than ``min_msg_size`` or longer than ``max_msg_size``."""


class _OSFailure(DiskQueueError):
    """An operating-system error, with its ``errno`` kept for the caller."""

    def __init__(self, errno: int | None, message: str) -> None:
        super().__init__(message)
        self.errno = errno

    @classmethod
    def from_os_error(cls, exc: OSError, what: str) -> "_OSFailure":
        reason = (exc.strerror or os.strerror(exc.errno)) if exc.errno else str(exc)
        return cls(exc.errno, f"{what}: [Errno {exc.errno}] {reason}")


class DiskQueueWriteError(_OSFailure):
    """Writing or syncing failed (ENOSPC, EMFILE, EIO...).

    Records already accepted stay in memory and are written once the cause
    clears; puts keep failing while the write buffer is full.
    """


class DiskQueueReadError(_OSFailure):
    """A segment could not be read (EMFILE, EIO...); nothing is skipped."""
