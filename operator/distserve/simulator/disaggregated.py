"""DistServe's runtime in simulation: prefill instances, KV pull, decode instances.

Decisions modelled (paper section 4.3):
- a new request goes to the prefill instance with the shortest queue, counted as the
  router counts it: prompt tokens not yet prefilled (waiting or in the pipeline);
- a prefill instance runs FCFS batches filled up to Lm prompt tokens (a longer prompt
  runs alone); a batch walks through the pipeline stages, waiting where a stage is
  still busy with the previous batch, so unequal batches leave bubbles;
- a prefilled request keeps its KV in the prefill instance's memory and is handed to a
  decode instance as the router does (`distserve_engine.policy`): the least loaded
  (requests sent and not finished, then KV usage) among those with room on the fastest
  link from its prefill instance (its node, in a placed plan), else with room anywhere,
  else any; where decode may not cross nodes (low node affinity), the least loaded on
  that link with room, else the least loaded on it; the decode
  instance pulls it (FCFS) once it has room for its prompt and first token beside the
  running requests' next step; prefill stops forming batches while its memory is full;
- KV grows with the sequences; at a boundary whose next step does not fit, the most
  recently joined request is preempted and queued first, to be prefilled again on that
  decode instance (its prompt and generated tokens) when it fits; that prefill stalls
  its lane and yields its next token (counted in `SimResult.num_preemptions`);
- a decode instance with pp stages runs pp lanes (micro-batches) in turn, each a
  continuous batch; a new request joins the least loaded lane at its next boundary;
- with a `busy_slowdown`, the instances share a host and each runs slower while the
  others are busy (`simulator.host`): a prefill batch as they are when it starts, a
  decode instance's steps as they are from the step after one turns busy or idle.
NOTE: memory is counted in tokens (the engine counts blocks: the two agree at block
size 1, and within a block per request otherwise). A lane's run is bounded by the memory
left beside the other lanes as they stand at its start; they see each other's growth at
their next boundary. Keeping to the fastest link is what keeps the KV of replicated
Algorithm 2 units on their node (the paper's premise): with least-loaded dispatch over
all decode instances, half the KV of two replicas would cross the network and the pair
would serve less than one replica; and a preference alone sends KV across whenever
the node's decode instances are near full, as they are under load. A prefill instance
with no decode instance on its node has all of them on its fastest link (the network),
so keeping to that link falls back to the others as the router does. KV pulls into one
decode instance go one at a time over the link between the two instances.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from operator import attrgetter

from distserve.simulator.batch import DecodeRun, HeldTokens, limit_runs
from distserve.simulator.boundaries import BoundaryQueue
from distserve.simulator.drift import SpeedDrift, SpeedHistory, drifting
from distserve.simulator.events import EventLoop
from distserve.simulator.host import SharedHost, cut_runs, shared_host
from distserve.simulator.results import SLO, Recorder, SimResult, Trace
from distserve.simulator.timing import InstanceModel
from distserve_engine import policy

RECOMPUTE = -2  # in a decode instance's queue: a preempted request, to prefill again there
_UNPREFILLED = attrgetter("unprefilled_tokens")


@dataclass(frozen=True)
class TransferModel:
    """KV bytes per token and the link bandwidth between each prefill/decode pair."""

    kv_bytes_per_token: float
    link_bytes_per_s: float | Sequence[Sequence[float]]  # one value, or [prefill][decode]

    def seconds_per_token(self, p: int, d: int, streams: int) -> float:
        """Transfer seconds per prompt token; the pp stages' segments send in parallel."""
        bw = self.link_bytes_per_s
        link = bw if isinstance(bw, (int, float)) else bw[p][d]
        return self.kv_bytes_per_token / (link * max(streams, 1))


class _Sim:
    """State shared by the instances of one trial."""

    def __init__(self, trace: Trace, slo: SLO | None, max_waiting: int | None = None,
                 admit_by_ttft_s: float | None = None, num_entry: int = 1) -> None:
        self.loop = EventLoop()
        self.rec = Recorder(trace, slo, self.loop, max_waiting, admit_by_ttft_s, num_entry)
        self.prompt = trace.prompt_tokens.tolist()
        self.output = trace.output_tokens.tolist()
        self.first_token_s = [0.0] * trace.num_requests
        self.held = [0] * trace.num_requests  # tokens a preempted request holds (recomputed)
        self.steps_left = [0] * trace.num_requests  # decode steps a preempted one still has
        self.prefills: list[_Prefill] = []
        self.decodes: list[_Decode] = []
        self.nearest_decodes: list[set[int]] = []  # per prefill: decodes on its fastest link
        self.nearest_lists: list[list[_Decode]] = []  # the same, as instances in order
        self.can_decode_across_nodes = True  # False: a request stays with its nearest decodes
        self.is_prefill_only = False
        self.max_decode_batch = 0
        self.host: SharedHost | None = None  # where the instances slow each other down

    def arrive(self, rid: int) -> None:
        if not self.rec.admit(rid):
            return
        if self.prefills:
            prefills = self.prefills
            if len(prefills) > 1:
                prefills = [min(prefills, key=_UNPREFILLED)]
            prefills[0].enqueue(rid)
        else:  # decode-only trial: the request comes prefilled, first token at arrival
            self.first_token_s[rid] = self.loop.now
            self.rec.first_token(rid, self.loop.now)
            self.hand_to_decode(rid, -1)

    def prefilled(self, rid: int, prefill: _Prefill) -> None:
        now = self.loop.now
        self.first_token_s[rid] = now
        self.rec.first_token(rid, now)
        if self.is_prefill_only or self.output[rid] == 1:
            self.rec.finish(rid, now, now)
            prefill.release(self.prompt[rid])
        else:
            self.hand_to_decode(rid, prefill.idx)

    def find_nearest_decodes(self, num_prefills: int) -> None:
        """Per prefill instance, the decodes on its fastest link: on its node in a placed
        plan, or all of them where none is (or every link is the same)."""
        for p in range(num_prefills):
            fastest = min((d.s_per_token[p] for d in self.decodes), default=0.0)
            near = [d for d in self.decodes if d.s_per_token[p] == fastest]
            self.nearest_decodes.append({d.idx for d in near})
            self.nearest_lists.append(near)

    def hand_to_decode(self, rid: int, prefill_idx: int) -> None:
        """The router's `pick_decode`: least loaded with room near the prefill, else with
        room anywhere, else any; kept near (no crossing), least loaded near with room,
        else least loaded near."""
        decodes = self.decodes
        near = self.nearest_decodes[prefill_idx] if prefill_idx >= 0 else None
        if near is not None and not self.can_decode_across_nodes:
            decodes = self.nearest_lists[prefill_idx]  # the others are never chosen
        if len(decodes) > 1:
            loads = [(d.load(), d.kv_usage(), d.idx) for d in decodes]
            roomy = [x for x in loads if policy.has_decode_room(x[0], x[1], self.max_decode_batch)]
            local = [x for x in roomy if near is None or x[2] in near]
            decodes = [self.decodes[min(local or roomy or loads)[2]]]
        decodes[0].offer(rid, prefill_idx)


class _Prefill:
    """One prefill instance: FCFS queue, pipeline stages, KV held until pulled."""

    def __init__(self, sim: _Sim, idx: int, inst: InstanceModel, max_tokens: int) -> None:
        self.sim, self.idx, self.inst, self.max_tokens = sim, idx, inst, max_tokens
        self.queue: deque[int] = deque()
        self.stage_free_s = [0.0] * inst.pp
        self.held_tokens = 0
        self.unprefilled_tokens = 0  # prompt tokens queued or in the pipeline
        self.is_waking = False
        self.num_in_flight = 0  # batches in the pipeline

    def enqueue(self, rid: int) -> None:
        self.queue.append(rid)
        self.unprefilled_tokens += self.sim.prompt[rid]
        self.try_start()

    def release(self, tokens: int) -> None:
        self.held_tokens -= tokens
        if self.queue:
            self.try_start()

    def _wake(self) -> None:
        self.is_waking = False
        self.try_start()

    def try_start(self) -> None:
        """Form a batch if stage 0 is free and memory allows."""
        loop = self.sim.loop
        if loop.now < self.stage_free_s[0]:
            if not self.is_waking:
                self.is_waking = True
                loop.at(self.stage_free_s[0], self._wake)
            return
        prompt, queue = self.sim.prompt, self.queue
        room = self.inst.kv_capacity_tokens - self.held_tokens
        count = policy.num_prefill_batch(
            ((prompt[r], prompt[r]) for r in queue), self.max_tokens, room, len(queue))
        if not count:
            return  # memory full: a pull's release() retries
        rids = [queue.popleft() for _ in range(count)]
        lens = tuple([prompt[r] for r in rids])
        self.held_tokens += sum(lens)
        self.sim.rec.num_prefill_batches += 1
        stage_s, handoff_s = self.inst.timer.prefill_batch_s(lens)
        ready_s, free = loop.now, self.stage_free_s
        for k, free_s in enumerate(free):  # each stage starts when it and the batch are free
            if free_s < ready_s:
                free_s = ready_s
            free_s += stage_s
            free[k] = free_s
            ready_s = free_s + handoff_s
        loop.at(free[-1], self._done, rids)
        self.num_in_flight += 1
        if self.sim.host is not None:
            self.sim.host.set_busy(self.idx, True)
        if queue:
            self.is_waking = True
            loop.at(free[0], self._wake)

    def _done(self, rids: list[int]) -> None:
        self.num_in_flight -= 1
        if not self.num_in_flight and self.sim.host is not None:
            self.sim.host.set_busy(self.idx, False)
        for rid in rids:
            self.unprefilled_tokens -= self.sim.prompt[rid]
            self.sim.prefilled(rid, self)


class _Decode:
    """One decode instance: FCFS admission by batch size and free KV, pp lanes."""

    def __init__(self, sim, idx, inst: InstanceModel, max_batch, transfer, prefill_pps) -> None:
        self.sim, self.idx, self.inst, self.max_batch = sim, idx, inst, max_batch
        self.host_index = len(sim.prefills) + idx  # after the prefill instances
        self.pending: deque[tuple[int, int]] = deque()  # (rid, prefill idx or RECOMPUTE)
        self.promised_tokens = 0  # admitted, not yet in a lane's batch
        self.count = 0  # admitted and not finished or preempted
        self.is_decide_due = False  # an admission is scheduled at a lane's next boundary
        self.link_free_s = 0.0
        self.held = HeldTokens()  # what the lanes hold together
        self.boundaries = BoundaryQueue()  # where the lanes' next boundaries are
        self.lanes = [_Lane(sim, self) for _ in range(inst.pp)]
        self.s_per_token = [
            transfer.seconds_per_token(p, idx, min(pp, inst.pp)) if transfer else 0.0
            for p, pp in enumerate(prefill_pps)
        ]

    def load(self) -> int:
        """Requests sent here and not finished (the router's count)."""
        return self.count + len(self.pending)

    def budget_tokens(self, lane: _Lane | None = None) -> int:
        """KV tokens free for `lane`'s batch (for a newcomer when None)."""
        others = self.held.total - (lane.run.held if lane is not None else 0)
        return self.inst.kv_capacity_tokens - self.promised_tokens - others

    def kv_usage(self) -> float:
        """Share of KV held or promised, as the instance reports it."""
        return 1.0 - self.budget_tokens() / max(1, self.inst.kv_capacity_tokens)

    def offer(self, rid: int, prefill_idx: int) -> None:
        """Queue a prefilled request; it is admitted now if a lane is idle, else at the
        next iteration boundary (the engine decides between two steps)."""
        self.pending.append((rid, prefill_idx))
        if any(map(_Lane.is_idle, self.lanes)):
            self.try_admit()
        elif not self.is_decide_due:
            self._decide_at_next_boundary()

    def _decide_at_next_boundary(self) -> None:
        """Schedule admission at the first iteration boundary of a stepping lane, without
        ending its run (a run's own end admits anyway).
        # NOTE: between two finishes only growth changes, which never makes room, so
        # deciding again at every later step, as the engine does, would admit nothing.
        """
        # NOTE: a lane busy with a recompute is not stepping: its end decides
        first = self.boundaries.first(self.sim.loop.now)
        if first is not None:
            time_s, run, version, step = first
            self.is_decide_due = True
            self.sim.loop.at(time_s, self._decide, self.lanes[run.lane], version, step)

    def _decide(self, lane: _Lane, version: int, step: int) -> None:
        self.is_decide_due = False
        if lane.run.version != version:
            return  # the run ended meanwhile: its boundary admitted
        lane.run.hold_at(step)  # the lane holds its context at this boundary
        self.try_admit()
        lane.run.hold_at(None)

    def try_admit(self) -> None:
        """Admit the head of the queue while it fits: start its pull, or hand it to a
        lane to prefill again (a preempted request)."""
        sim, pending, is_admitted = self.sim, self.pending, False
        while pending:
            rid, p = pending[0]
            need = sim.held[rid] if p == RECOMPUTE else sim.prompt[rid] + 1
            if not policy.can_admit(self.count, self.max_batch, need, self.budget_tokens()):
                break
            pending.popleft()
            self.count += 1
            self.promised_tokens += need
            is_admitted = True
            if p == RECOMPUTE:
                self._least_loaded_lane().recompute(rid)
                continue
            seconds = sim.prompt[rid] * self.s_per_token[p] if p >= 0 else 0.0
            self.link_free_s = max(sim.loop.now, self.link_free_s) + seconds
            sim.loop.at(self.link_free_s, self._arrived, rid, p)
        if is_admitted:  # the promise may end a running lane's run sooner
            limit_runs(self.lanes, self.inst.kv_capacity_tokens - self.promised_tokens)

    def _least_loaded_lane(self) -> _Lane:
        lanes = self.lanes
        return lanes[0] if len(lanes) == 1 else min(lanes, key=_Lane.load)

    def _arrived(self, rid: int, p: int) -> None:
        if p >= 0:
            self.sim.prefills[p].release(self.sim.prompt[rid])
        self._least_loaded_lane().join(rid)

    def preempted(self, rid: int) -> None:
        self.count -= 1
        self.pending.appendleft((rid, RECOMPUTE))
        self.sim.rec.num_preemptions += 1

    def note_busy(self) -> None:
        """Tell the host whether a lane steps or prefills again."""
        host = self.sim.host
        if host is not None:
            host.set_busy(self.host_index,
                          any(lane.is_busy or lane.run.is_stepping for lane in self.lanes))


class _Lane:
    """One micro-batch of a decode instance, advanced a run of steps at a time."""

    def __init__(self, sim: _Sim, decode: _Decode) -> None:
        self.sim, self.decode = sim, decode
        self.run = DecodeRun(sim.loop, decode.inst.timer, self._boundary, decode.held,
                             decode.boundaries)
        self.joining: list[int] = []  # pulled, join at the next boundary
        self.recomputing: list[int] = []  # preempted and admitted again, prefill next
        self.is_busy = False  # a recompute prefill is running
        self.is_deciding = False  # inside _boundary

    def load(self) -> int:
        return self.run.batch.size + len(self.joining) + len(self.recomputing)

    def is_idle(self) -> bool:
        return not (self.is_busy or self.is_deciding or self.run.is_stepping)

    def join(self, rid: int) -> None:
        self.joining.append(rid)
        self._wake()

    def recompute(self, rid: int) -> None:
        self.recomputing.append(rid)
        self._wake()

    def _wake(self) -> None:
        if self.is_busy or self.is_deciding:
            return
        if self.run.is_stepping:
            self.run.cut_short()  # the newcomer is taken at the next iteration boundary
        else:
            self._boundary([])

    def _boundary(self, finished: list[tuple[int, float]]) -> None:
        sim, decode, batch = self.sim, self.decode, self.run.batch
        now = sim.loop.now
        self.is_deciding = True
        for rid, first_s in finished:
            sim.rec.finish(rid, now, first_s)
            decode.count -= 1
        for rid in self.joining:
            batch.add(rid, sim.prompt[rid] + 1, sim.output[rid] - 1, sim.first_token_s[rid])
            decode.promised_tokens -= sim.prompt[rid] + 1
        self.joining.clear()
        self.run.sync()
        budget = decode.budget_tokens(self)
        while batch.size and batch.total_context() > budget:  # the next step does not fit
            rid, held, steps_left, first_s = batch.preempt_newest()
            sim.held[rid], sim.steps_left[rid], sim.first_token_s[rid] = held, steps_left, first_s
            decode.preempted(rid)
        self.run.sync()
        decode.try_admit()
        self.is_deciding = False
        if self.recomputing:
            rids, self.recomputing = self.recomputing, []
            self.is_busy = True
            sim.rec.num_prefill_batches += 1
            seconds = decode.inst.timer.prefill_iteration_s(tuple(sim.held[r] for r in rids))
            sim.loop.at(now + seconds, self._recomputed, rids)
        elif batch.size:
            self.run.start(decode.budget_tokens(self))
        decode.note_busy()

    def _recomputed(self, rids: list[int]) -> None:
        """The prefill of preempted requests ended: each has its next token."""
        sim, decode, batch = self.sim, self.decode, self.run.batch
        now = sim.loop.now
        self.is_busy = False
        batch.time_s = now  # the batch stood still meanwhile
        for rid in rids:
            decode.promised_tokens -= sim.held[rid]
            steps_left = sim.steps_left[rid] - 1
            if steps_left == 0:
                sim.rec.finish(rid, now, sim.first_token_s[rid])
                decode.count -= 1
            else:
                batch.add(rid, sim.held[rid] + 1, steps_left, sim.first_token_s[rid])
        self.run.sync()
        self._boundary([])


def simulate_disaggregated(
    trace: Trace,
    prefill: Sequence[InstanceModel],
    decode: Sequence[InstanceModel],
    *,
    transfer: TransferModel | None,
    slo: SLO | None = None,
    max_prefill_tokens: int | Sequence[int] = 512,
    max_decode_batch: int = 256,
    can_decode_across_nodes: bool = True,
    max_waiting: int | None = None,
    admit_by_ttft_s: float | None = None,
    drift: SpeedDrift | SpeedHistory | None = None,
    busy_slowdown: float = 0.0,
) -> SimResult:
    """Run one trial. An empty `prefill` simulates decode alone (requests arrive
    prefilled); an empty `decode` simulates prefill alone (requests end at their first
    token). With `slo`, the trial stops once the attainment target is out of reach.
    `max_prefill_tokens`: Lm of every prefill instance, or one per instance.
    `can_decode_across_nodes` False (low node affinity): a prefilled request goes to a
    decode instance on its prefill's fastest link (its node), full or not.
    `max_waiting`: the router refuses a request on arrival while this many wait for their
    first token (None: no limit); `admit_by_ttft_s`: it refuses one too when the queue
    ahead is predicted to delay its first token past this (the TTFT SLO; None: never),
    as the engine's router admits (`distserve_engine.admission`). `drift`: the
    instances' speed moves as it says. `busy_slowdown`: the instances share a host, and
    each runs x(1 + busy_slowdown x the share of the others busy) (`host.SharedHost`)."""
    sim = _Sim(trace, slo, max_waiting, admit_by_ttft_s, max(len(prefill), 1))
    models, sim.host = shared_host(drifting([*prefill, *decode], drift, sim.loop),
                                   busy_slowdown)
    prefill, decode = models[:len(prefill)], models[len(prefill):]
    lms = ([max_prefill_tokens] * len(prefill) if isinstance(max_prefill_tokens, int)
           else list(max_prefill_tokens))
    sim.prefills = [_Prefill(sim, i, m, lm) for i, (m, lm) in enumerate(zip(prefill, lms, strict=True))]
    pps = [m.pp for m in prefill]
    sim.decodes = [
        _Decode(sim, i, m, max_decode_batch, transfer, pps) for i, m in enumerate(decode)
    ]
    sim.is_prefill_only = not decode
    if sim.host is not None:
        for d in sim.decodes:
            sim.host.on_change[d.host_index] = partial(cut_runs, d.lanes)
    sim.max_decode_batch = max_decode_batch
    sim.can_decode_across_nodes = can_decode_across_nodes
    sim.find_nearest_decodes(len(sim.prefills))
    sim.loop.arrivals(trace.arrival_s.tolist(), sim.arrive)
    sim.loop.run()
    return sim.rec.result()
