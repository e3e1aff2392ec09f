"""One candidate's goodput: the simulator set up for a configuration and bisected on rate.

Everything here runs inside search worker processes, so the inputs are plain,
picklable data (`SearchContext`, `(tp, pp)` tuples) and the latency models and their
memoised iteration times are built once per process and reused by every trial.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from distserve.catalog import get_model
from distserve.latency import (
    Correction,
    SourceChoice,
    corrected,
    get_latency_model,
    kv_capacity_tokens,
    prefill_saturation_tokens,
)
from distserve.plan import LatencyStats
from distserve.search.candidates import Config
from distserve.search.goodput import REL_TOL, Goodput, find_goodput
from distserve.simulator import (
    SLO,
    InstanceModel,
    SimResult,
    SpeedDrift,
    SpeedHistory,
    StageTimer,
    Trace,
    TransferModel,
    simulate_colocated,
    simulate_disaggregated,
)

INFINITE_S = float("inf")
PHASE_REL_TOL = 0.15  # coarse bisection: for ranking candidates, refined where it matters
# Typical goodput / busy-time capacity (`_phase_capacity`), so that bisection starts
# near the answer: decode batches run fuller than the mean request suggests; colocated
# prefills stall the decodes.
DECODE_ESTIMATE_GAIN = 1.15
COLOCATED_ESTIMATE_SHARE = 0.75


@dataclass(frozen=True)
class SearchContext:
    """What every trial of one search shares."""

    model: str
    accelerator: str
    latency: SourceChoice  # one source for every candidate and baseline of this search
    profile_path: str | None
    trace: Trace  # sampled requests at 1 request per second; trials rescale arrivals
    num_requests: int  # requests per trial, at least (the trace may hold more)
    slo: SLO
    max_prefill_tokens: int | None  # Lm; None: the saturation length of each config
    max_decode_batch: int
    chunk_size: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    min_duration_s: float = 60.0  # a trial spans at least this much arrival time
    # False under low node affinity: decode stays on its prefill's node, as the router
    # of such a deployment does (`plan.is_low_affinity`)
    can_decode_across_nodes: bool = True
    correction: Correction = Correction()  # per-phase factors fitted on a running deployment
    # the router's limit of requests waiting for their first token, beyond which it
    # refuses (a running deployment's, for predictions of it); None: no limit, as the
    # search sizes a plan for its rate
    max_waiting_requests: int | None = None
    # whether that router also refuses a request whose queue ahead it predicts would
    # delay its first token past the TTFT SLO (`distserve_engine.admission`); the spec's
    # `router.admitByTtft`, for the search too: such a router turns away the requests a
    # backlog would make late, so a plan for it serves more within the SLOs
    admit_by_ttft: bool = False
    # how the instances' speed moves while they serve (fitted on a running deployment,
    # for predictions of it; or one run's speed as it moved, to replay the run); None:
    # each batch takes the profile's time
    drift: SpeedDrift | SpeedHistory | None = None

    @property
    def admit_by_ttft_s(self) -> float | None:
        """The TTFT past which the router refuses a request it predicts would reach it
        (the SLO's), or None where it does not admit by TTFT."""
        return self.slo.ttft_s if self.admit_by_ttft else None

    def trial_trace(self, rate_rps: float) -> Trace:
        """The requests of one trial at rate_rps.

        NOTE: a fast configuration would absorb a few hundred requests as one burst and
        never show that it cannot keep up, so a trial holds enough requests to span
        min_duration_s of arrivals (up to the length of the sampled trace).
        """
        wanted = max(self.num_requests, int(rate_rps * self.min_duration_s))
        return self.trace.at_rate(rate_rps, min(wanted, self.trace.num_requests))


@dataclass(frozen=True)
class Unit:
    """Instances simulated together: n_prefill x prefill config, n_decode x decode config,
    KV moving over a link of link_bytes_per_s."""

    prefill: Config
    decode: Config
    n_prefill: int
    n_decode: int
    link_bytes_per_s: float

    @property
    def num_gpus(self) -> int:
        """GPUs the unit takes."""
        return self.n_prefill * self.prefill.num_gpus + self.n_decode * self.decode.num_gpus

    def instances(self) -> Instances:
        """Its instances one by one."""
        return Instances(
            (self.prefill,) * self.n_prefill, (self.decode,) * self.n_decode, self.link_bytes_per_s
        )


@dataclass(frozen=True)
class Instances:
    """Instances simulated together, each with its own configuration (a mixed plan's two
    shapes), KV moving over one link or the link of each [prefill][decode] pair."""

    prefill: tuple[Config, ...]
    decode: tuple[Config, ...]
    link_bytes_per_s: float | tuple[tuple[float, ...], ...]

    @property
    def num_gpus(self) -> int:
        """GPUs they take."""
        return sum(c.num_gpus for c in (*self.prefill, *self.decode))

    def instances(self) -> Instances:
        """Itself (a Unit spells its instances out the same way)."""
        return self


def instance_model(ctx: SearchContext, serving_mode: str, config: Config) -> InstanceModel:
    """The memoised timer and KV capacity of one instance configuration."""
    return _instance_model(
        ctx.model, ctx.accelerator, ctx.latency.source, ctx.profile_path, serving_mode, config,
        ctx.correction,
    )


# NOTE: keyed on plain fields, not on the context: a context arrives unpickled afresh
# with every task, and its trace is not hashable.
@functools.lru_cache(maxsize=512)
def _instance_model(
    model, accelerator, source, profile_path, serving_mode, config, correction=None
) -> InstanceModel:
    tp, pp = config
    latency = corrected(get_latency_model(
        model, accelerator, tp, pp, serving_mode=serving_mode, source=source, profile_path=profile_path
    ), correction)
    capacity = kv_capacity_tokens(model, accelerator, tp, pp, profile_path=profile_path)
    return InstanceModel(StageTimer(latency, pp), capacity)


def prefill_tokens(ctx: SearchContext, config: Config) -> int:
    """Lm for a prefill instance of this configuration."""
    if ctx.max_prefill_tokens:
        return ctx.max_prefill_tokens
    return _saturation_tokens(
        ctx.model, ctx.accelerator, ctx.latency.source, ctx.profile_path, config
    )


@functools.lru_cache(maxsize=512)
def _saturation_tokens(model, accelerator, source, profile_path, config) -> int:
    timer = _instance_model(model, accelerator, source, profile_path, "disaggregated", config).timer
    return prefill_saturation_tokens(timer.latency)


def run_unit(
    ctx: SearchContext, unit: Unit | Instances, rate_rps: float, slo: SLO | None
) -> SimResult:
    """One trial of a disaggregated unit (an empty side simulates the other phase alone)."""
    return simulate_unit(ctx, unit, ctx.trial_trace(rate_rps), slo)


def simulate_unit(
    ctx: SearchContext, unit: Unit | Instances, trace: Trace, slo: SLO | None = None
) -> SimResult:
    """The unit's instances serving these requests (their lengths and arrival times)."""
    every = unit.instances()
    prefill = [instance_model(ctx, "disaggregated", c) for c in every.prefill]
    decode = [instance_model(ctx, "disaggregated", c) for c in every.decode]
    kv_bytes = get_model(ctx.model).kv_bytes_per_token
    return simulate_disaggregated(
        trace, prefill, decode,
        transfer=TransferModel(kv_bytes, every.link_bytes_per_s), slo=slo,
        max_prefill_tokens=[prefill_tokens(ctx, c) for c in every.prefill],
        max_decode_batch=ctx.max_decode_batch,
        can_decode_across_nodes=ctx.can_decode_across_nodes,
        max_waiting=ctx.max_waiting_requests, admit_by_ttft_s=ctx.admit_by_ttft_s,
        drift=ctx.drift, busy_slowdown=ctx.correction.busy_slowdown,
    )


def run_baseline(
    ctx: SearchContext, name: str, config: Config, instances: int, rate_rps: float, slo: SLO | None
) -> SimResult:
    """One trial of `instances` colocated instances: "colocated" or "chunked_prefill"."""
    return simulate_baseline(ctx, name, config, instances, ctx.trial_trace(rate_rps), slo)


def simulate_baseline(
    ctx: SearchContext, name: str, config: Config, instances: int, trace: Trace,
    slo: SLO | None = None, max_batch_tokens: int | None = None,
) -> SimResult:
    """`instances` colocated instances serving these requests; max_batch_tokens: a
    prefill iteration's token budget (default: 2048, or Lm where larger)."""
    model = instance_model(ctx, "colocated", config)
    return simulate_colocated(
        trace, [model] * instances, slo=slo,
        chunk_size=ctx.chunk_size if name == "chunked_prefill" else None,
        max_batch_tokens=max_batch_tokens or max(2048, prefill_tokens(ctx, config)),
        max_batch=ctx.max_decode_batch, max_waiting=ctx.max_waiting_requests,
        admit_by_ttft_s=ctx.admit_by_ttft_s, drift=ctx.drift,
        busy_slowdown=ctx.correction.busy_slowdown,
    )


def _phase_capacity_rps(ctx: SearchContext, config: Config, serving_mode: str) -> tuple[float, float]:
    """(prefill, decode) requests per second one instance sustains when busy all the
    time: where bisection starts (a rough estimate, not a bound)."""
    return _phase_capacity(
        ctx.model, ctx.accelerator, ctx.latency.source, ctx.profile_path, serving_mode, config,
        ctx.max_prefill_tokens, ctx.max_decode_batch,
        float(np.mean(ctx.trace.prompt_tokens)), float(np.mean(ctx.trace.output_tokens)),
        ctx.correction,
    )


@functools.lru_cache(maxsize=1024)
def _phase_capacity(
    model_name, accelerator, source, profile_path, serving_mode, config, max_prefill_tokens,
    max_decode_batch, prompt, output, correction=None,
) -> tuple[float, float]:
    model = _instance_model(
        model_name, accelerator, source, profile_path, serving_mode, config, correction
    )
    lm = max_prefill_tokens or _saturation_tokens(
        model_name, accelerator, source, profile_path, config
    )
    # a pipeline takes a new batch every stage time
    prefill_rps = lm / prompt / model.timer.prefill_batch_s((lm,))[0]
    batch = int(max(1, min(max_decode_batch, model.kv_capacity_tokens / (prompt + output))))
    lane_batch = max(1, batch // model.pp)
    alpha, slope = model.timer.decode_line(lane_batch)
    iteration_s = alpha + slope * lane_batch * (prompt + output / 2)
    decode_rps = lane_batch * model.pp / iteration_s / max(output, 1.0)
    return prefill_rps, decode_rps * DECODE_ESTIMATE_GAIN


def unit_goodput(
    ctx: SearchContext, unit: Unit | Instances, slo: SLO | None = None,
    rel_tol: float | None = None, estimate_rps: float | None = None,
) -> Goodput:
    """Goodput of a unit under slo (default: the context's), bisected to rel_tol
    (default REL_TOL) from estimate_rps (default: the instances' capacities)."""
    slo = slo or ctx.slo
    if estimate_rps is None:
        every = unit.instances()
        bounds = [
            sum(_phase_capacity_rps(ctx, c, "disaggregated")[side] for c in configs)
            for side, configs in enumerate((every.prefill, every.decode)) if configs
        ]
        estimate_rps = min(bounds)
    return find_goodput(
        lambda rate, s: run_unit(ctx, unit, rate, s), slo, estimate_rps, rel_tol or REL_TOL
    )


def attainment_at(ctx: SearchContext, unit: Unit | Instances, rate_rps: float) -> float:
    """The unit's attainment of the context's SLOs in one trial at rate_rps, stopped as
    soon as the target is out of reach (then below the target, not exact)."""
    return run_unit(ctx, unit, rate_rps, ctx.slo).attainment(ctx.slo)


def judged_at(ctx: SearchContext, unit: Unit | Instances,
              rate_rps: float) -> tuple[float, LatencyStats | None]:
    """`attainment_at`, and the trial's latency percentiles when it met the target.

    NOTE: a trial that meets the target never stops early, so its percentiles are those
    of the full trial that the plan reports at its goodput (`sizing.latency_at`): kept,
    that trial is not run again."""
    result = run_unit(ctx, unit, rate_rps, ctx.slo)
    attainment = result.attainment(ctx.slo)
    return attainment, latency_stats(result) if attainment >= ctx.slo.attainment else None


def latency_stats(result: SimResult) -> LatencyStats:
    """p50/p90/p99 TTFT and TPOT of a trial."""
    q = result.percentile_s
    return LatencyStats(
        q("ttft", 50), q("ttft", 90), q("ttft", 99), q("tpot", 50), q("tpot", 90), q("tpot", 99)
    )


def meets_target_at(ctx: SearchContext, unit: Unit | Instances, rate_rps: float) -> bool:
    """Whether the unit meets the context's SLO target at rate_rps: one trial, stopped
    as soon as the target is out of reach."""
    return attainment_at(ctx, unit, rate_rps) >= ctx.slo.attainment


def phase_estimate(ctx: SearchContext, phase: str, config: Config) -> float:
    """The requests per second one instance of the phase is estimated to serve alone."""
    return _phase_capacity_rps(ctx, config, "disaggregated")[0 if phase == "prefill" else 1]


def phase_goodput(ctx: SearchContext, phase: str, config: Config, scale: float = 1.0) -> Goodput:
    """Goodput of one prefill instance judged on TTFT alone, or one decode instance on
    TPOT alone (Algorithm 1's simu_prefill and simu_decode), bisected from the phase's
    estimate times scale."""
    slo = ctx.slo
    if phase == "prefill":
        unit = Unit(config, config, 1, 0, ctx.intra_node_bytes_per_s)
        phase_slo = SLO(slo.ttft_s, INFINITE_S, slo.attainment, slo.rule)
    else:
        unit = Unit(config, config, 0, 1, ctx.intra_node_bytes_per_s)
        phase_slo = SLO(INFINITE_S, slo.tpot_s, slo.attainment, slo.rule)
    # NOTE: phase goodputs only rank and size candidates, whose joint goodput is then
    # bisected to REL_TOL, so a coarser bracket is enough here.
    return unit_goodput(ctx, unit, phase_slo, PHASE_REL_TOL,
                        phase_estimate(ctx, phase, config) * scale)


def baseline_goodput(
    ctx: SearchContext, name: str, config: Config, rel_tol: float = REL_TOL,
    known: Goodput | None = None,
) -> Goodput:
    """Goodput of one colocated instance under the baseline's iteration policy
    (known: a coarser result to refine)."""
    prefill_rps, decode_rps = _phase_capacity_rps(ctx, config, "colocated")
    # the phases share the GPUs
    estimate = COLOCATED_ESTIMATE_SHARE / (1.0 / prefill_rps + 1.0 / decode_rps)
    return find_goodput(
        lambda rate, s: run_baseline(ctx, name, config, 1, rate, s), ctx.slo, estimate,
        rel_tol, known,
    )
