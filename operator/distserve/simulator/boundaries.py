"""Which of an instance's stepping lanes reaches an iteration boundary first after now.

A decode instance admits a waiting request at the first boundary of any of its pp lanes
(`disaggregated._Decode`). Asking every lane on every offer costs pp root findings; this
queue keeps, per lane, either the first boundary found at or after an earlier time (still
the first one while it is ahead of now: the clock only moves on, and a run's batch is
fixed while it steps) or, after the lane's run changed, the time it changed (no boundary
of the new run comes before it). Only the entries at the head are looked at again.
"""

from __future__ import annotations

import heapq

from distserve.simulator.batch import DecodeRun

# NOTE: entries of runs that changed since are dropped as they reach the head; the queue
# is rebuilt from the live ones when it holds this many per lane, so it stays small.
MAX_ENTRIES_PER_LANE = 4


class BoundaryQueue:
    """The lanes' next iteration boundaries, earliest first (ties: the lane added first)."""

    __slots__ = ("runs", "_heap")

    def __init__(self) -> None:
        self.runs: list[DecodeRun] = []
        # (time_s, lane, version, step or -1 for "not before time_s", duration_s)
        self._heap: list[tuple[float, int, int, int, float]] = []

    def add(self, run: DecodeRun) -> int:
        """Register a lane's run; returns its place (what `changed` is told)."""
        self.runs.append(run)
        return len(self.runs) - 1

    def changed(self, lane: int, version: int, now_s: float) -> None:
        """The lane's run was scheduled anew (version) at now_s."""
        heap = self._heap
        heapq.heappush(heap, (now_s, lane, version, -1, 0.0))
        if len(heap) > MAX_ENTRIES_PER_LANE * len(self.runs) + 16:
            runs = self.runs
            self._heap = [e for e in heap if e[2] == runs[e[1]].version and runs[e[1]].is_stepping]
            heapq.heapify(self._heap)

    def first(self, now_s: float) -> tuple[float, DecodeRun, int, int] | None:
        """(time_s, run, version, step) of the first boundary at or after now_s that comes
        before its run's end, over every stepping lane; None when there is none."""
        heap, runs = self._heap, self.runs
        while heap:
            time_s, lane, version, step, duration_s = heap[0]
            run = runs[lane]
            if version != run.version or not run.is_stepping:
                heapq.heappop(heap)  # the run changed since, or ended
                continue
            batch = run.batch
            elapsed_s = now_s - batch.time_s
            if step >= 0 and duration_s >= elapsed_s:
                return time_s, run, version, step
            steps, duration_s = run.first_boundary_by(elapsed_s)
            if batch.step + steps < run.target_step:
                heapq.heapreplace(heap, (batch.time_s + duration_s, lane, version,
                                         batch.step + steps, duration_s))
            else:
                heapq.heappop(heap)
        return None
