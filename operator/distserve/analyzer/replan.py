"""The search and the simulator run on what the analyzer observed, not on the spec's dataset.

A replan asks these questions of one window, all answered by the same simulator that
made the plan: how would the current plan do on this traffic (`predict`) and on the
window as it came (`replay`: its arrivals per sub-window), how far off is the latency
model, per phase (`fit_correction`, on the replay), what would the search choose
(`search`) or what would more or fewer copies of the current shape do (`scale`), and
how would what serves while a reshuffle runs do (`move_attainment`).
The observed workload is the window's fitted length distributions resampled, paired as
the joint histogram of the window pairs them (each request's prompt class and output
bucket drawn from its counts, then its prompt and output from the fits within those
bounds; without the joint histogram, drawn independently), with gamma arrivals at the
window's burstiness. Pairs that would overflow the context are re-paired.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from distserve.analyzer.observation import JointLengths, LengthFit, Observation
from distserve.analyzer.scaling import (
    copies_in_place,
    copy_unit,
    dark_phases,
    move_pieces,
    place_copies,
    placed_beside,
    plan_instances,
    reshuffle_loadings,
    reshuffle_steps,
)
from distserve.catalog import get_model
from distserve.k8s.reshuffling import ReshuffleError
from distserve.latency import Correction
from distserve.plan import Plan, SegmentPlacement
from distserve.search import NoFeasiblePlan, SearchOverrides, build_context, plan_deployment
from distserve.search.candidates import Config
from distserve.search.placement import ClusterTooSmall, pair_links
from distserve.search.replicas import whole_unit
from distserve.search.trials import (
    Instances,
    SearchContext,
    Unit,
    run_unit,
    simulate_unit,
    unit_goodput,
)
from distserve.simulator import Trace
from distserve.spec import DistServeDeploymentSpec
from distserve.workload import LengthSample, Workload

NUM_SAMPLES = 4000  # lengths resampled from a window's fits
PAIRING_ROUNDS = 8  # rounds that re-pair overflowing prompt-output pairs inside the context
FIT_LOW, FIT_HIGH = 0.5, 2.0  # the bracket a per-phase factor is bisected in
NEAR_LOW, NEAR_HIGH = 0.8, 1.25  # the bracket tried first (`_fit_factor`)
FIT_STEPS = 6  # bisection steps on log(factor): the bracket narrows to ~2%
RATE_STEP_DOWN = 1.15  # a rate the cluster cannot hold is retried this much lower
MAX_STEPS_DOWN = 4
MAX_GROWTHS = 4  # times copies grow (by GROWTH_FACTOR) while the scaled plan misses
GROWTH_FACTOR = 1.25
# NOTE: the search's trials span a minute of arrivals, enough to rank candidates; a
# decision holds a plan against minutes of traffic, where a small shortfall of capacity
# has time to grow a queue, so its predictions span as long as an interval does.
PREDICTION_DURATION_S = 300.0


@dataclass(frozen=True)
class Prediction:
    """A plan simulated on the observed workload at one rate."""

    rate_rps: float
    attainment: float
    ttft_p90_s: float
    tpot_p90_s: float


def observed_workload(
    observation: Observation, max_context_tokens: int, num_samples: int = NUM_SAMPLES,
    seed: int = 0,
) -> Workload:
    """The window's lengths resampled from its fits, with its burstiness as gamma arrivals."""
    if observation.prompt is None or observation.output is None:
        raise ValueError("the observation has no length distributions to resample")
    rng = np.random.default_rng(seed)
    joint = observation.joint
    if joint is not None and joint.total > 0:
        prompts, outputs, rows = _joint_sample(
            observation.prompt, observation.output, joint, num_samples, rng,
            max_context_tokens - 1)
        # NOTE: re-paired within each prompt class, so that the outputs stay with the
        # prompts the joint histogram gave them to
        for row in np.unique(rows):
            mine = rows == row
            outputs[mine] = _paired_inside(prompts[mine], outputs[mine], max_context_tokens, rng)
    else:
        prompts = observation.prompt.sample(num_samples, rng, max_context_tokens - 1)
        outputs = observation.output.sample(num_samples, rng, max_context_tokens - 1)
        outputs = _paired_inside(prompts, outputs, max_context_tokens, rng)
    cv = observation.arrival_cv or 1.0
    arrival = "poisson" if abs(cv - 1.0) < 0.05 else "gamma"
    return Workload(LengthSample("observed", prompts, outputs), arrival, cv)


def _joint_sample(
    prompt: LengthFit, output: LengthFit, joint: JointLengths, num: int,
    rng: np.random.Generator, max_tokens: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`num` (prompt, output) pairs and their prompt classes: a cell of the joint histogram
    drawn by its count, then each length from its fit within the cell's bounds (the fits
    keep the fine shape the coarse cells lose)."""
    counts = np.asarray(joint.counts, dtype=float)
    cells = rng.choice(counts.size, num, p=(counts / counts.sum()).ravel())
    rows, columns = np.unravel_index(cells, counts.shape)
    return (_within(prompt, joint.prompt_upper_tokens, rows, rng, max_tokens),
            _within(output, joint.output_upper_tokens, columns, rng, max_tokens), rows)


def _within(fit: LengthFit, upper: tuple[float, ...], classes: np.ndarray,
            rng: np.random.Generator, max_tokens: int) -> np.ndarray:
    """One length per entry of `classes` from the fit, within that class's bounds
    (lower, upper] (inverse CDF between the bounds; evenly where the fit has no mass)."""
    bounds = np.minimum(np.concatenate([[0.0], np.asarray(upper, dtype=float)]), max_tokens)
    lo, hi = bounds[classes], np.maximum(bounds[classes + 1], bounds[classes] + 1)
    dist = fit.distribution()
    # NOTE: a draw rounds to its integer, so (lo, hi] is [lo + 0.5, hi + 0.5) before rounding
    f_lo, f_hi = dist.cdf(lo + 0.5), dist.cdf(hi + 0.5)
    inside = f_hi - f_lo > 1e-9
    values = rng.uniform(lo + 0.5, hi + 0.5)
    u = f_lo + rng.random(len(classes)) * (f_hi - f_lo)
    values[inside] = dist.ppf(u[inside])
    return np.minimum(np.clip(np.rint(values), lo + 1, hi), max_tokens).astype(np.int64)


def _paired_inside(prompts: np.ndarray, outputs: np.ndarray, max_context_tokens: int,
                   rng: np.random.Generator) -> np.ndarray:
    """The outputs re-paired with the prompts so that each request fits the context, as
    every served request does. Drawn independently, a long prompt meets a long output and
    one would be cut: long-prompt traffic, whose outputs the context keeps short, would
    lose a fifth of its decode work. So the overflowing pairs, with as many again drawn
    from the rest, exchange outputs: the longest prompt takes the shortest output (both
    histograms keep their counts; the other pairs stay as drawn). What no round
    fixes is cut to the context."""
    outputs = outputs.copy()
    for _ in range(PAIRING_ROUNDS):
        over = np.flatnonzero(prompts + outputs > max_context_tokens)
        if len(over) == 0:
            break
        rest = np.setdiff1d(np.arange(len(prompts)), over)
        pool = np.concatenate([over, rng.choice(rest, min(len(rest), len(over)), replace=False)])
        outputs[pool[np.argsort(-prompts[pool], kind="stable")]] = np.sort(outputs[pool])
    return np.maximum(1, np.minimum(outputs, max_context_tokens - prompts))


def serving_unit(ctx: SearchContext, serving) -> Instances | None:
    """These instances (`k8s.reshuffling.Instance`) as one simulated unit, links from where
    their stages sit; None when a phase has none."""
    prefill = [i for i in serving if i.role == "prefill"]
    decode = [i for i in serving if i.role == "decode"]
    if not prefill or not decode:
        return None
    segments = tuple(
        SegmentPlacement(i.role, number, stage, node, gpu_ids)
        for group in (prefill, decode) for number, i in enumerate(group)
        for stage, (node, gpu_ids) in enumerate(i.stages)
    )
    links = pair_links(segments, ctx.intra_node_bytes_per_s, ctx.inter_node_bytes_per_s)
    return Instances(tuple(Config(i.tp, i.pp) for i in prefill),
                     tuple(Config(i.tp, i.pp) for i in decode),
                     tuple(tuple(row) for row in links))


class SearchEvaluator:
    """The planner's search and simulator applied to observations, for one spec."""

    def __init__(
        self, spec: DistServeDeploymentSpec, *, node_names: list[str] | None = None,
        gpus_per_node: int | None = None, max_gpus: int | None = None,
    ) -> None:
        self.spec = spec
        self.node_names = node_names or [f"node-{i}" for i in range(spec.cluster.nodes or 0)]
        self.gpus_per_node = gpus_per_node or spec.cluster.gpus_per_node
        self.max_gpus = max_gpus
        self.max_context_tokens = get_model(spec.model.name).max_position
        self._contexts: dict[tuple, SearchContext] = {}

    @property
    def attainment_target(self) -> float:
        """The share of requests that must meet the SLOs."""
        return self.spec.slo.attainment

    def workload(self, observation: Observation) -> Workload:
        """The observed workload (see `observed_workload`), seeded by the planner's seed."""
        return observed_workload(
            observation, self.max_context_tokens, seed=self.spec.planner.seed
        )

    def context(self, observation: Observation, correction: Correction) -> SearchContext:
        """The search context of this window and correction (kept for the next question)."""
        key = (observation.end_s, observation.window_s, observation.num_requests,
               observation.prompt, observation.output, observation.joint, correction)
        if key not in self._contexts:
            if len(self._contexts) > 8:
                self._contexts.clear()
            overrides = SearchOverrides(self.workload(observation), correction=correction)
            self._contexts[key] = replace(
                build_context(self.spec, overrides), min_duration_s=PREDICTION_DURATION_S
            )
        return self._contexts[key]

    def unit_of(self, ctx: SearchContext, plan: Plan) -> Unit:
        """The plan's instances as one simulated unit, links from where its segments sit."""
        links = pair_links(plan.segments, ctx.intra_node_bytes_per_s, ctx.inter_node_bytes_per_s)
        return whole_unit(plan.prefill, plan.decode, links)

    def predict(
        self, plan: Plan, observation: Observation, rate_rps: float, correction: Correction,
    ) -> Prediction:
        """The plan simulated on the observed workload at rate_rps."""
        ctx = self.context(observation, correction)
        result = run_unit(ctx, self.unit_of(ctx, plan), rate_rps, None)
        return Prediction(
            rate_rps, result.attainment(ctx.slo),
            result.percentile_s("ttft", 90), result.percentile_s("tpot", 90),
        )

    def replay(self, plan: Plan, observation: Observation, correction: Correction) -> Prediction:
        """The plan simulated on the window as it came: its arrivals per sub-window (each
        sub-window's spread evenly at random over it), lengths resampled from its fits;
        without sub-window counts, `predict` at the window's rate."""
        counts = np.rint(np.asarray(observation.arrival_counts, dtype=float)).astype(int)
        if not observation.subwindow_s or counts.sum() <= 0:
            return self.predict(plan, observation, observation.arrival_rate_rps, correction)
        ctx = self.context(observation, correction)
        rng = np.random.default_rng(self.spec.planner.seed)
        sub_s = observation.subwindow_s
        arrival_s = np.sort(np.concatenate(
            [(k + rng.random(c)) * sub_s for k, c in enumerate(np.maximum(counts, 0))]))
        picks = np.arange(len(arrival_s)) % ctx.trace.num_requests
        trace = Trace(arrival_s, ctx.trace.prompt_tokens[picks], ctx.trace.output_tokens[picks])
        result = simulate_unit(ctx, self.unit_of(ctx, plan), trace)
        return Prediction(
            observation.arrival_rate_rps, result.attainment(ctx.slo),
            result.percentile_s("ttft", 90), result.percentile_s("tpot", 90),
        )

    def fit_correction(self, plan: Plan, observation: Observation) -> Correction | None:
        """Per-phase factors under which the plan's simulated TTFT and TPOT p90 match the
        observed ones on the window as it came (`replay`); None without measured latencies."""
        if observation.ttft_p90_s is None or observation.tpot_p90_s is None:
            return None
        prefill = self._fit_factor(
            lambda f: self.replay(plan, observation, Correction(f, 1.0)).ttft_p90_s,
            observation.ttft_p90_s,
        )
        decode = self._fit_factor(
            lambda f: self.replay(plan, observation, Correction(prefill, f)).tpot_p90_s,
            observation.tpot_p90_s,
        )
        return Correction.clamped(prefill, decode)

    @staticmethod
    def _fit_factor(simulated_p90_s, observed_p90_s: float) -> float:
        """The factor whose simulated p90 matches the observed one: bisection on its log,
        first within `NEAR_LOW`-`NEAR_HIGH` when the observed p90 lies between the p90s
        simulated at those ends, else within `FIT_LOW`-`FIT_HIGH`."""
        # NOTE: the p90 need not grow with the factor everywhere. Faster prefill hands
        # decode more requests at once, and a prefill instance that holds their KV until
        # decode pulls it waits longer: on the replanning benchmark's summaries (8 x
        # prefill tp2pp1 : 4 x decode tp4pp1) TTFT p90 was 0.91 s at x0.6, 0.64 s at
        # x0.8, 0.68 s at x1.0 against 0.67 s served, and the wide bisection, starting
        # at x1.0, ran down to x0.5. A root near 1 is taken first.
        def above(value: float) -> bool:
            return math.isnan(value) or value > observed_p90_s

        near = (math.log(NEAR_LOW), math.log(NEAR_HIGH))
        is_near = not above(simulated_p90_s(NEAR_LOW)) and above(simulated_p90_s(NEAR_HIGH))
        low, high = near if is_near else (math.log(FIT_LOW), math.log(FIT_HIGH))
        for _ in range(FIT_STEPS):
            middle = (low + high) / 2
            if above(simulated_p90_s(math.exp(middle))):
                high = middle
            else:
                low = middle
        return math.exp((low + high) / 2)

    def search(
        self, observation: Observation, rate_rps: float, correction: Correction,
        beside: Plan | None = None,
    ) -> Plan | None:
        """The fewest-GPU plan the search finds for the observed workload that is predicted
        to meet the target at rate_rps, else the one predicted to come closest (where the
        cluster or the GPU budget cannot hold rate_rps, the search's plans for a lower
        rate); None when nothing fits.

        NOTE: the search maximises goodput per GPU, so its unit may span the whole cluster
        and serve far more than a low rate needs; searching again with instances limited
        to fewer nodes finds smaller units. The search sizes copies on trials of a minute
        of arrivals, where a plan near its knee has not yet grown the queue it grows over
        the minutes a decision holds it; so each plan is judged as `predict` judges the
        current one, and the cheapest that meets the target wins. With `beside` (the plan
        that serves now), the plan is placed where that one leaves GPUs free
        (`scaling.placed_beside`).
        """
        workload = self.workload(observation)
        for step in range(MAX_STEPS_DOWN + 1):
            overrides = SearchOverrides(
                workload, rate_rps / RATE_STEP_DOWN**step, correction, with_baselines=False
            )
            plans = [plan for span in self._spans() if (plan := self._planned(span, overrides))]
            if not plans:
                continue
            judged = [(plan, self.predict(plan, observation, rate_rps, correction).attainment)
                      for plan in plans]
            meeting = [plan for plan, attainment in judged if attainment >= self.attainment_target]
            if meeting:
                best = min(meeting, key=lambda plan: (plan.num_gpus, -plan.goodput_rps))
            else:
                best = self._grown(max(judged, key=lambda judged_plan: judged_plan[1]),
                                   observation, rate_rps, correction)
            if beside is None:
                return best
            return placed_beside(beside, best, self.node_names, self.gpus_per_node)
        return None

    def _grown(
        self, judged: tuple[Plan, float], observation: Observation, rate_rps: float,
        correction: Correction,
    ) -> Plan:
        """The closest plan with more copies of its shape where that meets the target
        (or comes closer) within the budget; the plan itself otherwise."""
        plan, attainment = judged
        grown = self.scale(plan, observation, rate_rps, correction)
        if grown is None or grown.num_gpus <= plan.num_gpus:
            return plan
        if self.predict(grown, observation, rate_rps, correction).attainment > attainment:
            return grown
        return plan

    def _spans(self) -> list[int]:
        """Most nodes per instance to search with: powers of two up to the spec's limit."""
        limit = self.spec.planner.max_nodes_per_instance or len(self.node_names) or 1
        spans = [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]
        return sorted({*spans, limit})

    def _planned(self, span: int, overrides: SearchOverrides) -> Plan | None:
        planner = self.spec.planner.model_copy(update={"max_nodes_per_instance": span})
        try:
            plan = plan_deployment(
                self.spec.model_copy(update={"planner": planner}), node_names=self.node_names,
                gpus_per_node=self.gpus_per_node, overrides=overrides,
            )
        except NoFeasiblePlan:
            return None
        if self.max_gpus is not None and plan.num_gpus > self.max_gpus:
            return None
        return plan

    def scale(
        self, plan: Plan, observation: Observation, rate_rps: float, correction: Correction
    ) -> Plan | None:
        """The current shape (parallelism and prefill:decode ratio) with as many copies as
        rate_rps needs on the observed workload, or as many as fit; None when none fits.
        The copies that serve stay where they are when the others fit beside them
        (`copies_in_place`); otherwise all are placed anew."""
        ctx = self.context(observation, correction)
        unit = copy_unit(plan, ctx.intra_node_bytes_per_s)
        one = unit_goodput(ctx, unit)
        copies = max(1, math.ceil(rate_rps / one.rate_rps)) if one.rate_rps > 0 else 1
        best = None
        for _ in range(MAX_GROWTHS + 1):
            candidate = self._placed(plan, unit, copies)
            if candidate is None:
                return best or self._largest_fitting(plan, unit, copies)
            best = replace(candidate, goodput_rps=copies * one.rate_rps, rate_rps=rate_rps)
            if self.predict(best, observation, rate_rps, correction).attainment >= (
                self.attainment_target
            ):
                return best
            copies = max(copies + 1, math.ceil(copies * GROWTH_FACTOR))
        return best

    def dark_phases(self, current: Plan, new: Plan) -> tuple[str, ...]:
        """The phases the reshuffle from current to new leaves without a serving instance
        for a weight loading (`scaling.dark_phases`, on this cluster's nodes)."""
        return dark_phases(current, new, self.node_names, self.gpus_per_node)

    def move_attainment(self, current: Plan, new: Plan, observation: Observation,
                        rate_rps: float, correction: Correction) -> float | None:
        """The lowest attainment predicted while the reshuffle from current to new runs
        (`scaling.move_pieces`: each set of instances serving on the way, on the observed
        workload at rate_rps; 0 for one with a phase that has none); None when nothing
        serves on the way but the two plans themselves."""
        try:
            pieces = move_pieces(*reshuffle_steps(current, new, self.node_names,
                                                  self.gpus_per_node))
        except ReshuffleError:
            return 0.0
        ctx = self.context(observation, correction)
        lowest = None
        everything_old = {i.name for i in plan_instances(current, "old")}
        for _, serving in pieces[:-1]:
            if {i.name for i in serving} == everything_old:
                continue  # the current plan itself: what `predict` judged
            unit = serving_unit(ctx, serving)
            attainment = 0.0 if unit is None else run_unit(ctx, unit, rate_rps, None).attainment(ctx.slo)
            lowest = attainment if lowest is None else min(lowest, attainment)
        return lowest

    def reshuffle_loadings(self, current: Plan, new: Plan) -> int:
        """How many weight loadings the reshuffle from current to new runs one after
        another (`scaling.reshuffle_loadings`, on this cluster's nodes)."""
        return reshuffle_loadings(current, new, self.node_names, self.gpus_per_node)

    def free_gpus(self, plan: Plan) -> int | None:
        """GPUs of the budget (or the cluster, when smaller) that the plan leaves free."""
        cluster = len(self.node_names) * self.gpus_per_node
        budget = cluster if self.max_gpus is None else min(cluster, self.max_gpus)
        return max(0, budget - plan.num_gpus)

    def _placed(self, plan: Plan, unit: Unit, copies: int) -> Plan | None:
        if self.max_gpus is not None and copies * unit.num_gpus > self.max_gpus:
            return None
        for place in (copies_in_place, place_copies):  # the serving copies kept, else anew
            try:
                placed = place(plan, unit, copies, self.node_names, self.gpus_per_node)
            except ClusterTooSmall:
                continue
            if placed is not None:
                return placed
        return None

    def _largest_fitting(self, plan: Plan, unit: Unit, copies: int) -> Plan | None:
        for fewer in range(copies - 1, 0, -1):
            placed = self._placed(plan, unit, fewer)
            if placed is not None:
                return placed
        return None
