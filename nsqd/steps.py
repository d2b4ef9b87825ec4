"""Long jobs written as generators that yield between steps, so the event loop can serve others.

A job's generator yields whenever it may pause and returns its result; it
is driven all at once where nothing else may run (shutdown, tests), or
paced, awaiting something between steps.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import TypeVar

import trio

T = TypeVar("T")


def run_whole(steps: Generator[None, None, T]) -> T:
    """The job's result, every step taken at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def run_paced(steps: Generator[None, None, T],
                    between: Callable[[], Awaitable[object]] = trio.lowlevel.checkpoint) -> T:
    """The job's result, ``between`` awaited after each step."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await between()
