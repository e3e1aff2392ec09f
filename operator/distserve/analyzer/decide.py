"""The replanning decision: keep the plan, replan, recommend a replan, or decide nothing.

`decide(observation, plan, settings, state, evaluator)` is a pure function of its
inputs (the evaluator is the planner's deterministic search and simulator, or a fake
in tests); the operator, `distserve up --replan` and the replanning benchmark call it
once per interval and pass back the `DecisionState` it returns. In order:
1. too few requests in the window, or no length histogram: no decision;
2. the latency model is corrected: per-phase factors fitted on this window (unless a
   reshuffle fell inside it or its length mix moves within it) are blended into the
   running correction;
3. the current plan is simulated on the traffic ahead (`forecast.py`: the window's
   trend carried to the end of the horizon a plan chosen now serves, `horizon_seconds`:
   the next decision, an interval on and not before this move's loading ends, and that
   decision's weight loading) at the sized rate: the forecast rate where the rate moves
   significantly (up or down), else the window's rate or, when higher, the recent
   one, times `headroom`; a trigger is a predicted or observed miss of the
   attainment target, a shift of rate or length mix against the window the plan was
   last checked for (a predicted miss counts only when the model also reproduces the
   observed attainment), or, without either, `cooldownSeconds` since that check (a
   periodic check, which only a cheaper plan answers);
4. hysteresis, as autoscalers scale up at once and down slowly: a shift must persist
   for `holdSeconds` and waits out `cooldownSeconds` after the last reshuffle began; a
   cheaper plan is taken only once every decision of the last `holdSeconds` (each
   standing for the interval before it) found one; a miss waits for none of these
   (requests are failing now); a window that holds a reshuffle is judged on its last
   third's attainment when that came after the move ended, else on none (the move, not
   the plan, is what it measured). A move ends when its new instances all serve: on a
   full cluster the reshuffle drains an old instance before each new one starts, so the
   loadings run one after another (`reshuffle_loadings`);
5. two candidates, the current shape with more or fewer copies (`scale`) and the
   search's plan (`search`), are simulated on the same workload (with a length mix
   under way, where the shift leads when the current plan does worse there: sized for
   the horizon alone, a plan is outgrown while it loads and moved again); the cheapest
   that meets the target wins, first among those whose reshuffle keeps an instance of
   each phase serving (`dark_phases`: the operator's reshuffle may have to drain a phase's
   last instance to make room for its replacement; only a miss seen now may take such
   a move), and among equal GPUs the move with the fewest loadings in a row. A miss
   moves to it; otherwise it must come while the rate is not rising (a significant
   trend in the window, or a rise since the plan was last checked at p <
   `RISING_P_VALUE`, less evidence than a shift needs), keep
   both phases serving, save `minGain` of the GPUs, and more GPU-seconds over the
   cooldown than its weight loading costs. Unless the plan is seen to miss now, a move
   predicted to miss the target on the way (`move_attainment`: what serves between its
   drains and its new instances' loadings) is not taken, or, when the plan is predicted
   to miss too, only if staying does worse. A
   shortfall only at the sized rate (the plan is seen or predicted to meet the target
   at the present rate) moves only to a plan whose new instances start on free GPUs:
   draining instances that serve now would cause the miss it means to prevent.
The decision says which kind of change (replicas, ratio, parallelism) and why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, Protocol

from distserve.analyzer.forecast import Forecast, forecast
from distserve.analyzer.observation import (
    JointLengths,
    LengthFit,
    Observation,
    PhaseObservation,
)
from distserve.analyzer.replan import Prediction
from distserve.analyzer.scaling import ChangeKind, change_kind, ratio_text, started_gpus
from distserve.analyzer.settings import ReplanningSpec
from distserve.analyzer.shift import ShiftThresholds, ShiftVerdict, is_shifted
from distserve.latency import Correction
from distserve.plan import Plan

Action = Literal["keep", "replan", "recommend", "no-decision"]
CORRECTION_WEIGHT = 0.5  # share of a new window's fitted factor in the running correction
HISTORY_LENGTH = 20
RISING_P_VALUE = 0.05  # a rise since the last check this significant holds a scale-down


class PlanEvaluator(Protocol):
    """The search and simulator as the decision uses them (`replan.SearchEvaluator`)."""

    attainment_target: float

    def predict(self, plan: Plan, observation: Observation, rate_rps: float,
                correction: Correction) -> Prediction:
        """The plan simulated on the observed workload at rate_rps."""
        ...

    def replay(self, plan: Plan, observation: Observation, correction: Correction) -> Prediction:
        """The plan simulated on the window as it came (its arrivals per sub-window)."""
        ...

    def fit_correction(self, plan: Plan, observation: Observation) -> Correction | None:
        """Per-phase latency factors fitted on the window; None without measured latencies."""
        ...

    def search(self, observation: Observation, rate_rps: float,
               correction: Correction, beside: Plan | None = None) -> Plan | None:
        """The search's plan for the observed workload at rate_rps (placed where `beside`,
        the plan that serves now, leaves GPUs free)."""
        ...

    def scale(self, plan: Plan, observation: Observation, rate_rps: float,
              correction: Correction) -> Plan | None:
        """The current shape with as many copies as rate_rps needs."""
        ...

    def dark_phases(self, current: Plan, new: Plan) -> tuple[str, ...]:
        """The phases the reshuffle from current to new leaves without a serving instance
        while a replacement loads its weights."""
        ...

    def free_gpus(self, plan: Plan) -> int | None:
        """GPUs of the budget or the cluster that the plan leaves free; None: unknown."""
        ...

    def reshuffle_loadings(self, current: Plan, new: Plan) -> int:
        """How many weight loadings the reshuffle from current to new runs one after another."""
        ...

    def move_attainment(self, current: Plan, new: Plan, observation: Observation,
                        rate_rps: float, correction: Correction) -> float | None:
        """The lowest attainment predicted while the reshuffle runs (None: nothing serves
        on the way but the two plans)."""
        ...


@dataclass(frozen=True)
class DecisionNumbers:
    """The figures a decision was taken on (None: not reached or not measured)."""

    num_requests: int
    observed_rate_rps: float
    observed_attainment: float | None = None
    sized_rate_rps: float | None = None  # observed (or forecast) rate x headroom: what plans must serve
    forecast_rate_rps: float | None = None  # the rate at the end of the horizon (`forecast.py`)
    predicted_attainment: float | None = None  # the current plan at sized_rate_rps
    new_attainment: float | None = None  # the chosen candidate at sized_rate_rps
    current_gpus: int | None = None
    new_gpus: int | None = None
    gpu_gain: float | None = None  # share of the current GPUs the candidate saves
    saving_gpu_s: float | None = None  # GPUs saved x the cooldown
    reshuffle_cost_gpu_s: float | None = None  # GPUs loading weights x reload seconds
    move_s: float | None = None  # how long the reshuffle runs: loadings in a row x reload seconds
    held_s: float | None = None  # how long the trigger has persisted
    prefill_factor: float = 1.0
    decode_factor: float = 1.0


@dataclass(frozen=True)
class HistoryEntry:
    """One past decision, as status shows it."""

    end_s: float
    action: Action
    kind: ChangeKind | None
    reason: str


@dataclass(frozen=True)
class DecisionState:
    """What one decision hands the next.

    The operator keeps it in the resource's status (`to_dict` / `from_dict`), so that a
    restarted operator goes on with the hold, cooldown and correction it had.
    """

    reference: Observation | None = None  # the window the plan was last made or checked for
    trigger_since_s: float | None = None  # when the current trigger was first seen
    # when the unbroken run of decisions that each found a cheaper plan worth moving to
    # began (a scale-down waits until it has been the recommendation for holdSeconds)
    cheaper_since_s: float | None = None
    last_reshuffle_s: float | None = None
    reshuffle_end_s: float | None = None  # when the last reshuffle's new instances all serve
    correction: Correction = Correction()
    history: tuple[HistoryEntry, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (the reference window with its histograms, not its fits' samples)."""
        return {
            "reference": asdict(self.reference) if self.reference is not None else None,
            "triggerSinceSeconds": self.trigger_since_s,
            "cheaperSinceSeconds": self.cheaper_since_s,
            "lastReshuffleSeconds": self.last_reshuffle_s,
            "reshuffleEndSeconds": self.reshuffle_end_s,
            "correction": {"prefillFactor": self.correction.prefill_factor,
                           "decodeFactor": self.correction.decode_factor},
            "history": [asdict(entry) for entry in self.history],
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any] | None) -> DecisionState:
        """The state `to_dict` wrote; a fresh state for None or an empty document."""
        if not data:
            return DecisionState()
        correction = data.get("correction") or {}
        return DecisionState(
            reference=_observation_from_dict(data.get("reference")),
            trigger_since_s=data.get("triggerSinceSeconds"),
            cheaper_since_s=data.get("cheaperSinceSeconds"),
            last_reshuffle_s=data.get("lastReshuffleSeconds"),
            reshuffle_end_s=data.get("reshuffleEndSeconds"),
            correction=Correction(correction.get("prefillFactor", 1.0),
                                  correction.get("decodeFactor", 1.0)),
            history=tuple(HistoryEntry(**entry) for entry in data.get("history") or ()),
        )


def _observation_from_dict(data: Mapping[str, Any] | None) -> Observation | None:
    if data is None:
        return None

    def fit(values: Mapping[str, Any] | None) -> LengthFit | None:
        if values is None:
            return None
        return LengthFit(**{**values, **{k: tuple(values[k]) for k in
                                         ("params", "bucket_upper_tokens", "bucket_counts")}})

    def joint(values: Mapping[str, Any] | None) -> JointLengths | None:
        if values is None:
            return None
        return JointLengths(tuple(values["prompt_upper_tokens"]),
                            tuple(values["output_upper_tokens"]),
                            tuple(tuple(row) for row in values["counts"]))

    phases = {name: PhaseObservation(**values) for name, values in (data.get("phases") or {}).items()}
    return Observation(**{**data, "arrival_counts": tuple(data.get("arrival_counts") or ()),
                          "prompt": fit(data.get("prompt")),
                          "output": fit(data.get("output")), "joint": joint(data.get("joint")),
                          "phases": phases, "recent": _observation_from_dict(data.get("recent")),
                          "previous": _observation_from_dict(data.get("previous"))})


@dataclass(frozen=True)
class Decision:
    """What to do about one window, why, and the state for the next decision."""

    action: Action
    reason: str
    numbers: DecisionNumbers
    state: DecisionState
    kind: ChangeKind | None = None  # for replan and recommend: what changes
    plan: Plan | None = None  # for replan and recommend: the plan to move to
    verdict: ShiftVerdict | None = None


def decide(
    observation: Observation, plan: Plan, settings: ReplanningSpec, state: DecisionState,
    evaluator: PlanEvaluator, thresholds: ShiftThresholds | None = None,
) -> Decision:
    """Keep, replan, recommend or no decision for this window (see the module docstring)."""
    numbers = DecisionNumbers(
        observation.num_requests, observation.arrival_rate_rps, observation.attainment,
        current_gpus=plan.num_gpus,
    )
    if observation.num_requests < settings.min_requests:
        return _decision("no-decision", f"too few requests: {observation.num_requests} in the "
                         f"window, {settings.min_requests} needed", numbers, state, observation)
    if observation.prompt is None or observation.output is None:
        return _decision("no-decision", "no length histogram in the window", numbers, state,
                         observation)
    now_s = observation.end_s
    # a scale-down pending its hold goes on only while every decision finds one
    cheaper_since_s, state = state.cheaper_since_s, replace(state, cheaper_since_s=None)
    traffic_ahead = forecast(observation, horizon_seconds(settings), thresholds)
    state = replace(state, correction=_corrected(
        state, plan, observation, settings, evaluator, traffic_ahead.is_mix_trend))
    # NOTE: a rate seen to fall (a burst that ended, the evening) is sized for where it
    # is going; otherwise for the window's rate when higher than the recent one (noise)
    ahead_rps = traffic_ahead.rate_rps if traffic_ahead.is_rate_trend else max(
        observation.arrival_rate_rps, traffic_ahead.rate_rps)
    sized_rps = ahead_rps * settings.headroom
    ahead = traffic_ahead.workload
    predicted = evaluator.predict(plan, ahead, sized_rps, state.correction)
    # NOTE: a mix under way goes on past the horizon: a plan sized for the horizon's mix
    # alone is outgrown while it loads and moved again, its drains and loadings twice
    # (the replanning benchmark's code -> summarization ramp: 10 GPUs, then 20 five
    # minutes later). Where the current plan does worse on the mix the shift leads to,
    # the candidates are sized and judged there.
    sized_on, sized_on_attainment = ahead, predicted.attainment
    if traffic_ahead.destination is not None:
        far = evaluator.predict(plan, traffic_ahead.destination, sized_rps, state.correction)
        if far.attainment < predicted.attainment:
            sized_on, sized_on_attainment = traffic_ahead.destination, far.attainment
    numbers = replace(
        numbers, sized_rate_rps=sized_rps, forecast_rate_rps=traffic_ahead.rate_rps,
        predicted_attainment=predicted.attainment,
        prefill_factor=state.correction.prefill_factor,
        decode_factor=state.correction.decode_factor,
    )
    reference = state.reference or observation
    verdict = is_shifted(reference, observation, thresholds)
    seen = _measured_part(state, observation, settings)
    observed = seen.attainment if seen is not None else None
    miss = _miss(observed, predicted, evaluator.attainment_target)
    if miss and observed is not None and observed >= evaluator.attainment_target:
        # NOTE: the model is trusted to predict a miss only where it reproduces what was
        # observed: a plan seen to meet the target that the model has missing on the
        # traffic it was seen on is one the model times wrong, not one that needs moving.
        at_observed = evaluator.replay(plan, seen, state.correction)
        if at_observed.attainment < evaluator.attainment_target:
            miss = None
    checked_s = now_s - reference.end_s
    periodic = miss is None and not verdict.is_shifted
    if periodic and checked_s < settings.cooldown_seconds:
        return _decision("keep", f"no shift ({verdict.describe()}) and the plan meets the "
                         f"target (predicted {predicted.attainment:.1%})", numbers,
                         replace(state, reference=reference, trigger_since_s=None),
                         observation, verdict=verdict)
    # NOTE: a plan is checked against the window it was made or last checked for; one
    # chosen while the mix moved (the ramp's forecast) or the rate peaked goes on being
    # "no shift" from there, so a cooldown after its last check it is checked again:
    # the periodic replanning of the design, which only a cheaper plan may answer
    if periodic:
        since_s = now_s if cheaper_since_s is None else cheaper_since_s
    else:
        since_s = now_s if state.trigger_since_s is None else state.trigger_since_s
    state = replace(state, reference=reference, trigger_since_s=None if periodic else since_s)
    numbers = replace(numbers, held_s=now_s - since_s)
    trigger = miss or (f"shift ({verdict.describe()})" if not periodic else
                       f"a periodic check, {checked_s:.0f} s after the last")
    if state.last_reshuffle_s is not None and miss is None:
        left_s = state.last_reshuffle_s + settings.cooldown_seconds - now_s
        if left_s > 0:
            return _decision("keep", f"{trigger}, but in cooldown ({left_s:.0f} s left)",
                             numbers, state, observation, verdict=verdict)
    if miss is None and not periodic and now_s - since_s < settings.hold_seconds:
        return _decision("keep", f"{trigger}, seen for {now_s - since_s:.0f} s of the "
                         f"{settings.hold_seconds:.0f} s hold", numbers, state, observation,
                         verdict=verdict)
    present_rps = _shortfall_only(observation, observed, miss, plan, traffic_ahead, state,
                                  evaluator)
    failing = observed is not None and observed < evaluator.attainment_target
    rising = None
    if traffic_ahead.is_rate_trend and traffic_ahead.rate_rps > observation.arrival_rate_rps:
        rising = (f"the rate is rising (forecast {traffic_ahead.rate_rps:.2f} req/s against "
                  f"{observation.arrival_rate_rps:.2f} in the window)")
    elif verdict.rate_change > 0 and (verdict.is_rate_shifted or (
            verdict.rate_p_value is not None and verdict.rate_p_value < RISING_P_VALUE)):
        # NOTE: a climb too slow for the window's own trend test (the diurnal morning: p
        # 0.05 within one window) still shows against the window the plan was checked for;
        # a scale-down waits on less evidence of a climb than a shift needs to count
        p_value = "" if verdict.rate_p_value is None else f" (p={verdict.rate_p_value:.2g})"
        rising = f"the rate rose {verdict.rate_change:.0%} since the plan was last checked{p_value}"
    return _choose(observation, sized_on, plan, settings, state, evaluator, verdict, miss,
                   numbers, present_rps, failing, rising, trigger, way=ahead,
                   current_attainment=sized_on_attainment)


def horizon_seconds(settings: ReplanningSpec) -> float:
    """How far ahead a plan chosen now serves at least: its own weight loading, then until
    the next decision (an interval on, and not before the move ends: no decision while a
    reshuffle runs), and that decision's weight loading."""
    return max(settings.interval_seconds, settings.reload_seconds) + settings.reload_seconds


def _shortfall_only(
    observation: Observation, observed: float | None, miss: str | None, plan: Plan,
    traffic_ahead: Forecast, state: DecisionState, evaluator: PlanEvaluator,
) -> float | None:
    """The present rate when the miss is only a shortfall at the sized rate: not observed,
    and the plan is predicted to meet the target at the present rate (the window's or the
    recent one, without headroom or trend) on the lengths ahead; else None."""
    target = evaluator.attainment_target
    if miss is None or (observed is not None and observed < target):
        return None
    present_rps = max(observation.arrival_rate_rps, observation.recent_rate_rps or 0.0)
    present = evaluator.predict(plan, traffic_ahead.workload, present_rps, state.correction)
    return present_rps if present.attainment >= target else None


def _choose(
    observation: Observation, ahead: Observation, plan: Plan, settings: ReplanningSpec,
    state: DecisionState, evaluator: PlanEvaluator, verdict: ShiftVerdict, miss: str | None,
    numbers: DecisionNumbers, present_rps: float | None = None, failing: bool = False,
    rising: str | None = None, trigger: str = "", *, way: Observation,
    current_attainment: float,
) -> Decision:
    """Simulate the candidates on the workload ahead and move to the best, or keep (the
    trigger then resets); the move itself is judged on `way` (the horizon's workload,
    where `ahead` is where a mix under way leads), and a candidate must do better than
    `current_attainment` (the current plan on `ahead`). With `present_rps` (a shortfall
    only at the sized rate), only candidates whose new instances start on free GPUs
    count; unless the plan is seen `failing` now, only candidates whose move keeps both
    phases serving do."""
    rate, correction, target = numbers.sized_rate_rps, state.correction, evaluator.attainment_target
    proposed = [candidate for candidate in (
        evaluator.scale(plan, ahead, rate, correction),
        evaluator.search(ahead, rate, correction, beside=plan),
    ) if candidate is not None]
    candidates = [(candidate, evaluator.predict(candidate, ahead, rate, correction))
                  for candidate in proposed if change_kind(plan, candidate) is not None]
    settled = replace(state, reference=observation, trigger_since_s=None)
    if present_rps is not None:
        free = evaluator.free_gpus(plan)
        beside = [(c, p) for c, p in candidates if free is None or started_gpus(plan, c) <= free]
        if candidates and not beside:
            return _decision(
                "keep", f"{miss}, but the plan meets the target at the present "
                f"{present_rps:.2f} req/s and every better plan would drain instances that "
                f"serve now ({free} GPUs free)", numbers, settled, observation, verdict=verdict)
        candidates = beside
    # NOTE: a move that leaves a phase with no serving instance while its replacement
    # loads fails every request of those minutes: a candidate whose move keeps both
    # phases serving goes first, and only a miss seen now may take one that does not (a
    # predicted miss would be made certain by the move meant to prevent it)
    dark = {id(c): evaluator.dark_phases(plan, c) for c, _ in candidates}
    if miss and not failing:
        lit = [(c, p) for c, p in candidates if not dark[id(c)]]
        if candidates and not lit:
            phases = " and ".join(sorted({r for c, _ in candidates for r in dark[id(c)]}))
            return _decision(
                "keep", f"{miss}, but every other plan's reshuffle would leave {phases} with "
                f"no serving instance while it loads, and the plan is not seen to miss now",
                numbers, settled, observation, verdict=verdict)
        candidates = lit
    # NOTE: a move drains instances before their replacements serve. One that would miss
    # the target on the way (the traffic ahead, without headroom) is not taken unless the
    # plan is seen to miss now, or staying is predicted worse than the way (a cheaper
    # plan at 2 x prefill : 1 x decode for 6 minutes lost a whole window of the
    # replanning benchmark); among the rest, a move that meets it on the way goes first
    way_rps = rate / settings.headroom
    weak = {id(c): evaluator.move_attainment(plan, c, way, way_rps, correction)
            for c, _ in candidates}
    shaky = {id(c) for c, _ in candidates if weak[id(c)] is not None and weak[id(c)] < target}
    if not failing and shaky:
        floor = target if miss is None else min(
            target, evaluator.predict(plan, way, way_rps, correction).attainment)
        steady = [(c, p) for c, p in candidates if id(c) not in shaky or weak[id(c)] >= floor]
        if candidates and not steady:
            lowest = min(weak[id(c)] for c, _ in candidates)
            return _decision(
                "keep", f"{trigger}, but every other plan's reshuffle would "
                f"miss the target on the way ({lowest:.1%} at {way_rps:.2f} req/s), and the "
                f"plan is not seen to miss now", numbers, settled, observation, verdict=verdict)
        candidates = steady
    moves = {id(c): evaluator.reshuffle_loadings(plan, c) for c, _ in candidates}
    meeting = [(c, p) for c, p in candidates if p.attainment >= target]
    if meeting:
        best, best_prediction = min(meeting, key=lambda cp: (
            bool(dark[id(cp[0])]), id(cp[0]) in shaky, cp[0].num_gpus, moves[id(cp[0])],
            started_gpus(plan, cp[0])))
    elif miss and candidates:
        best, best_prediction = max(candidates, key=lambda cp: (
            not dark[id(cp[0])], cp[1].attainment))
        if best_prediction.attainment <= current_attainment:
            return _decision("keep", f"{miss}, and no plan within the budget does better",
                             numbers, settled, observation, verdict=verdict)
    elif proposed and not candidates:
        return _decision("keep", f"{trigger}, and the scaled and searched plans are the current "
                         "one", numbers, settled, observation, verdict=verdict)
    else:
        return _decision("keep", f"{trigger}, but no other plan meets the target", numbers,
                         settled, observation, verdict=verdict)
    saved_gpus = plan.num_gpus - best.num_gpus
    numbers = replace(
        numbers, new_attainment=best_prediction.attainment, new_gpus=best.num_gpus,
        gpu_gain=saved_gpus / plan.num_gpus,
        saving_gpu_s=saved_gpus * settings.cooldown_seconds,
        reshuffle_cost_gpu_s=started_gpus(plan, best) * settings.reload_seconds,
        move_s=moves[id(best)] * settings.reload_seconds,
    )
    if miss is None:
        worth = _worth_moving(numbers, settings, dark[id(best)], rising)
        if worth is not None:
            return _decision("keep", f"{trigger} and the plan still meets the target; {worth}",
                             numbers, settled, observation, verdict=verdict)
        # NOTE: as autoscalers stabilise a scale-down (the highest recommendation over a
        # window): each decision stands for the interval before it, and a cheaper plan is
        # taken once the decisions of the last holdSeconds all found one. At an interval
        # of the hold that is the decision itself; at a minute, five in a row (one check
        # at minute 17 of the morning's climb dropped 7 GPUs to 4, and the ramp at minute
        # 40 broke the 4)
        held_s = numbers.held_s or 0.0
        recommended_s = held_s + settings.interval_seconds
        if recommended_s < settings.hold_seconds:
            return _decision(
                "keep", f"{trigger}; a plan of {best.num_gpus} GPUs instead of "
                f"{plan.num_gpus} meets the target, the recommendation for "
                f"{recommended_s:.0f} s of the {settings.hold_seconds:.0f} s hold",
                numbers, replace(state, cheaper_since_s=observation.end_s - held_s),
                observation, verdict=verdict)
        why = (f"a plan of {best.num_gpus} GPUs instead of {plan.num_gpus} meets the target "
               f"({numbers.gpu_gain:.0%} fewer; saves {numbers.saving_gpu_s:.0f} GPU-s over the "
               f"cooldown against {numbers.reshuffle_cost_gpu_s:.0f} GPU-s of weight loading)")
    else:
        why = f"{miss}; the new plan is predicted to reach {best_prediction.attainment:.1%}"
    kind = change_kind(plan, best)
    action = "recommend" if settings.advisory else "replan"
    if settings.advisory:
        moved = settled
    else:
        moved = replace(settled, last_reshuffle_s=observation.end_s,
                        reshuffle_end_s=observation.end_s + numbers.move_s)
    reason = f"{why}. {_kind_reason(kind, verdict, plan, best)}"
    if moves[id(best)] > 1:
        reason += (f" The reshuffle drains before it starts: {moves[id(best)]} weight loadings "
                   f"in a row, {numbers.move_s:.0f} s.")
    return _decision(action, reason, numbers, moved, observation, kind, best, verdict)


def _worth_moving(numbers: DecisionNumbers, settings: ReplanningSpec,
                  dark: tuple[str, ...] = (), rising: str | None = None) -> str | None:
    """Why a cheaper plan is not worth a reshuffle; None when it is."""
    if rising and numbers.gpu_gain > 0:
        # NOTE: as autoscalers hold a scale-down while the load climbs: a plan sized on a
        # rising trend's forecast has the least margin for what else the climb brings
        return f"{rising}: no scale-down while it does"
    if dark:
        return (f"moving to it would leave {' and '.join(dark)} with no serving instance "
                f"while its replacement loads weights")
    if numbers.gpu_gain <= 0:
        return (f"no cheaper plan meets the target (the best takes {numbers.new_gpus} GPUs "
                f"against {numbers.current_gpus})")
    if numbers.gpu_gain < settings.min_gain:
        return (f"the best plan saves {numbers.gpu_gain:.0%} of the GPUs, "
                f"under the {settings.min_gain:.0%} minimum gain")
    if numbers.saving_gpu_s <= numbers.reshuffle_cost_gpu_s:
        return (f"saving {numbers.saving_gpu_s:.0f} GPU-s over the cooldown does not pay "
                f"{numbers.reshuffle_cost_gpu_s:.0f} GPU-s of weight loading")
    return None


def _reshuffle_end(state: DecisionState, settings: ReplanningSpec) -> float:
    """When the last reshuffle's new instances all serve (a state from before the move's
    length was kept: one weight loading after it began)."""
    if state.reshuffle_end_s is not None:
        return state.reshuffle_end_s
    return state.last_reshuffle_s + settings.reload_seconds


def _holds_reshuffle(
    state: DecisionState, observation: Observation, settings: ReplanningSpec
) -> bool:
    """Whether the last reshuffle (until its new instances all serve) overlaps the
    observation's window."""
    return state.last_reshuffle_s is not None and (
        observation.end_s - observation.window_s < _reshuffle_end(state, settings)
    )


def _measured_part(
    state: DecisionState, observation: Observation, settings: ReplanningSpec
) -> Observation | None:
    """The part of the window whose attainment measured the plan: the window, or, when it
    holds a reshuffle's weight loading, its last third if that came after it (the plan as
    it serves now); None when no part of the window measured the plan alone."""
    if not _holds_reshuffle(state, observation, settings):
        return observation
    recent = observation.recent
    if recent is not None and recent.prompt is not None and recent.output is not None and (
        not _holds_reshuffle(state, recent, settings)
    ):
        return recent
    return None


def _miss(observed_attainment: float | None, predicted: Prediction, target: float) -> str | None:
    """Why the current plan misses the target (predicted or observed); None when it meets it."""
    if observed_attainment is not None and observed_attainment < target:
        return f"observed attainment {observed_attainment:.1%} < {target:.0%}"
    if predicted.attainment < target:
        return (f"the plan is predicted to reach {predicted.attainment:.1%} < {target:.0%} "
                f"at {predicted.rate_rps:.2f} req/s")
    return None


def _kind_reason(kind: ChangeKind, verdict: ShiftVerdict, current: Plan, new: Plan) -> str:
    """Which change, and why that kind, in words."""
    change = f"{ratio_text(current)} -> {ratio_text(new)}"
    if kind == "replicas":
        why = "same length mix" if not verdict.is_mix_shifted else "the shape still fits"
        return f"Replicas only ({why}, rate {verdict.rate_change:+.0%}): {change}"
    mix = ("the length mix shifted" if verdict.is_mix_shifted else "the rate moved"
           if verdict.is_shifted else "a periodic check")
    if kind == "ratio":
        return f"A new prefill:decode ratio ({mix}: {verdict.describe()}): {change}"
    return f"New parallelism ({mix}: {verdict.describe()}): {change}"


def _corrected(state: DecisionState, plan: Plan, observation: Observation,
               settings: ReplanningSpec, evaluator: PlanEvaluator,
               is_mix_moving: bool = False) -> Correction:
    """The running correction with this window's fit blended in (geometric mean, weighted);
    unchanged when the window holds a reshuffle, its length mix moves within it, or it
    has no measured latencies."""
    # NOTE: the fit replays the window as one stationary mix; a mix moving within the
    # window loads its end more than its average (a queue the replay does not build),
    # and the fit would read that as a slower model: x1.34 prefill and x1.45 decode on
    # the replanning benchmark's code -> summarization ramp, where the true factor is 1
    if is_mix_moving or _holds_reshuffle(state, observation, settings):
        return state.correction
    fitted = evaluator.fit_correction(plan, observation)
    if fitted is None:
        return state.correction

    def blend(old: float, new: float) -> float:
        return math.exp((1 - CORRECTION_WEIGHT) * math.log(old) + CORRECTION_WEIGHT * math.log(new))

    old = state.correction
    return Correction.clamped(
        blend(old.prefill_factor, fitted.prefill_factor),
        blend(old.decode_factor, fitted.decode_factor),
    )


def _decision(
    action: Action, reason: str, numbers: DecisionNumbers, state: DecisionState,
    observation: Observation, kind: ChangeKind | None = None, plan: Plan | None = None,
    verdict: ShiftVerdict | None = None,
) -> Decision:
    entry = HistoryEntry(observation.end_s, action, kind, reason)
    state = replace(state, history=(*state.history, entry)[-HISTORY_LENGTH:])
    return Decision(action, reason, numbers, state, kind, plan, verdict)
