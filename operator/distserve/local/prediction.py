"""The simulator's prediction for one local load run: the same requests on the same instances.

`distserve up --demo` and `distserve fidelity` measure a deployment on this machine. To
hold the simulator to what they measured, it replays exactly what they sent (every
request's prompt and output length and its arrival time) on the deployment's instances
(each prefill and decode instance with its own tp and pp, so a mixed plan is simulated
whole, as the search's sizing does; or N colocated) with the engine's limits as the
settings give them (Lm, decode batch size, and the router's limit of requests waiting for
their first token: past it a request is refused on arrival, a 429 to its client and an
error to both sides), timed by the latency profile the planner used.
NOTE: a colocated instance of the engine prefills up to Lm tokens per iteration, so the
simulated one is given that budget (the planner's baselines assume a larger one).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distserve.local.report import RunSummary
from distserve.local.settings import local_instance_name
from distserve.search.candidates import Config
from distserve.search.goodput import MAX_SHRINK, find_goodput
from distserve.search.trials import (
    Instances,
    SearchContext,
    simulate_baseline,
    simulate_unit,
)
from distserve.simulator import SLO, SimResult, Trace
from distserve.workload import Request
from distserve_engine.server.settings import Parallelism, ServeSettings

PERCENTILES = (50, 90, 99)
DRIFT_DRAWS = 8  # histories of a drifting speed one prediction takes the median of
KNEE_DROP = 0.1  # attainment points below the unloaded level that mark the knee


@dataclass(frozen=True)
class LocalShape:
    """The instances of a local deployment, as its settings name them: each role's
    instances in order, each with its tp x pp (a mixed plan's role has two shapes)."""

    role_to_parallel: dict[str, tuple[Parallelism, ...]]  # prefill and decode, or colocated

    @property
    def is_colocated(self) -> bool:
        """Colocated instances (the baseline) rather than prefill and decode ones."""
        return bool(self.role_to_parallel.get("colocated"))

    def describe(self) -> str:
        """e.g. "1 prefill + 1 decode", "2 colocated", or for a mixed plan
        "2 prefill (1 x tp2pp1 + 1 x tp1pp2) + 1 decode"."""
        parts = []
        for role, shapes in self.role_to_parallel.items():
            shape_to_count = Counter(shapes)  # in the order the instances are numbered
            groups = "" if len(shape_to_count) < 2 else " (" + " + ".join(
                f"{count} x tp{p.tp}pp{p.pp}" for p, count in shape_to_count.items()) + ")"
            parts.append(f"{len(shapes)} {role}{groups}")
        return " + ".join(parts)

    def disaggregated_instances(self, link_bytes_per_s: float) -> Instances:
        """The prefill and decode instances one by one, as the search simulates a whole
        deployment (`search.replicas`), KV moving over one link."""
        def configs(role: str) -> tuple[Config, ...]:
            return tuple(Config(p.tp, p.pp) for p in self.role_to_parallel.get(role, ()))

        return Instances(configs("prefill"), configs("decode"), link_bytes_per_s)

    @classmethod
    def from_settings(cls, settings: ServeSettings) -> LocalShape:
        """The shape of a deployment's serving settings (`distserve.local.settings`)."""
        return cls({role: tuple(settings.parallel_of(role, local_instance_name(role, i))
                                for i in range(count))
                    for role, count in settings.instances.items()})


def engine_context(ctx: SearchContext, settings: ServeSettings) -> SearchContext:
    """The planner's context with the engine's limits from the serving settings (the
    router's refusals too: beyond `max_waiting_requests` waiting for their first token,
    and by predicted TTFT where the settings admit by it)."""
    return dataclasses.replace(ctx, max_prefill_tokens=settings.max_prefill_tokens,
                               max_decode_batch=settings.max_decode_batch,
                               max_waiting_requests=settings.max_waiting_requests,
                               admit_by_ttft=settings.admit_by_ttft)


def simulate_shape(ctx: SearchContext, shape: LocalShape, trace: Trace,
                   slo: SLO | None = None) -> SimResult:
    """The shape's instances serving the trace in the simulator (slo: stop once lost);
    a ValueError for colocated instances of different shapes, which no plan makes."""
    if shape.is_colocated:
        shapes = set(shape.role_to_parallel["colocated"])
        if len(shapes) > 1:
            raise ValueError("the colocated instances differ in tp or pp; the simulated "
                             "baseline runs one shape")
        (p,) = shapes
        return simulate_baseline(ctx, "colocated", Config(p.tp, p.pp),
                                 len(shape.role_to_parallel["colocated"]), trace, slo,
                                 max_batch_tokens=ctx.max_prefill_tokens)
    every = shape.disaggregated_instances(ctx.intra_node_bytes_per_s)
    return simulate_unit(ctx, every, trace, slo)


def trace_of(requests: Sequence[Request]) -> Trace:
    """The requests as the simulator's columns (ordered by arrival)."""
    return Trace.from_requests(requests)


def requests_of(trace: Trace) -> list[Request]:
    """The trace's requests, to send (ids in arrival order)."""
    return [Request(i, float(a), int(p), int(o)) for i, (a, p, o) in
            enumerate(zip(trace.arrival_s, trace.prompt_tokens, trace.output_tokens, strict=True))]


def predicted_summary(result: SimResult, trace: Trace, rate_rps: float, ttft_slo_s: float,
                      tpot_slo_s: float, scored_from: int = 0) -> RunSummary:
    """The simulated run in the figures of a measured one (`report.summarize`): attainment
    of both SLOs over every request, TPOT percentiles over requests of 2+ tokens; only
    the requests from `scored_from` on (in arrival order) count."""
    if scored_from:
        trace = Trace(trace.arrival_s[scored_from:], trace.prompt_tokens[scored_from:],
                      trace.output_tokens[scored_from:])
        result = dataclasses.replace(result, ttft_s=result.ttft_s[scored_from:],
                                     tpot_s=result.tpot_s[scored_from:])
    ttfts = result.ttft_s[~np.isnan(result.ttft_s)]
    multi = (trace.output_tokens > 1) & ~np.isnan(result.tpot_s)
    tpots = result.tpot_s[multi]

    def pct(values: np.ndarray) -> dict[int, float]:
        return {p: float(np.percentile(values, p)) if values.size else math.nan
                for p in PERCENTILES}

    return RunSummary(
        rate_rps=rate_rps, num_requests=trace.num_requests,
        num_errors=int(np.isnan(result.ttft_s).sum()),
        attainment=result.attainment(SLO(ttft_slo_s, tpot_slo_s, 1.0, "both")),
        ttft_p_s=pct(ttfts), tpot_p_s=pct(tpots),
        num_prefill_batches=result.num_prefill_batches,
    )


def predict_run(ctx: SearchContext, shape: LocalShape, requests: Sequence[Request],
                rate_rps: float, scored_from: int = 0) -> RunSummary:
    """The simulator's figures for these requests on this shape (SLOs from ctx), over
    those from `scored_from` on (the ones before still queue ahead of them); where ctx's
    speed drifts, each figure the median over DRIFT_DRAWS histories of the drift."""
    return median_of(predict_draws(ctx, shape, requests, rate_rps, scored_from))


def predict_draws(ctx: SearchContext, shape: LocalShape, requests: Sequence[Request],
                  rate_rps: float, scored_from: int = 0) -> list[RunSummary]:
    """`predict_run`'s figures for each history of ctx's drift it draws (seeds 0 to
    DRIFT_DRAWS - 1), or the one run where the speed does not drift or follows a
    measured `SpeedHistory`."""
    trace = trace_of(requests)
    drift = ctx.drift
    contexts = ([ctx] if drift is None or drift.is_still else
                [dataclasses.replace(ctx, drift=history)
                 for history in drift.histories(DRIFT_DRAWS)])
    return [predicted_summary(simulate_shape(c, shape, trace), trace, rate_rps, ctx.slo.ttft_s,
                              ctx.slo.tpot_s, scored_from) for c in contexts]


def median_of(draws: Sequence[RunSummary]) -> RunSummary:
    """Each figure's median over the draws of one prediction (the draw itself for one)."""
    if len(draws) == 1:
        return draws[0]

    def median(values) -> float:
        return float(np.median(list(values)))

    first = draws[0]
    batches = [d.num_prefill_batches for d in draws if d.num_prefill_batches is not None]
    return RunSummary(
        rate_rps=first.rate_rps, num_requests=first.num_requests,
        num_errors=round(median(d.num_errors for d in draws)),
        attainment=median(d.attainment for d in draws),
        ttft_p_s={p: median(d.ttft_p_s[p] for d in draws) for p in first.ttft_p_s},
        tpot_p_s={p: median(d.tpot_p_s[p] for d in draws) for p in first.tpot_p_s},
        num_prefill_batches=round(median(batches)) if batches else None,
    )


def predicted_knee_rps(ctx: SearchContext, shape: LocalShape, trace_at_1rps: Trace,
                       estimate_rps: float) -> tuple[float, float]:
    """(knee in req/s, the attainment that marks it): the highest rate at which the
    simulated shape's attainment on this trace (arrivals scaled to the rate) stays at the
    SLO target, or at KNEE_DROP below its unloaded level where that is lower: where the
    target is barely met (or missed) unloaded, the goodput is a near-zero rate and says
    nothing about where queueing starts to cost.
    NOTE: judged at a steady speed (ctx's drift left out): one history of a drift, drawn
    again at every rate tried, is not a function of the rate that bisection can search."""
    ctx = dataclasses.replace(ctx, drift=None)

    def goodput(target: float):
        return find_goodput(
            lambda rate, s: simulate_shape(ctx, shape, trace_at_1rps.at_rate(rate), s),
            dataclasses.replace(ctx.slo, attainment=target), estimate_rps)

    unloaded = simulate_shape(ctx, shape, trace_at_1rps.at_rate(estimate_rps / MAX_SHRINK))
    target = min(ctx.slo.attainment, unloaded.attainment(ctx.slo) - KNEE_DROP)
    if target <= 0:
        return 0.0, target
    return goodput(target).rate_rps, target
