"""The baselines in simulation: prefill and decode sharing the same GPUs.

Two iteration policies on the same instance model, both with continuous batching:
- colocated (vLLM-style): at each iteration boundary, if a waiting prompt can be
  admitted, run a prefill iteration of waiting prompts (up to `max_batch_tokens`)
  while every running decode waits; otherwise run decode steps;
- chunked prefill (Sarathi / DeepSpeed-MII-style): each iteration takes up to
  `chunk_size` prompt tokens, FCFS, a prompt possibly spread over several iterations,
  and piggybacks one decode step of every running request on it.
A new request goes to the instance with the fewest prompt tokens in flight (requests sent
there and not finished; ties: fewer requests, then the lowest-numbered), as the engine's
router picks a colocated instance (`dispatch.pick_prefill`). An instance with
pp stages runs pp lanes (micro-batches) that share its KV memory. KV grows with the
sequences as on the engine's colocated instance (`distserve_engine.policy`): a waiting
request is admitted when its prefill's tokens fit beside the running requests' next
step, a prefill batch is filled by the engine's own function, and at a boundary whose
next step does not fit, the most recently joined request is preempted to the front of
its lane's queue, to be prefilled again (prompt and generated tokens).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import partial

from distserve.simulator.batch import DecodeRun, held_by_others, limit_runs
from distserve.simulator.drift import SpeedDrift, SpeedHistory, drifting
from distserve.simulator.events import EventLoop
from distserve.simulator.host import SharedHost, cut_runs, shared_host
from distserve.simulator.results import SLO, Recorder, SimResult, Trace
from distserve.simulator.timing import InstanceModel
from distserve_engine import policy


class _Instance:
    """KV memory and batch-size bound shared by an instance's lanes."""

    def __init__(self, sim, idx: int, inst: InstanceModel, max_batch: int,
                 chunk_size: int | None):
        self.sim, self.idx, self.inst, self.max_batch = sim, idx, inst, max_batch
        self.promised_tokens = 0  # admitted, not yet in a lane's batch (being prefilled)
        self.count = 0  # admitted and not finished or preempted
        # what the router counts: requests sent here and not finished, their prompt tokens
        self.num_outstanding = 0
        self.num_outstanding_tokens = 0
        self.lanes = [_Lane(sim, self, chunk_size) for _ in range(inst.pp)]

    def budget_tokens(self, lane: _Lane | None = None) -> int:
        """KV tokens free for `lane`'s batch (for a newcomer when None)."""
        return self.inst.kv_capacity_tokens - self.promised_tokens - held_by_others(self.lanes, lane)

    def can_admit(self, rid: int) -> bool:
        return policy.can_admit(self.count, self.max_batch, self.sim.held[rid],
                                self.budget_tokens())

    def admit(self, rid: int) -> None:
        self.promised_tokens += self.sim.held[rid]
        self.count += 1
        if len(self.lanes) > 1:  # the promise may end another lane's run sooner
            limit_runs(self.lanes, self.inst.kv_capacity_tokens - self.promised_tokens)

    def note_busy(self) -> None:
        """Tell the host whether a lane runs an iteration."""
        host = self.sim.host
        if host is not None:
            host.set_busy(self.idx, not all(lane.is_idle() for lane in self.lanes))

    def release(self, rid: int, from_lane: _Lane) -> None:
        self.count -= 1
        for lane in self.lanes:  # another lane idle for lack of memory may go on now
            if lane is not from_lane and lane.is_idle() and lane.waiting:
                lane.boundary([])


class _Lane:
    """One micro-batch: a waiting queue, prompts in prefill, and a decode batch."""

    def __init__(self, sim, instance: _Instance, chunk_size: int | None) -> None:
        self.sim, self.instance, self.chunk_size = sim, instance, chunk_size
        self.timer = instance.inst.timer
        self.run = DecodeRun(sim.loop, self.timer, self.boundary)
        self.waiting: deque[int] = deque()
        self.prefilling: list[list[int]] = []  # [rid, tokens prefilled] (chunked only)
        self.is_busy = False  # a prefill or mixed iteration is running
        self.is_waking = False  # a decision is scheduled for now

    def is_idle(self) -> bool:
        return not self.is_busy and not self.run.is_stepping

    def enqueue(self, rid: int) -> None:
        self.waiting.append(rid)
        if self.run.is_stepping:
            self.run.cut_short()  # prefill goes first at the next boundary
        elif not self.is_busy and not self.is_waking:
            # NOTE: decided in an event at the same time, after every arrival of that
            # time, so that requests arriving together are batched together.
            self.is_waking = True
            self.sim.loop.at(self.sim.loop.now, self._wake)

    def _wake(self) -> None:
        self.is_waking = False
        if self.is_idle():
            self.boundary([])

    def boundary(self, finished: list[tuple[int, float]]) -> None:
        """Record what finished, then choose the next iteration."""
        now = self.sim.loop.now
        sim, batch = self.sim, self.run.batch
        for rid, first_s in finished:
            sim.finish(rid, now, first_s, self.instance)
            self.instance.release(rid, self)
        budget = self.instance.budget_tokens(self)
        while batch.size and batch.total_context() > budget:  # the next step does not fit
            rid, held, steps_left, first_s = batch.preempt_newest()
            sim.held[rid], sim.steps_left[rid], sim.first_token_s[rid] = held, steps_left, first_s
            self.instance.count -= 1
            self.waiting.appendleft(rid)
            sim.rec.num_preemptions += 1
        if self.chunk_size is None:
            self._start_prefill(now)
        else:
            self._start_mixed(now)
        if not self.is_busy and batch.size:
            self.run.start(self.instance.budget_tokens(self))
        self.instance.note_busy()

    def _admit_waiting(self, budget_tokens: int) -> list[int]:
        """Chunked: admit waiting prompts FCFS while memory and batch size allow, until
        their tokens reach budget_tokens (the last one may spill into later chunks)."""
        held, admitted, total = self.sim.held, [], 0
        while budget_tokens > 0 and self.waiting and self.instance.can_admit(self.waiting[0]):
            rid = self.waiting.popleft()
            self.instance.admit(rid)
            admitted.append(rid)
            total += held[rid]
            if total >= budget_tokens:
                break
        return admitted

    def _start_prefill(self, now: float) -> None:
        """vLLM-style: a prefill batch of the waiting head, filled as the engine fills it."""
        held, instance = self.sim.held, self.instance
        count = policy.num_prefill_batch(
            ((held[r], held[r]) for r in self.waiting), self.sim.max_batch_tokens,
            instance.budget_tokens(), instance.max_batch - instance.count)
        rids = [self.waiting.popleft() for _ in range(count)]
        for rid in rids:
            instance.admit(rid)
        if rids:
            self.sim.rec.num_prefill_batches += 1
            seconds = self.timer.prefill_iteration_s(tuple(held[r] for r in rids))
            self.is_busy = True
            self.sim.loop.at(now + seconds, self._prefill_end, rids)

    def _prefill_end(self, rids: list[int]) -> None:
        self.is_busy = False
        self.run.batch.time_s = self.sim.loop.now  # decodes stood still meanwhile
        self._first_tokens(rids)
        self.boundary([])

    def _start_mixed(self, now: float) -> None:
        budget = self.chunk_size
        in_progress = sum(self.sim.held[rid] - done for rid, done in self.prefilling)
        for rid in self._admit_waiting(budget - in_progress):
            self.prefilling.append([rid, 0])
        chunks, completed = [], []
        for entry in self.prefilling:
            if budget <= 0:
                break
            rid, done = entry
            take = min(budget, self.sim.held[rid] - done)
            chunks.append((take, done))
            entry[1] += take
            budget -= take
            if entry[1] == self.sim.held[rid]:
                completed.append(rid)
        if not chunks:
            return
        self.prefilling = [e for e in self.prefilling if e[1] < self.sim.held[e[0]]]
        batch = self.run.batch
        seconds = self.timer.mixed_iteration_s(chunks, batch.size, batch.total_context())
        self.is_busy = True
        self.sim.loop.at(now + seconds, self._mixed_end, completed)

    def _mixed_end(self, completed: list[int]) -> None:
        self.is_busy = False
        finished = self.run.batch.advance(1, self.sim.loop.now)  # the piggybacked step
        self._first_tokens(completed)
        self.boundary(finished)

    def _first_tokens(self, rids: list[int]) -> None:
        """Prefills ended: each request has its first token (or, recomputed after a
        preemption, its next one) and joins the batch unless that was its last."""
        sim, now, batch = self.sim, self.sim.loop.now, self.run.batch
        for rid in rids:
            self.instance.promised_tokens -= sim.held[rid]
            if sim.first_token_s[rid] < 0:
                sim.rec.first_token(rid, now)
                sim.first_token_s[rid] = now
                steps_left = sim.output[rid] - 1
            else:
                steps_left = sim.steps_left[rid] - 1
            if steps_left == 0:
                sim.finish(rid, now, sim.first_token_s[rid], self.instance)
                self.instance.release(rid, self)
            else:
                batch.add(rid, sim.held[rid] + 1, steps_left, sim.first_token_s[rid])


class _Sim:
    def __init__(self, trace: Trace, slo: SLO | None, max_batch_tokens: int,
                 max_waiting: int | None = None, admit_by_ttft_s: float | None = None,
                 num_entry: int = 1) -> None:
        self.loop = EventLoop()
        self.rec = Recorder(trace, slo, self.loop, max_waiting, admit_by_ttft_s, num_entry)
        self.prompt = trace.prompt_tokens.tolist()
        self.output = trace.output_tokens.tolist()
        self.held = list(self.prompt)  # tokens a request's next prefill computes
        self.steps_left = [0] * trace.num_requests  # decode steps a preempted one still has
        self.first_token_s = [-1.0] * trace.num_requests  # -1: no first token yet
        self.max_batch_tokens = max_batch_tokens
        self.instances: list[_Instance] = []
        self.host: SharedHost | None = None  # where the instances slow each other down

    def arrive(self, rid: int) -> None:
        if not self.rec.admit(rid):
            return
        instance = min(self.instances, key=lambda i: (i.num_outstanding_tokens, i.num_outstanding))
        instance.num_outstanding += 1
        instance.num_outstanding_tokens += self.prompt[rid]
        min(instance.lanes, key=lambda lane: len(lane.waiting) + lane.run.batch.size).enqueue(rid)

    def finish(self, rid: int, now: float, first_s: float, instance: _Instance) -> None:
        """The request's last token: recorded, and no longer counted where it was sent."""
        self.rec.finish(rid, now, first_s)
        instance.num_outstanding -= 1
        instance.num_outstanding_tokens -= self.prompt[rid]


def simulate_colocated(
    trace: Trace,
    instances: Sequence[InstanceModel],
    *,
    slo: SLO | None = None,
    chunk_size: int | None = None,
    max_batch_tokens: int = 2048,
    max_batch: int = 256,
    max_waiting: int | None = None,
    admit_by_ttft_s: float | None = None,
    drift: SpeedDrift | SpeedHistory | None = None,
    busy_slowdown: float = 0.0,
) -> SimResult:
    """Run one trial of the colocated engine: vLLM-style with chunk_size None, chunked
    prefill with piggybacked decodes otherwise. Timers should come from the colocated
    latency model. With `slo`, the trial stops once the target is out of reach.
    `max_waiting`: the router refuses a request on arrival while this many wait for their
    first token (None: no limit); `admit_by_ttft_s`: it refuses one too when the queue
    ahead is predicted to delay its first token past this (the TTFT SLO; None: never),
    as the engine's router admits (`distserve_engine.admission`). `drift`: the
    instances' speed moves as it says. `busy_slowdown`: the instances share a host, and
    each runs x(1 + busy_slowdown x the share of the others busy) (`host.SharedHost`)."""
    sim = _Sim(trace, slo, max_batch_tokens, max_waiting, admit_by_ttft_s,
               max(len(instances), 1))
    models, sim.host = shared_host(drifting(instances, drift, sim.loop), busy_slowdown)
    sim.instances = [_Instance(sim, i, m, max_batch, chunk_size) for i, m in enumerate(models)]
    if sim.host is not None:
        for instance in sim.instances:
            sim.host.on_change[instance.idx] = partial(cut_runs, instance.lanes)
    sim.loop.arrivals(trace.arrival_s.tolist(), sim.arrive)
    sim.loop.run()
    return sim.rec.result()
