"""One policy, two planes: the engine's instance schedulers and the simulator, driven with
the same small traces, make the same decisions.

Each case is a trace (prompt and true output lengths; which requests arrive first and
which during the first iteration) and an instance (KV capacity, largest batch, Lm). The
engine runs its real decode, colocated and prefill instances on a fake runner (KV blocks
of one token, so blocks and the simulator's tokens are the same unit; a request stops at
its true length, as at EOS) with no thread: the test steps them. Clients set max_tokens
exactly or loosely (4x the true length); the simulator sees only the true lengths, and
the decisions must not differ. Compared: the requests of each prefill batch (recomputed
ones included; their number as `SimResult.num_prefill_batches` counts them too), the
members of each run of decode steps in admission order, and the requests preempted, in
order. Dispatch: the router's `pick_decode` and the simulator's
`hand_to_decode` choose the same decode instance for the same loads, and the router's
`pick_prefill` over colocated instances the same one the colocated simulator queues a
new request on.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from sim_factories import FakeLatency

pytest.importorskip("torch")  # the engine's instances import the sampler

from distserve.simulator import (  # noqa: E402
    InstanceModel,
    StageTimer,
    Trace,
    TransferModel,
    simulate_colocated,
    simulate_disaggregated,
)
from distserve.simulator import batch as sim_batch  # noqa: E402
from distserve.simulator import colocated as sim_colocated  # noqa: E402
from distserve.simulator import disaggregated as sim_disaggregated  # noqa: E402
from distserve_engine.block_manager import BlockManager  # noqa: E402
from distserve_engine.dispatch import Slot, pick_decode, pick_prefill  # noqa: E402
from distserve_engine.instance.colocated import ColocatedInstance  # noqa: E402
from distserve_engine.instance.decode import DecodeInstance  # noqa: E402
from distserve_engine.instance.prefill import PrefillInstance  # noqa: E402
from distserve_engine.request import (  # noqa: E402
    KVHandle,
    PrefillOutput,
    ServeRequest,
    TransferStats,
)
from distserve_engine.sampling import SamplingParams  # noqa: E402
from distserve_engine.sequence import DetokenizerState  # noqa: E402

LATER_S = 1e-9  # "during the first iteration": every iteration takes longer than this


@dataclass(frozen=True)
class Case:
    """A trace and the instance it runs on."""

    name: str
    prompts: tuple[int, ...]
    outputs: tuple[int, ...]  # true lengths, the first token included
    num_first: int  # requests 0..num_first-1 arrive before anything runs, the rest later
    kv_tokens: int
    max_batch: int = 16
    max_prefill_tokens: int = 64
    num_preemptions: int = 0  # what both planes must count


DECODE_CASES = [
    Case("all fit", (5, 6, 7), (4, 3, 5), 1, kv_tokens=200),
    Case("batch size bounds admission", (5, 6, 7, 8), (6, 3, 5, 2), 2, kv_tokens=200,
         max_batch=2),
    Case("KV bounds admission", (20, 20, 20), (3, 4, 2), 1, kv_tokens=45),
    Case("growth preempts the newest", (10, 11, 12), (14, 12, 10), 3, kv_tokens=40,
         num_preemptions=2),
    Case("a preempted one is taken back before a later one", (8, 9, 10, 11), (12, 12, 6, 9),
         2, kv_tokens=42, num_preemptions=1),
]
COLOCATED_CASES = [
    Case("all fit", (5, 6, 7), (4, 3, 5), 1, kv_tokens=200),
    Case("Lm splits prefill batches", (30, 30, 30, 10), (3, 2, 4, 2), 1, kv_tokens=400,
         max_prefill_tokens=64),
    Case("growth preempts the newest", (10, 11, 12), (14, 12, 10), 3, kv_tokens=40,
         num_preemptions=2),
    Case("a request preempted twice", (8, 9, 10, 11), (12, 12, 6, 9), 2, kv_tokens=42,
         num_preemptions=2),
]
PREFILL_CASES = [
    Case("Lm fills batches, a long prompt alone", (20, 30, 20, 90, 10, 10), (1,) * 6, 1,
         kv_tokens=10_000, max_prefill_tokens=64),
]


# --- the engine, stepped by hand ---------------------------------------------------


class FakeRunner:
    """The Runner seam without a model: one-token KV blocks, one token per step, and each
    request stops at its true output length whatever max_tokens says."""

    def __init__(self, num_blocks: int, rid_to_output: dict[str, int], log: list) -> None:
        self.block_manager = BlockManager(num_blocks, 1)
        self.config = SimpleNamespace(max_num_seqs=1024)
        self.kv_bytes_per_token = 1
        self.rid_to_output, self.log = rid_to_output, log

    def prefill(self, seqs) -> list[int]:
        self.log.append(("prefill", tuple(int(s.seq_id[1:]) for s in seqs)))
        return self._step(seqs)

    def decode(self, seqs) -> list[int]:
        self.log.append(("decode", tuple(int(s.seq_id[1:]) for s in seqs)))
        return self._step(seqs)

    def _step(self, seqs) -> list[int]:
        self.block_manager.reserve(seqs, [s.num_tokens for s in seqs])
        for seq in seqs:
            seq.num_cached_tokens = seq.num_tokens
            seq.output_token_ids.append(7)
        return [7] * len(seqs)

    def check_stop(self, seq) -> str:
        if len(seq.output_token_ids) >= self.rid_to_output[seq.seq_id]:
            seq.finish_reason = "stop"
        return ""

    def free(self, seq) -> None:
        self.block_manager.free(seq)

    def import_kv(self, seq, blob) -> None:
        self.block_manager.reserve([seq], [blob.num_tokens])
        seq.num_cached_tokens = blob.num_tokens


class FakeFetcher:
    """Pulls that complete at once (the simulator's transfer of 0 s)."""

    def fetch(self, handle):
        return SimpleNamespace(num_tokens=handle.num_tokens), TransferStats("inprocess", 0, 0, 0)

    def release(self, handle) -> None:
        pass

    def close(self) -> None:
        pass


class InlinePool:
    """Runs a pull at once and delivers its result before the step goes on."""

    def __init__(self, instance) -> None:
        self.instance = instance

    def submit(self, fn, *args) -> None:
        fn(*args)
        drain(self.instance)

    def shutdown(self, **_) -> None:
        pass


def drain(instance) -> None:
    """Run the commands posted to the instance (what its engine thread does first)."""
    while instance._inbox:
        instance._inbox.popleft()()


def run_engine(case: Case, instance, runner: FakeRunner, submit) -> None:
    """Submit the first requests, run one iteration, submit the rest, run until idle."""
    for rid in range(case.num_first):
        submit(rid)
    drain(instance)
    num_calls = len(runner.log)
    while len(runner.log) == num_calls and instance._has_work():
        instance.step()
        drain(instance)
    for rid in range(case.num_first, len(case.prompts)):
        submit(rid)
    drain(instance)
    for _ in range(10_000):
        if not instance._has_work():
            break
        instance.step()
        drain(instance)


def make_request(case: Case, rid: int, max_tokens_scale: int) -> ServeRequest:
    params = SamplingParams(max_tokens=max_tokens_scale * case.outputs[rid], temperature=0)
    return ServeRequest(f"r{rid}", [3] * case.prompts[rid], params)


def engine_setup(case: Case):
    log: list = []
    rid_to_output = {f"r{i}": n for i, n in enumerate(case.outputs)}
    return log, FakeRunner(case.kv_tokens, rid_to_output, log)


def record_preemptions(instance, log: list) -> None:
    preempt = instance.admission.preempt

    def recorded(request_id: str) -> None:
        log.append(("preempt", int(request_id[1:])))
        preempt(request_id)

    instance.admission.preempt = recorded


def engine_decode(case: Case, max_tokens_scale: int) -> tuple[list, int]:
    log, runner = engine_setup(case)
    decode = DecodeInstance("d0", runner, FakeFetcher(), case.max_batch)
    decode._pool.shutdown()
    decode._pool = InlinePool(decode)
    record_preemptions(decode, log)

    def submit(rid: int) -> None:
        handle = KVHandle(f"r{rid}", "p0", "", num_tokens=case.prompts[rid])
        prefill = PrefillOutput(f"r{rid}", 7, "", None, handle, DetokenizerState(), 0, 0, 0)
        decode.submit(make_request(case, rid, max_tokens_scale), prefill, lambda _: None)

    run_engine(case, decode, runner, submit)
    return log, decode.load().num_preemptions


def engine_colocated(case: Case, max_tokens_scale: int) -> tuple[list, int]:
    log, runner = engine_setup(case)
    colocated = ColocatedInstance("c0", runner, case.max_prefill_tokens, case.max_batch)
    record_preemptions(colocated, log)
    run_engine(case, colocated, runner,
               lambda rid: colocated.submit(make_request(case, rid, max_tokens_scale),
                                            lambda _: None))
    return log, colocated.load().num_preemptions


def engine_prefill(case: Case) -> list:
    log, runner = engine_setup(case)
    prefill = PrefillInstance("p0", runner, case.max_prefill_tokens)
    run_engine(case, prefill, runner,
               lambda rid: prefill.submit(make_request(case, rid, 1), lambda _: None))
    return log


# --- the simulator, its decisions recorded -----------------------------------------


@pytest.fixture
def sim_log(monkeypatch) -> list:
    """The simulator's prefill batches, decode runs and preemptions, as they happen."""
    log: list = []

    def wrap(cls, name, record):
        original = getattr(cls, name)

        def recorded(self, *args):
            record(self, *args)
            return original(self, *args)

        monkeypatch.setattr(cls, name, recorded)

    def on_advance(batch, num_steps, _time_s):
        if num_steps:
            log.append(("decode", tuple(batch._members), num_steps))

    def on_preempt(batch):
        log.append(("preempt", next(reversed(batch._members))))

    def on_prefill(_self, rids):
        log.append(("prefill", tuple(rids)))

    wrap(sim_batch.DecodeBatch, "advance", on_advance)
    wrap(sim_batch.DecodeBatch, "preempt_newest", on_preempt)
    wrap(sim_disaggregated._Lane, "_recomputed", on_prefill)
    wrap(sim_disaggregated._Prefill, "_done", on_prefill)
    wrap(sim_colocated._Lane, "_first_tokens", on_prefill)
    return log


def make_trace(case: Case) -> Trace:
    import numpy as np

    arrival_s = [0.0 if i < case.num_first else LATER_S for i in range(len(case.prompts))]
    return Trace(np.array(arrival_s), np.array(case.prompts), np.array(case.outputs))


def make_model(case: Case) -> InstanceModel:
    return InstanceModel(StageTimer(FakeLatency(), 1), case.kv_tokens)


# --- comparing ---------------------------------------------------------------------


def decisions(log: list) -> dict[str, list]:
    """The log split by kind, consecutive decode steps of the same members merged."""
    runs: list[list] = []
    for entry in log:
        if entry[0] != "decode":
            continue
        steps = entry[2] if len(entry) > 2 else 1
        if runs and runs[-1][0] == entry[1]:
            runs[-1][1] += steps
        else:
            runs.append([entry[1], steps])
    return {
        "prefill": [e[1] for e in log if e[0] == "prefill"],
        "decode": [tuple(run) for run in runs],
        "preempt": [e[1] for e in log if e[0] == "preempt"],
    }


@pytest.mark.parametrize("max_tokens_scale", [1, 4])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.name)
def test_decode_instance_and_simulator_decide_alike(case, max_tokens_scale, sim_log):
    engine_log, engine_preemptions = engine_decode(case, max_tokens_scale)
    result = simulate_disaggregated(make_trace(case), [], [make_model(case)], transfer=None,
                                    max_decode_batch=case.max_batch)
    assert decisions(engine_log) == decisions(sim_log)
    assert engine_preemptions == result.num_preemptions == case.num_preemptions
    # the count `distserve fidelity` sets beside the instances' logged prefill iterations
    assert result.num_prefill_batches == len(decisions(engine_log)["prefill"])


@pytest.mark.parametrize("max_tokens_scale", [1, 4])
@pytest.mark.parametrize("case", COLOCATED_CASES, ids=lambda c: c.name)
def test_colocated_instance_and_simulator_decide_alike(case, max_tokens_scale, sim_log):
    engine_log, engine_preemptions = engine_colocated(case, max_tokens_scale)
    result = simulate_colocated(make_trace(case), [make_model(case)],
                                max_batch_tokens=case.max_prefill_tokens,
                                max_batch=case.max_batch)
    assert decisions(engine_log) == decisions(sim_log)
    assert engine_preemptions == result.num_preemptions == case.num_preemptions
    # the count `distserve fidelity` sets beside the instances' logged prefill iterations
    assert result.num_prefill_batches == len(decisions(engine_log)["prefill"])


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: c.name)
def test_prefill_instance_and_simulator_batch_alike(case, sim_log):
    engine_log = engine_prefill(case)
    result = simulate_disaggregated(make_trace(case), [make_model(case)], [], transfer=None,
                                    max_prefill_tokens=case.max_prefill_tokens)
    assert decisions(engine_log)["prefill"] == decisions(sim_log)["prefill"]
    assert result.num_prefill_batches == len(decisions(engine_log)["prefill"])


# --- dispatch ----------------------------------------------------------------------

# (decode instances as (node, requests sent and not finished, KV usage), max batch,
#  the instance both must pick); the prefill instance runs on node "a" and decode may
#  cross nodes.
DISPATCH_CASES = [
    ("the local one while it has room", [("a", 3, 0.5), ("b", 0, 0.0)], 8, 0),
    ("the least loaded local one", [("a", 3, 0.5), ("a", 2, 0.6), ("b", 0, 0.0)], 8, 1),
    ("fewer requests, then less KV", [("a", 2, 0.6), ("a", 2, 0.3)], 8, 1),
    ("another node when the local one's KV is full", [("a", 1, 0.95), ("b", 4, 0.5)], 8, 1),
    ("another node when the local batch is full", [("a", 8, 0.2), ("b", 5, 0.5)], 8, 1),
    ("the least loaded when all are full", [("a", 8, 0.95), ("b", 9, 0.95)], 8, 0),
]
# The same, where decode may not cross nodes (low node affinity).
KEPT_ON_NODE_CASES = [
    ("the local one while it has room", [("a", 3, 0.5), ("b", 0, 0.0)], 8, 0),
    ("the least loaded local one with room", [("a", 1, 0.95), ("a", 3, 0.5), ("b", 0, 0.0)], 8, 1),
    ("the local one when its KV is full", [("a", 1, 0.95), ("b", 4, 0.5)], 8, 0),
    ("the local one when its batch is full", [("a", 8, 0.2), ("b", 5, 0.5)], 8, 0),
    ("the least loaded local one when all local are full",
     [("b", 0, 0.0), ("a", 9, 0.95), ("a", 8, 0.95)], 8, 2),
    ("another node's when none is local", [("b", 4, 0.95), ("c", 5, 0.5)], 8, 1),
]


def sim_pick(decodes: list[tuple[str, int, float]], max_batch: int, can_cross: bool) -> int:
    """The decode instance the simulator hands a request from the node-"a" prefill to."""
    trace = make_trace(Case("one", (10,), (2,), 1, kv_tokens=1000))
    sim = sim_disaggregated._Sim(trace, None)
    sim.max_decode_batch, sim.can_decode_across_nodes = max_batch, can_cross
    fast, slow = 1e11, 1e8
    links = [[fast if node == "a" else slow for node, _, _ in decodes]]
    transfer = TransferModel(1.0, links)
    capacity = 1000
    for i, (_, num_outstanding, kv_usage) in enumerate(decodes):
        model = InstanceModel(StageTimer(FakeLatency(), 1), capacity)
        decode = sim_disaggregated._Decode(sim, i, model, max_batch, transfer, [1])
        decode.count, decode.promised_tokens = num_outstanding, int(kv_usage * capacity)
        sim.decodes.append(decode)
    sim.find_nearest_decodes(1)
    offered = []
    for decode in sim.decodes:
        decode.offer = lambda rid, p, idx=decode.idx: offered.append(idx)
    sim.hand_to_decode(0, 0)
    return offered[0]


def engine_pick(decodes: list[tuple[str, int, float]], max_batch: int, can_cross: bool) -> int:
    slots = [Slot(SimpleNamespace(name=f"d{i}", node=node), num_outstanding=n, kv_usage=kv)
             for i, (node, n, kv) in enumerate(decodes)]
    return slots.index(pick_decode(slots, "a", max_batch, can_cross))


@pytest.mark.parametrize(
    "name, decodes, max_batch, expected, can_cross",
    [(*c, True) for c in DISPATCH_CASES] + [(*c, False) for c in KEPT_ON_NODE_CASES],
    ids=[c[0] for c in DISPATCH_CASES] + [f"kept on node: {c[0]}" for c in KEPT_ON_NODE_CASES])
def test_router_and_simulator_dispatch_alike(name, decodes, max_batch, expected, can_cross):
    assert (engine_pick(decodes, max_batch, can_cross) == sim_pick(decodes, max_batch, can_cross)
            == expected)


# (colocated instances as (prompt tokens in flight, requests in flight), the one both
#  must pick): requests in flight are those sent and not finished, decoding ones too.
COLOCATED_DISPATCH_CASES = [
    ("an idle instance over one that decodes a request", [(300, 1), (0, 0)], 1),
    ("fewer prompt tokens in flight", [(500, 1), (200, 2)], 1),
    ("ties in tokens go to fewer requests", [(300, 2), (300, 1)], 1),
    ("ties in both go to the first", [(100, 1), (100, 1)], 0),
]


def sim_colocated_pick(instances: list[tuple[int, int]]) -> int:
    """The colocated instance the simulator queues a newly arrived request on."""
    trace = make_trace(Case("one", (10,), (2,), 1, kv_tokens=1000))
    sim = sim_colocated._Sim(trace, None, max_batch_tokens=512)
    queued = []
    for i, (tokens, count) in enumerate(instances):
        instance = sim_colocated._Instance(sim, i, make_model(Case("one", (10,), (2,), 1, 1000)), 8,
                                            None)
        instance.num_outstanding_tokens, instance.num_outstanding = tokens, count
        for lane in instance.lanes:
            lane.enqueue = lambda rid, idx=i: queued.append(idx)
        sim.instances.append(instance)
    sim.arrive(0)
    return queued[0]


@pytest.mark.parametrize("name, instances, expected", COLOCATED_DISPATCH_CASES,
                         ids=[c[0] for c in COLOCATED_DISPATCH_CASES])
def test_router_and_simulator_pick_a_colocated_instance_alike(name, instances, expected):
    slots = [Slot(SimpleNamespace(name=f"c{i}", node=None), num_outstanding=n,
                  num_outstanding_tokens=tokens) for i, (tokens, n) in enumerate(instances)]
    assert slots.index(pick_prefill(slots, "colocated")) == sim_colocated_pick(instances) == expected


def test_the_simulator_counts_a_colocated_request_in_flight_until_its_last_token():
    trace = make_trace(Case("two", (10, 20), (3, 2), 2, kv_tokens=1000))
    sim = sim_colocated._Sim(trace, None, max_batch_tokens=512)
    model = make_model(Case("two", (10, 20), (3, 2), 2, 1000))
    sim.instances = [sim_colocated._Instance(sim, i, model, 8, None) for i in range(2)]
    sim.arrive(0)
    sim.arrive(1)  # the first is in flight on instance 0: the second goes to instance 1
    assert [(i.num_outstanding_tokens, i.num_outstanding) for i in sim.instances] == [(10, 1), (20, 1)]
    sim.loop.run()
    assert [(i.num_outstanding_tokens, i.num_outstanding) for i in sim.instances] == [(0, 0), (0, 0)]


def test_simulator_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, distserve.simulator; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
