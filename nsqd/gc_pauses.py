"""How long Python's garbage collector held the daemon: the figures Go nsqd reports from ``MemStats.PauseNs``.

A collection runs in the middle of whatever allocated last and stops the
event loop until it is done, so each one is a pause for every client. Go
keeps its last 256 pauses and ``/stats`` and statsd report percentiles of
them (``gc_pause_usec_100/99/95``); :class:`GCPauses` keeps the same from
``gc.callbacks``, plus the count and the total since start for
``/metrics``. One per process, as the collector is.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from time import perf_counter

#: how many of the latest pauses the percentiles are taken over (Go: len(MemStats.PauseNs))
KEEP = 256


class GCPauses:
    """Times every collection; installed once per process by :func:`install`."""

    def __init__(self, keep: int = KEEP) -> None:
        self.recent: deque[float] = deque(maxlen=keep)
        #: collections timed, and their seconds, since install
        self.count = 0
        self.total = 0.0
        self._started = 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = perf_counter()
            return
        pause = perf_counter() - self._started
        self.recent.append(pause)
        self.count += 1
        self.total += pause

    def percentiles_usec(self, percents: tuple[float, ...]) -> list[int]:
        """Percentiles of the recent pauses in µs, each picked as Go nsqd's ``percentile`` picks (0 if none)."""
        pauses = sorted(self.recent)
        if not pauses:
            return [0] * len(percents)
        last = len(pauses) - 1
        return [int(pauses[min(int(math.floor(p / 100.0 * len(pauses) + 0.5)), last)] * 1e6) for p in percents]


#: the process's pauses (empty until :func:`install`)
PAUSES = GCPauses()


def install() -> None:
    """Start timing collections into :data:`PAUSES` (once; later calls change nothing)."""
    if PAUSES.callback not in gc.callbacks:
        gc.callbacks.append(PAUSES.callback)
