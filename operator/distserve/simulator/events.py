"""The event loop every simulation runs on: a heap of timed callbacks, nothing else.

It decides only the order in which things happen: earliest time first, and among
events at the same time, the one scheduled first. What an event does is up to the
component that scheduled it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    """A discrete-event clock: `at(t, fn, *args)` schedules, `run()` drains."""

    __slots__ = ("now", "is_stopped", "_heap", "_seq")

    def __init__(self) -> None:
        self.now = 0.0
        self.is_stopped = False  # set by a component to end the run early
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0  # tie-breaker: equal times run in scheduling order, never compare fns

    def at(self, time_s: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call fn(*args) when the clock reaches time_s."""
        heapq.heappush(self._heap, (time_s, self._seq, fn, args))
        self._seq += 1

    def run(self) -> None:
        """Process events in time order until none are left or a component stops the run."""
        heap, pop = self._heap, heapq.heappop
        while heap and not self.is_stopped:
            time_s, _, fn, args = pop(heap)
            self.now = time_s
            fn(*args)
