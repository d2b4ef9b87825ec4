"""The fsync work of one commit, run in a worker thread.

Everything a commit must make durable is gathered in the Trio thread into a
:class:`SyncPlan`; the worker thread only fsyncs, saves metadata and unlinks
fully read segments. The Trio thread closes descriptors only while holding
the gate's lock and bumps its generation when it does, so a plan never
touches a descriptor that was closed (and maybe reused) under it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

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
    consumed: list[int] = field(default_factory=list)
    """Fully read segments, removed once ``metadata`` (which no longer points at them) is saved."""


def execute(plan: SyncPlan, files: QueueFiles, gate: SyncGate) -> None:
    """Make the plan durable; raises OSError. Does nothing if its descriptors were closed."""
    with gate.lock:
        if plan.generation != gate.generation:
            return
        for fd in plan.fds:
            os.fdatasync(fd)
        if plan.metadata is not None:
            save_metadata(files.metadata_path, plan.metadata)
            for segment in plan.consumed:
                try:
                    os.unlink(files.segment_path(segment))
                except FileNotFoundError:
                    pass
        elif plan.sync_directory:
            fsync_directory(files.directory)
