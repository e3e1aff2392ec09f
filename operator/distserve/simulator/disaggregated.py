"""DistServe's runtime in simulation: prefill instances, KV pull, decode instances.

Decisions modelled (paper section 4.3):
- a new request goes to the prefill instance with the shortest queue, counted as the
  router counts it: prompt tokens not yet prefilled (waiting or in the pipeline);
- a prefill instance runs FCFS batches filled up to Lm prompt tokens (a longer prompt
  runs alone); a batch walks through the pipeline stages, waiting where a stage is
  still busy with the previous batch, so unequal batches leave bubbles;
- a prefilled request keeps its KV in the prefill instance's memory and is handed to
  the least loaded decode instance among those on the fastest link from its prefill
  instance (all of them when the links are equal), which pulls it (FCFS) once it has
  room for the request's whole context; prefill stops forming batches while its
  memory is full;
- a decode instance with pp stages runs pp lanes (micro-batches) in turn, each a
  continuous batch; a new request joins the least loaded lane at its next boundary.
NOTE: decode admits a request only when its final context (prompt + output) fits, so
no preemption is needed or modelled. Preferring the fastest link is what keeps the KV
of replicated Algorithm 2 units on their node (the paper's premise): with least-loaded
dispatch over all decode instances, half the KV of two replicas would cross the
network and the pair would serve less than one replica. KV pulls into one decode instance go one at a
time over the link between the two instances.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from distserve.simulator.batch import DecodeRun
from distserve.simulator.events import EventLoop
from distserve.simulator.results import SLO, Recorder, SimResult, Trace
from distserve.simulator.timing import InstanceModel


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

    def __init__(self, trace: Trace, slo: SLO | None) -> None:
        self.loop = EventLoop()
        self.rec = Recorder(trace, slo, self.loop)
        self.prompt = trace.prompt_tokens.tolist()
        self.output = trace.output_tokens.tolist()
        self.first_token_s = [0.0] * trace.num_requests
        self.prefills: list[_Prefill] = []
        self.decodes: list[_Decode] = []
        self.nearest_decodes: list[list[_Decode]] = []  # per prefill: on its fastest link
        self.is_prefill_only = False

    def arrive(self, rid: int) -> None:
        if self.prefills:
            prefills = self.prefills
            if len(prefills) > 1:
                prefills = [min(prefills, key=lambda p: p.unprefilled_tokens)]
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

    def hand_to_decode(self, rid: int, prefill_idx: int) -> None:
        decodes = self.nearest_decodes[prefill_idx] if prefill_idx >= 0 else self.decodes
        if len(decodes) > 1:
            decodes = [min(decodes, key=lambda d: d.count + len(d.pending))]
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
        rids, total = [], 0
        while queue:
            tokens = prompt[queue[0]]
            if (rids and total + tokens > self.max_tokens) or total + tokens > room:
                break
            rids.append(queue.popleft())
            total += tokens
        if not rids:
            return  # memory full: a pull's release() retries
        self.held_tokens += total
        stage_s, handoff_s = self.inst.timer.prefill_batch_s(tuple(prompt[r] for r in rids))
        ready_s, free = loop.now, self.stage_free_s
        for k in range(len(free)):
            free[k] = max(ready_s, free[k]) + stage_s
            ready_s = free[k] + handoff_s
        loop.at(free[-1], self._done, rids)
        if queue:
            self.is_waking = True
            loop.at(free[0], self._wake)

    def _done(self, rids: list[int]) -> None:
        for rid in rids:
            self.unprefilled_tokens -= self.sim.prompt[rid]
            self.sim.prefilled(rid, self)


class _Decode:
    """One decode instance: FCFS pulls bounded by KV capacity and batch size, pp lanes."""

    def __init__(self, sim, idx, inst: InstanceModel, max_batch, transfer, prefill_pps) -> None:
        self.sim, self.idx, self.inst, self.max_batch = sim, idx, inst, max_batch
        self.pending: deque[tuple[int, int]] = deque()  # (rid, prefill idx) not yet pulled
        self.reserved_tokens = 0
        self.count = 0  # pulled and not finished
        self.link_free_s = 0.0
        self.lanes = [_Lane(sim, self) for _ in range(inst.pp)]
        self.s_per_token = [
            transfer.seconds_per_token(p, idx, min(pp, inst.pp)) if transfer else 0.0
            for p, pp in enumerate(prefill_pps)
        ]

    def offer(self, rid: int, prefill_idx: int) -> None:
        self.pending.append((rid, prefill_idx))
        self.try_pull()

    def try_pull(self) -> None:
        sim, pending = self.sim, self.pending
        while pending:
            rid, p = pending[0]
            need = sim.prompt[rid] + sim.output[rid]
            if self.count >= self.max_batch or self.reserved_tokens + need > self.inst.kv_capacity_tokens:
                return
            pending.popleft()
            self.reserved_tokens += need
            self.count += 1
            seconds = sim.prompt[rid] * self.s_per_token[p] if p >= 0 else 0.0
            self.link_free_s = max(sim.loop.now, self.link_free_s) + seconds
            sim.loop.at(self.link_free_s, self._arrived, rid, p)

    def _arrived(self, rid: int, p: int) -> None:
        if p >= 0:
            self.sim.prefills[p].release(self.sim.prompt[rid])
        lanes = self.lanes
        if len(lanes) > 1:
            lanes = [min(lanes, key=lambda lane: lane.load())]
        lanes[0].join(rid)

    def finished(self, rid: int) -> None:
        self.reserved_tokens -= self.sim.prompt[rid] + self.sim.output[rid]
        self.count -= 1
        self.try_pull()


class _Lane:
    """One micro-batch of a decode instance, advanced a run of steps at a time."""

    def __init__(self, sim: _Sim, decode: _Decode) -> None:
        self.sim, self.decode = sim, decode
        self.run = DecodeRun(sim.loop, decode.inst.timer, self._boundary)
        self.joining: list[int] = []

    def load(self) -> int:
        return self.run.batch.size + len(self.joining)

    def join(self, rid: int) -> None:
        self.joining.append(rid)
        if self.run.is_stepping:
            self.run.cut_short()  # the newcomer joins at the next iteration boundary
        else:
            self._boundary([])

    def _boundary(self, finished: list[tuple[int, float]]) -> None:
        sim, batch = self.sim, self.run.batch
        now = sim.loop.now
        for rid, first_s in finished:
            sim.rec.finish(rid, now, first_s)
            self.decode.finished(rid)
        for rid in self.joining:
            batch.add(rid, sim.prompt[rid] + 1, sim.output[rid] - 1, sim.first_token_s[rid])
        self.joining.clear()
        if batch.size:
            self.run.start()


def simulate_disaggregated(
    trace: Trace,
    prefill: Sequence[InstanceModel],
    decode: Sequence[InstanceModel],
    *,
    transfer: TransferModel | None,
    slo: SLO | None = None,
    max_prefill_tokens: int | Sequence[int] = 512,
    max_decode_batch: int = 256,
) -> SimResult:
    """Run one trial. An empty `prefill` simulates decode alone (requests arrive
    prefilled); an empty `decode` simulates prefill alone (requests end at their first
    token). With `slo`, the trial stops once the attainment target is out of reach.
    `max_prefill_tokens`: Lm of every prefill instance, or one per instance."""
    sim = _Sim(trace, slo)
    lms = ([max_prefill_tokens] * len(prefill) if isinstance(max_prefill_tokens, int)
           else list(max_prefill_tokens))
    sim.prefills = [_Prefill(sim, i, m, lm) for i, (m, lm) in enumerate(zip(prefill, lms, strict=True))]
    pps = [m.pp for m in prefill]
    sim.decodes = [
        _Decode(sim, i, m, max_decode_batch, transfer, pps) for i, m in enumerate(decode)
    ]
    sim.is_prefill_only = not decode
    for p in range(len(sim.prefills)):
        fastest = min((d.s_per_token[p] for d in sim.decodes), default=0.0)
        sim.nearest_decodes.append([d for d in sim.decodes if d.s_per_token[p] == fastest])
    sim.loop.arrivals(trace.arrival_s.tolist(), sim.arrive)
    sim.loop.run()
    return sim.rec.result()
