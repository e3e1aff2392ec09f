"""From a DistServeDeployment spec to a Plan: the entry point of the placement search.

It resolves what the spec leaves to the live cluster (node names, GPUs per node),
samples the workload once, runs Algorithm 1 or 2 (or simulates a fixed placement),
sizes the chosen units for `workload.rateRps` within the cluster and `planner.maxGpus`
(or for the most the cluster serves, asked for its capacity: `sizing`), pins every
segment to GPUs, and adds the best colocated and chunked-prefill baselines on the same
number of GPUs.
A replan searches the same way on what was observed (`SearchOverrides`: the observed
workload and rate, a latency correction), without rewriting the spec.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass

from distserve.catalog import get_accelerator, get_model
from distserve.catalog.accelerators import GBIT_BYTES
from distserve.latency import Correction, SourceChoice, choose_source
from distserve.plan import PhaseConfig, Plan, is_low_affinity
from distserve.search.algorithms import UnitChoice
from distserve.search.baselines import baseline_configs, best_baselines, coarse_pass
from distserve.search.candidates import ClusterShape, Config, instance_configs
from distserve.search.cpus import usable_cpus
from distserve.search.packing import Room
from distserve.search.placement import ClusterTooSmall, pair_links, place_fixed
from distserve.search.replicas import whole_unit
from distserve.search.sizing import (
    NoFeasiblePlan,
    Sizing,
    assemble_plan,
    check_goodput,
    high_affinity_plan,
    low_affinity_plan,
)
from distserve.search.trials import SearchContext, unit_goodput
from distserve.simulator import SLO, Trace
from distserve.spec import DistServeDeploymentSpec, SpecError
from distserve.workload import Workload, make_workload

SAMPLED_REQUESTS = 4000  # requests sampled once; a trial takes as many as it needs


@dataclass(frozen=True)
class SearchOverrides:
    """What a replan changes about the spec's search, the spec itself left as it is."""

    workload: Workload | None = None  # the observed workload instead of spec.workload's
    rate_rps: float | None = None  # the rate replicas are sized for instead of rateRps
    correction: Correction | None = None  # per-phase latency factors fitted on the deployment
    with_baselines: bool = True  # also search the colocated and chunked-prefill baselines


def _silent(_: str) -> None:
    pass


def plan_deployment(
    spec: DistServeDeploymentSpec, *, node_names: list[str] | None = None,
    gpus_per_node: int | None = None, progress: Callable[[str], None] | None = None,
    overrides: SearchOverrides | None = None, is_capacity: bool = False,
) -> Plan:
    """The best placement for the spec (as overrides change it), or with is_capacity the
    plan that serves the most the cluster holds; NoFeasiblePlan when there is none."""
    progress = progress or _silent
    overrides = overrides or SearchOverrides()
    started = time.perf_counter()
    names, per_node = resolve_cluster(spec, node_names, gpus_per_node)
    ctx = build_context(spec, overrides)
    rate = overrides.rate_rps or spec.workload.rate_rps
    model = get_model(ctx.model)
    cluster = ClusterShape(
        len(names), per_node, spec.planner.max_nodes_per_instance or len(names)
    )
    min_kv = _min_kv_tokens(ctx.trace)
    progress(f"latency source: {ctx.latency.describe()}")
    configs = instance_configs(
        model, ctx.accelerator, cluster, min_kv[1], ctx.latency, ctx.profile_path
    )
    max_gpus = min(spec.planner.max_gpus or cluster.num_gpus, cluster.num_gpus)
    sizing = Sizing(None if is_capacity else rate, is_capacity, Room(names, per_node, max_gpus))
    algorithm = plan_algorithm(spec)
    with_baselines = overrides.with_baselines and ctx.latency.can_time("colocated")
    with _pool(spec.planner.workers) as pmap:
        # NOTE: the baselines' configurations are known before the search, so their
        # first pass runs on workers the search leaves idle
        base_configs = baseline_configs(configs, per_node) if with_baselines else []
        coarse = pmap.later(*coarse_pass(ctx, base_configs)) if base_configs else None
        if spec.placement is not None:
            plan = _fixed(pmap, ctx, spec, names, per_node, rate)
        else:
            plan = _searched(
                pmap, ctx, model, cluster, min_kv, configs, progress, sizing, algorithm
            )
        base = {}
        if with_baselines:
            base = best_baselines(
                pmap, ctx, base_configs or [Config(plan.prefill.tp, plan.prefill.pp)],
                plan.num_gpus, progress, pmap.collect(coarse) if coarse else None,
            )
        elif overrides.with_baselines:
            progress(f"baselines skipped: {ctx.latency.profile_path} has no colocated engine")
    return _replace(plan, baselines=base, search_seconds=time.perf_counter() - started)


def plan_algorithm(spec: DistServeDeploymentSpec) -> str:
    """The algorithm the spec's plan comes from: "fixed" for a placement given, else the
    planner's (auto follows cluster.nodeAffinity)."""
    if spec.placement is not None:
        return "fixed"
    algorithm = spec.planner.algorithm
    if algorithm == "auto":
        algorithm = "low-affinity" if spec.cluster.node_affinity == "low" else "high-affinity"
    return algorithm


def resolve_cluster(
    spec: DistServeDeploymentSpec, node_names: list[str] | None, gpus_per_node: int | None
) -> tuple[list[str], int]:
    """Node names and GPUs per node: the spec's where set, else the live cluster's."""
    names = spec.cluster.node_names or node_names
    count = spec.cluster.nodes or (len(names) if names else None)
    if count is None:
        raise SpecError("spec.cluster.nodes: unset, and no live cluster to count nodes in")
    if names is None:
        names = [f"node-{i}" for i in range(count)]
    if len(names) < count:
        raise SpecError(f"spec.cluster.nodes: {count} nodes asked, {len(names)} named")
    per_node = spec.cluster.gpus_per_node or gpus_per_node
    if per_node is None:
        raise SpecError("spec.cluster.gpusPerNode: unset, and no live cluster to read it from")
    return list(names[:count]), per_node


def build_context(
    spec: DistServeDeploymentSpec, overrides: SearchOverrides | None = None
) -> SearchContext:
    """The shared inputs of every trial: model, GPU, latency source, sampled requests, SLO,
    and whether the router refuses by predicted TTFT (`spec.router.admitByTtft`): a plan
    for such a router is sized with its refusals, each counted as a miss."""
    model, accelerator = _model_and_accelerator(spec)
    overrides = overrides or SearchOverrides()
    w = spec.workload
    workload = overrides.workload or make_workload(w.dataset, w.trace_path, w.arrival, w.cv)
    trace = Trace.from_requests(workload.sample(1.0, max(SAMPLED_REQUESTS, spec.planner.num_requests), spec.planner.seed))
    inter = (
        spec.cluster.inter_node_bandwidth_gbps * GBIT_BYTES
        if spec.cluster.inter_node_bandwidth_gbps else accelerator.inter_node_link_bytes_per_s
    )
    s = spec.slo
    return SearchContext(
        model=model.name, accelerator=accelerator.name,
        latency=latency_choice(spec), profile_path=spec.planner.profile_path,
        trace=trace, num_requests=spec.planner.num_requests,
        slo=SLO(s.ttft_seconds, s.tpot_seconds, s.attainment, s.rule),
        max_prefill_tokens=spec.planner.max_prefill_tokens,
        max_decode_batch=spec.planner.max_decode_batch, chunk_size=spec.planner.chunk_size,
        intra_node_bytes_per_s=accelerator.intra_node_link_bytes_per_s,
        inter_node_bytes_per_s=inter,
        correction=overrides.correction or Correction(),
        can_decode_across_nodes=not is_low_affinity(plan_algorithm(spec), spec.cluster.node_affinity),
        admit_by_ttft=spec.router.admit_by_ttft,
    )


def _model_and_accelerator(spec: DistServeDeploymentSpec):
    """The spec's model and accelerator from the catalog; SpecError names the bad field."""
    try:
        model = get_model(spec.model.name)
    except ValueError as err:
        raise SpecError(f"spec.model.name: {err}") from None
    try:
        accelerator = get_accelerator(spec.cluster.accelerator)
    except ValueError as err:
        raise SpecError(f"spec.cluster.accelerator: {err}") from None
    return model, accelerator


def latency_choice(spec: DistServeDeploymentSpec) -> SourceChoice:
    """The latency source of the whole search (`distserve.latency.choose_source`)."""
    model, accelerator = _model_and_accelerator(spec)
    try:
        return choose_source(
            model, accelerator, spec.planner.latency_model, spec.planner.profile_path
        )
    except ValueError as err:
        raise SpecError(f"spec.planner.latencyModel: {err}") from None


def _min_kv_tokens(trace: Trace) -> tuple[int, int]:
    """(prefill, decode) KV tokens an instance must hold: the longest prompt, and the
    longest prompt plus output, of the sampled requests."""
    total = trace.prompt_tokens + trace.output_tokens
    return int(trace.prompt_tokens.max()), int(total.max())


def _searched(pmap, ctx, model, cluster, min_kv, configs, progress, sizing, algorithm) -> Plan:
    """Run the placement algorithm the spec asks for and size its units into a plan."""
    if not configs:
        raise NoFeasiblePlan(
            f"{model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) fits no placement of "
            f"up to {cluster.max_nodes_per_instance} nodes x {cluster.gpus_per_node} "
            f"{ctx.accelerator} with room for a {min_kv[1]}-token request"
        )
    if algorithm == "low-affinity":
        return low_affinity_plan(pmap, ctx, model, cluster, min_kv, sizing, progress)
    return high_affinity_plan(pmap, ctx, configs, cluster, sizing, progress)


def _fixed(pmap, ctx, spec, names, per_node, rate) -> Plan:
    """Simulate the spec's fixed placement: its goodput, attainment and latencies."""
    prefill, decode = _placement_phases(spec)
    for role, phase in (("prefill", prefill), ("decode", decode)):
        if not ctx.latency.allows(phase.tp):
            raise NoFeasiblePlan(
                f"spec.placement.{role}.tp={phase.tp}: the latency source is "
                f"{ctx.latency.describe()}; set planner.latencyModel: analytic to time it"
            )
    segments = _placed(spec, names, per_node, prefill, decode)
    links = pair_links(segments, ctx.intra_node_bytes_per_s, ctx.inter_node_bytes_per_s)
    unit = whole_unit(prefill, decode, links)
    (goodput,) = pmap(unit_goodput, [(ctx, unit)])
    choice = UnitChoice(unit, 1, goodput)
    check_goodput(choice, ctx)
    return assemble_plan("fixed", pmap, ctx, ((prefill,), (decode,)), unit, segments,
                         goodput.rate_rps, rate)


def placed_as_given(
    spec: DistServeDeploymentSpec, *, node_names: list[str] | None = None,
    gpus_per_node: int | None = None, attainment: float = 0.0,
) -> Plan:
    """The spec's fixed placement on the cluster, neither sized nor simulated (goodput 0):
    what a replanner starts from when the placement meets no rate within the SLOs
    (`attainment`: the best it reached, from the NoFeasiblePlan)."""
    if spec.placement is None:
        raise ValueError("placed_as_given: the spec has no placement")
    names, per_node = resolve_cluster(spec, node_names, gpus_per_node)
    model, accelerator = _model_and_accelerator(spec)
    prefill, decode = _placement_phases(spec)
    segments = _placed(spec, names, per_node, prefill, decode)
    return Plan(
        algorithm="fixed", model=model.name, accelerator=accelerator.name,
        prefill=prefill, decode=decode, segments=segments, goodput_rps=0.0,
        attainment=attainment, latency=None, ttft_slo_s=spec.slo.ttft_seconds,
        tpot_slo_s=spec.slo.tpot_seconds, attainment_target=spec.slo.attainment,
        rate_rps=spec.workload.rate_rps, latency_source="none: the placement meets no rate",
    )


def _placement_phases(spec: DistServeDeploymentSpec) -> tuple[PhaseConfig, PhaseConfig]:
    """The spec's fixed placement as (prefill, decode) phases."""
    p, d = spec.placement.prefill, spec.placement.decode
    return PhaseConfig(p.tp, p.pp, p.instances), PhaseConfig(d.tp, d.pp, d.instances)


def _placed(spec: DistServeDeploymentSpec, names: list[str], per_node: int,
            prefill: PhaseConfig, decode: PhaseConfig):
    """The fixed placement's segments on the cluster; NoFeasiblePlan when it does not fit."""
    try:
        return place_fixed(names, per_node, prefill, decode, spec.cluster.node_affinity == "low")
    except ClusterTooSmall as err:
        raise NoFeasiblePlan(f"the fixed placement does not fit: {err}") from None


def _replace(plan: Plan, **changes) -> Plan:
    from dataclasses import replace

    return replace(plan, **changes)


class _Later:
    """Work queued on a `_pool` for workers that would otherwise wait: one function over
    argument tuples, each started when a worker is free (`_pool.later`)."""

    def __init__(self, fn: Callable, arg_tuples: list[tuple]) -> None:
        self.fn, self.arg_tuples = fn, arg_tuples
        self.futures: list[Future | None] = [None] * len(arg_tuples)  # None: not started
        self.next = 0  # the first not started


class _pool:
    """A process pool as a map over argument tuples (inline with one worker).

    NOTE: a map waits for its slowest task, and the search's maps are often one or two
    tasks (a whole deployment's trials, the plan's latencies), so a worker waits for a
    share of the search. Work that needs nothing the search finds (the baselines' first
    pass) is queued with `later` and started on a worker only while a map leaves it
    idle; `collect` runs what never started. Results are the same as run at once.
    """

    def __init__(self, workers: int | None) -> None:
        # NOTE: the container's CPU limit, not the host's cores (see `cpus`).
        self.workers = workers or usable_cpus()
        self.executor = None
        self.queued: deque[_Later] = deque()
        self.started: set[Future] = set()  # queued work started and maybe not done

    def __enter__(self):
        if self.workers > 1:
            self.executor = ProcessPoolExecutor(self.workers)
        return self

    def __exit__(self, *exc) -> None:
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)

    def __call__(self, fn, arg_tuples: list[tuple]) -> list:
        if self.executor is None or (len(arg_tuples) == 1 and not self.queued):
            return [fn(*args) for args in arg_tuples]
        futures = [self.executor.submit(fn, *args) for args in arg_tuples]
        while pending := {f for f in futures if not f.done()}:
            self._fill(len(pending))
            wait(pending | self.started, return_when=FIRST_COMPLETED)
        return [f.result() for f in futures]

    def later(self, fn, arg_tuples: list[tuple]) -> _Later:
        """fn over arg_tuples, run while workers would idle; `collect` gives the results."""
        work = _Later(fn, arg_tuples)
        if self.executor is not None:
            self.queued.append(work)
        return work

    def collect(self, work: _Later) -> list:
        """The results of work queued with `later`; what never started runs now."""
        if work in self.queued:
            self.queued.remove(work)
        rest = list(range(work.next, len(work.arg_tuples)))
        ran = dict(zip(rest, self(work.fn, [work.arg_tuples[i] for i in rest]), strict=True)
                   ) if rest else {}
        return [ran[i] if i in ran else work.futures[i].result()
                for i in range(len(work.arg_tuples))]

    def _fill(self, busy: int) -> None:
        """Start queued work on the workers that busy tasks leave free."""
        self.started = {f for f in self.started if not f.done()}
        while self.queued and busy + len(self.started) < self.workers:
            work = self.queued[0]
            future = self.executor.submit(work.fn, *work.arg_tuples[work.next])
            work.futures[work.next] = future
            self.started.add(future)
            work.next += 1
            if work.next == len(work.arg_tuples):
                self.queued.popleft()
