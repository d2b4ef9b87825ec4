"""End-to-end processing latency (publish to FIN) quantiles over a sliding window.

As in nsqd, two half-window buckets rotate so a query sees between half and
all of ``--e2e-processing-latency-window-time``. Each bucket keeps a uniform
reservoir sample of bounded size (Vitter's algorithm R), so memory stays
fixed whatever the message rate and quantiles are exact over the sample. A
topic's figures merge its channels' buckets.
"""

from __future__ import annotations

import random

#: samples kept per half window
RESERVOIR = 2048


class _Bucket:
    __slots__ = ("seen", "samples")

    def __init__(self) -> None:
        self.seen = 0
        self.samples: list[int] = []

    def add(self, value: int) -> None:
        self.seen += 1
        if len(self.samples) < RESERVOIR:
            self.samples.append(value)
        else:
            slot = random.randrange(self.seen)
            if slot < RESERVOIR:
                self.samples[slot] = value


class LatencyWindow:
    def __init__(self, window_ns: int, percentiles: list[float], now_ns: int) -> None:
        self.percentiles = sorted(percentiles, reverse=True)
        self._half = max(window_ns // 2, 1)
        self._moved = now_ns
        self._buckets = [_Bucket(), _Bucket()]

    def _rotate(self, now_ns: int) -> None:
        while now_ns > self._moved + self._half:
            self._buckets = [_Bucket(), self._buckets[0]]
            self._moved += self._half

    def add_many(self, published_ns: list[int], now_ns: int) -> None:
        self._rotate(now_ns)
        add = self._buckets[0].add
        for ts in published_ns:
            add(now_ns - ts)

    def buckets(self, now_ns: int) -> list[_Bucket]:
        self._rotate(now_ns)
        return self._buckets


def result(windows: list[LatencyWindow], now_ns: int) -> tuple[int, tuple[dict, ...]]:
    """``(count, ({"quantile": q, "value": ns}, ...))`` over the windows, nsqd's shape."""
    if not windows:
        return 0, ()
    count = 0
    samples: list[int] = []
    for window in windows:
        for bucket in window.buckets(now_ns):
            count += bucket.seen
            samples += bucket.samples
    samples.sort()
    out = []
    for q in windows[0].percentiles:
        value = float(samples[min(int(q * len(samples)), len(samples) - 1)]) if samples else 0.0
        out.append({"quantile": q, "value": value})
    return count, tuple(out)


def human(ns: float) -> str:
    """nsqd's NanoSecondToHuman for the text stats."""
    for limit, unit in ((1e9, "s"), (1e6, "ms"), (1e3, "us")):
        if ns > limit:
            return f"{ns / limit:.1f}{unit}"
    return f"{ns:.1f}ns"
