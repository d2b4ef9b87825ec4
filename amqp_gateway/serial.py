"""RFC-1982 serial numbers, 32 bits (spec 2.8.9 sequence-no): they wrap around.

Delivery-count, delivery-id and transfer ids are sequence numbers; comparing
or subtracting them must survive the wrap from 4294967295 to 0.
"""

from __future__ import annotations

MASK = 0xFFFFFFFF
_HALF = 1 << 31


def add(a: int, n: int) -> int:
    return (a + n) & MASK


def diff(a: int, b: int) -> int:
    """``a - b`` as a signed distance (negative when ``a`` precedes ``b``)."""
    d = (a - b) & MASK
    return d - (1 << 32) if d >= _HALF else d
