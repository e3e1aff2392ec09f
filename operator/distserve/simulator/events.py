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
    """A discrete-event clock: `at(t, fn, *args)` schedules, `run()` drains.

    `arrivals(times, fn)` schedules fn(i) at times[i] for a sorted series; they are
    merged in as the clock reaches them instead of all sitting in the heap, which
    keeps the heap to the few events in flight (each push and pop is cheaper).
    """

    __slots__ = ("now", "is_stopped", "_heap", "_seq", "_arrival_s", "_arrive")

    def __init__(self) -> None:
        self.now = 0.0
        self.is_stopped = False  # set by a component to end the run early
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0  # tie-breaker: equal times run in scheduling order, never compare fns
        self._arrival_s: list[float] = []
        self._arrive: Callable[[int], Any] | None = None

    def at(self, time_s: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call fn(*args) when the clock reaches time_s."""
        heapq.heappush(self._heap, (time_s, self._seq, fn, args))
        self._seq += 1

    def arrivals(self, times_s: list[float], fn: Callable[[int], Any]) -> None:
        """Call fn(i) at times_s[i] (sorted), before other events of the same time, as
        if scheduled before them (call before `run`, once)."""
        self._arrival_s, self._arrive = times_s, fn

    def run(self) -> None:
        """Process events in time order until none are left or a component stops the run."""
        heap, pop = self._heap, heapq.heappop
        arrival_s, arrive = self._arrival_s, self._arrive
        i, n = 0, len(arrival_s)
        while not self.is_stopped:
            if i < n and (not heap or arrival_s[i] <= heap[0][0]):
                self.now = arrival_s[i]
                arrive(i)
                i += 1
            elif heap:
                time_s, _, fn, args = pop(heap)
                self.now = time_s
                fn(*args)
            else:
                break
