"""A crash-safe segmented disk queue for nsqd's topic and channel backlogs.

See docs/diskq-format.md for the on-disk format and the recovery rules.
"""

from .errors import DiskQueueError, DiskQueueReadError, DiskQueueWriteError, MessageSizeError
from .queue import DiskQueue, close_many
from .stats import DiskQueueStatistics

__all__ = [
    "DiskQueue",
    "DiskQueueError",
    "DiskQueueReadError",
    "DiskQueueStatistics",
    "DiskQueueWriteError",
    "MessageSizeError",
    "close_many",
]
