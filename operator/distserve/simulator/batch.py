"""A continuous decode batch that steps in closed form between membership changes.

Nothing about a decode batch changes between a request joining and a request leaving
except that every context grows by one token per step, so the time of k steps is a
sum of an arithmetic series. The batch therefore advances by whole runs of steps at
once: to the next finish, to the first iteration boundary after a newcomer is ready
to join, or to the step whose KV would no longer fit its memory budget. This is what
keeps a trial to a few events per request instead of one per generated token.

KV grows with the sequences (`distserve_engine.policy`): at a boundary whose next step
does not fit, the instance preempts the most recently joined members (`preempt_newest`)
until it does, and queues them to be prefilled again.
"""

from __future__ import annotations

import heapq
import math

from distserve.simulator.timing import StageTimer

MAX_BOUNDARY_SCAN = 4  # boundaries stepped over one by one before solving for the next


class HeldTokens:
    """The KV tokens an instance's lanes hold together (`DecodeRun.tokens_held` summed),
    kept up to date by each run as it changes, so that a budget costs one subtraction
    instead of a sum over pp lanes."""

    __slots__ = ("total", "holding")

    def __init__(self) -> None:
        self.total = 0
        self.holding: DecodeRun | None = None  # held at a boundary by an admission (`hold_at`)


def held_by_others(lanes, lane=None) -> int:
    """KV tokens the lanes other than `lane` hold (all of them for a newcomer, None)."""
    if len(lanes) == 1:
        return 0 if lane is not None else lanes[0].run.tokens_held()
    return sum(x.run.tokens_held() for x in lanes if x is not lane)


def limit_runs(lanes, free_tokens: int) -> None:
    """End each lane's run, in order, at the last step within what the other lanes leave
    of free_tokens (the KV the lanes may hold together; `DecodeRun.limit`).

    NOTE: one running sum of what the lanes hold, not held_by_others per lane: that was
    pp x pp calls per admission, most of a trial's time for a deep pipeline. A stepping
    run ends within its budget as long as the lanes together hold no more than
    free_tokens (it holds its own end's KV), so then only a run held at a boundary
    (which holds less than its end) may be limited, and the other lanes are not visited.
    """
    pool = lanes[0].run.pool if lanes else None
    if pool is not None and pool.total <= free_tokens:
        if pool.holding is not None:
            pool.holding.limit(free_tokens - (pool.total - pool.holding.tokens_held()))
        return
    held = sum(lane.run.tokens_held() for lane in lanes)
    for lane in lanes:
        mine = lane.run.tokens_held()
        lane.run.limit(free_tokens - (held - mine))
        held += lane.run.tokens_held() - mine


class DecodeBatch:
    """Requests decoding together on one pipeline lane.

    Steps are counted per batch: a request that joins at step j with context c holds
    c + (n - j) tokens at step n, so the total context is `offset + size * n`.
    """

    __slots__ = ("timer", "step", "time_s", "size", "offset", "_finish", "_members", "_joins",
                 "_line")

    def __init__(self, timer: StageTimer) -> None:
        self.timer = timer
        self.step = 0  # iteration boundaries passed so far
        self.time_s = 0.0  # when the batch reached `step`
        self.size = 0
        self.offset = 0  # sum over members of (context at join - step at join)
        self._finish: list[tuple[int, int, int]] = []  # heap of (finish step, join no, rid)
        # rid -> (offset, finish step, join no, first token time), in the order they joined
        self._members: dict[int, tuple[int, int, int, float]] = {}
        self._joins = 0
        self._line: tuple[float, float] | None = None  # `line()` until the batch changes

    def add(self, rid: int, context_tokens: int, steps_left: int, first_token_s: float) -> None:
        """Join at the current boundary; the request leaves after steps_left steps.
        context_tokens: the tokens it holds at its first step here (the newest included)."""
        offset = context_tokens - self.step
        finish = self.step + steps_left
        self._joins += 1
        heapq.heappush(self._finish, (finish, self._joins, rid))
        self._members[rid] = (offset, finish, self._joins, first_token_s)
        self.offset += offset
        self.size += 1
        self._line = None

    def total_context(self) -> int:
        """Tokens of KV the batch holds at the current step (the newest ones included)."""
        return self.offset + self.size * self.step

    def context_at(self, step: int) -> int:
        """Tokens of KV the batch holds at a later step, membership unchanged."""
        return self.offset + self.size * step

    def steps_to_next_finish(self) -> int:
        """Steps until the earliest member finishes (the batch must not be empty)."""
        self._drop_stale()
        return self._finish[0][0] - self.step

    def steps_within(self, budget_tokens: int) -> int:
        """How many steps from now fit in budget_tokens of KV (a large number when the
        batch is empty)."""
        if self.size == 0:
            return 1 << 62
        last_step = (budget_tokens - self.offset) // self.size  # the last step that fits
        return max(0, last_step - self.step + 1)

    def preempt_newest(self) -> tuple[int, int, int, float]:
        """Remove the member that joined last: (rid, tokens it holds now, steps it had
        left, its first token time)."""
        rid = next(reversed(self._members))
        offset, finish, _, first_s = self._members.pop(rid)
        self.offset -= offset
        self.size -= 1
        self._line = None
        return rid, offset + self.step, finish - self.step, first_s

    def line(self) -> tuple[float, float]:
        """(first_s, growth_s): the next step takes first_s, and each one after it
        growth_s longer, while the membership holds. Kept until the batch changes."""
        line = self._line
        if line is None:
            alpha, slope = self.timer.decode_line(self.size)
            line = self._line = (alpha + slope * self.total_context(), slope * self.size)
        return line

    def duration_s(self, num_steps: int) -> float:
        """Seconds for the next num_steps iterations at the current membership."""
        first, growth = self._line or self.line()
        return num_steps * first + growth * num_steps * (num_steps - 1) / 2

    def steps_by(self, elapsed_s: float) -> int:
        """The fewest steps whose duration reaches elapsed_s (the boundary at or after it)."""
        if elapsed_s <= 0:
            return 0
        first, growth = self._line or self.line()
        if growth <= 0:
            steps = math.ceil(elapsed_s / first)
        else:
            b = first - growth / 2
            steps = math.ceil((-b + math.sqrt(b * b + 2 * growth * elapsed_s)) / growth)
        while steps > 0 and self.duration_s(steps - 1) >= elapsed_s:  # float guard
            steps -= 1
        while self.duration_s(steps) < elapsed_s:
            steps += 1
        return steps

    def advance(self, num_steps: int, time_s: float) -> list[tuple[int, float]]:
        """Move num_steps iterations on, to time_s; return (rid, first token time) of the
        requests that finished."""
        self.step += num_steps
        self.time_s = time_s
        self._line = None
        done = []
        finish = self._finish
        self._drop_stale()
        while finish and finish[0][0] <= self.step:
            _, _, rid = heapq.heappop(finish)
            offset, _, _, first_s = self._members.pop(rid)
            self.offset -= offset
            self.size -= 1
            done.append((rid, first_s))
            self._drop_stale()
        return done

    def _drop_stale(self) -> None:
        """Pop heap entries of members preempted since they were pushed."""
        finish, members = self._finish, self._members
        while finish:
            _, join, rid = finish[0]
            member = members.get(rid)
            if member is not None and member[2] == join:
                return
            heapq.heappop(finish)


class DecodeRun:
    """Runs of decode steps of one batch on the event loop, each cut short on demand.

    `start(budget)` schedules the run up to the next finish or the last step that fits
    budget tokens of KV; `cut_short()` moves its end to the first iteration boundary at
    or after now (a newcomer is waiting); `limit(budget)` moves it earlier when a smaller
    budget ends it sooner (memory promised elsewhere meanwhile); when a run ends, `on_boundary(finished)` is called with the (rid, first token time) of the
    requests that left, and decides what the lane does next.
    """

    __slots__ = (
        "loop", "batch", "on_boundary", "is_stepping", "is_cut", "target_step", "version",
        "decide_step", "pool", "held", "_boundary", "queue", "lane",
    )

    def __init__(self, loop, timer: StageTimer, on_boundary, pool: HeldTokens | None = None,
                 queue=None) -> None:
        self.loop = loop
        self.batch = DecodeBatch(timer)
        self.on_boundary = on_boundary
        self.is_stepping = False
        self.is_cut = False  # the run already ends at the first boundary after a cut
        self.target_step = 0
        self.version = 0  # bumped to cancel a scheduled run end
        self.decide_step: int | None = None  # set while an admission decides mid-run
        self.pool = pool  # where the instance's lanes sum what they hold (None: not summed)
        self.held = 0  # tokens_held() as last added to pool (`sync`)
        # (version, elapsed_s, steps, duration_s) of the last first_boundary_by answer
        self._boundary: tuple[int, float, int, float] = (-1, 0.0, 0, 0.0)
        self.queue = queue  # a `boundaries.BoundaryQueue` told of every new run, or None
        self.lane = queue.add(self) if queue is not None else -1

    def start(self, budget_tokens: int) -> None:
        """Step from now to the next finish or the last step within budget_tokens (the
        batch must not be empty, and its next step must fit)."""
        batch = self.batch
        batch.time_s = self.loop.now
        steps = min(batch.steps_to_next_finish(), batch.steps_within(budget_tokens))
        self.is_cut = False
        self._end_at(batch.step + steps, batch.time_s + batch.duration_s(steps))

    def limit(self, budget_tokens: int) -> None:
        """End the run at the last step within budget_tokens, if that comes sooner (at
        least at the first boundary at or after now)."""
        if not self.is_stepping:
            return
        batch = self.batch
        within = batch.steps_within(budget_tokens)
        if batch.step + within >= self.target_step:
            return  # the run fits as planned
        steps = max(self.first_boundary_by(self.loop.now - batch.time_s)[0], within)
        if batch.step + steps < self.target_step:
            self._end_at(batch.step + steps, batch.time_s + batch.duration_s(steps))

    def tokens_held(self) -> int:
        """KV tokens the batch holds at its next step, or, while stepping, at the end of
        the current run.
        # NOTE: the end of the run, not now: what another lane or a newcomer may use must
        # stay free until this run ends, and it is one product instead of a root finding.
        """
        if self.decide_step is not None:
            return self.batch.context_at(self.decide_step)
        if self.is_stepping:
            return self.batch.context_at(self.target_step)
        return self.batch.total_context()

    def sync(self) -> None:
        """Bring the pool's sum up to date after the batch or the run changed."""
        pool = self.pool
        if pool is not None:
            batch, step = self.batch, self.decide_step  # tokens_held(), inline: a hot path
            if step is None:
                step = self.target_step if self.is_stepping else batch.step
            held = batch.offset + batch.size * step
            pool.total += held - self.held
            self.held = held

    def hold_at(self, step: int | None) -> None:
        """Hold the lane's context at boundary `step` while an admission decides (None:
        the decision is over)."""
        if self.pool is not None:
            self.pool.holding = self if step is not None else None
        self.decide_step = step
        self.sync()

    def first_boundary_by(self, elapsed_s: float) -> tuple[int, float]:
        """(steps, their duration) of the first iteration boundary at least elapsed_s
        into the current run (`DecodeBatch.steps_by`).

        NOTE: remembered per run: the clock only moves on, so while the boundary found
        last is still ahead it is still the first one (the batch is fixed while it
        steps, and each run bumps the version).
        """
        version, seen_s, steps, duration_s = self._boundary
        batch = self.batch
        if version == self.version and seen_s <= elapsed_s:
            # every boundary before the one found is before elapsed_s too: look on
            first, growth = batch.line()
            for _ in range(MAX_BOUNDARY_SCAN):
                if elapsed_s <= duration_s:
                    self._boundary = (version, elapsed_s, steps, duration_s)
                    return steps, duration_s
                steps += 1
                duration_s = steps * first + growth * steps * (steps - 1) / 2  # duration_s()
        steps = batch.steps_by(elapsed_s)
        duration_s = batch.duration_s(steps)
        self._boundary = (self.version, elapsed_s, steps, duration_s)
        return steps, duration_s

    def cut_short(self) -> None:
        """End the current run at the first boundary at or after now."""
        if self.is_cut:
            # NOTE: the end is the first boundary at or after an earlier now, and it is
            # still ahead, so it is the first one at or after this now too.
            return
        self.is_cut = True
        batch = self.batch
        steps, duration_s = self.first_boundary_by(self.loop.now - batch.time_s)
        if batch.step + steps < self.target_step:
            self._end_at(batch.step + steps, batch.time_s + duration_s)

    def _end_at(self, target_step: int, time_s: float) -> None:
        self.is_stepping = True
        self.target_step = target_step
        self.version += 1
        self.loop.at(time_s, self._end, self.version)
        self.sync()
        if self.queue is not None:
            self.queue.changed(self.lane, self.version, self.loop.now)

    def _end(self, version: int) -> None:
        if version != self.version:
            return  # cut short or superseded
        self.is_stepping = False
        batch = self.batch
        finished = batch.advance(self.target_step - batch.step, self.loop.now)
        self.sync()
        self.on_boundary(finished)
