"""Goodput: the highest request rate whose SLO attainment still reaches the target.

Attainment falls as the rate rises (queues grow), so the rate is bracketed by
geometric steps from a capacity estimate (a step of STEP_FACTOR, squared after every
step in the same direction, so that a good estimate costs two trials and a poor one
only a few more) and then bisected to a relative tolerance. Every trial replays the same sampled requests with arrivals scaled to the
rate, so two rates differ only in load, and a trial stops as soon as the target is
out of reach (a failing rate costs little). `find_goodput_wide` does the same with
several trials at a time, for one bisection that would leave the search's workers idle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from distserve.simulator import SLO, SimResult

REL_TOL = 0.03  # bisection stops when the bracket is this narrow relative to the rate
STEP_FACTOR = 1.15  # the first bracketing step; estimates are usually within 15%
MAX_SHRINK = 2.0**10  # below estimate / 2**10 the SLOs are unattainable at any rate
# Above this a deployment is taken to serve any rate: the upward steps (squared each time)
# stop here instead of overflowing, for a model so small its timing is about zero.
MAX_RATE_RPS = 1e6


@dataclass(frozen=True)
class Goodput:
    """The result of one bisection."""

    rate_rps: float  # 0.0 when no rate meets the target
    attainment: float  # attainment measured at rate_rps (or at the lowest rate tried)
    trials: int
    fail_rps: float = 0.0  # the lowest rate seen to miss the target (0.0: none tried)


def find_goodput(
    run_trial: Callable[[float, SLO | None], SimResult],
    slo: SLO,
    estimate_rps: float,
    rel_tol: float = REL_TOL,
    known: Goodput | None = None,
) -> Goodput:
    """Bisect on rate. run_trial(rate, slo) simulates one trial (slo enables early exit).

    known: an earlier, coarser result for the same trials, whose bracket
    [rate_rps, fail_rps] is narrowed instead of searched for again.
    """
    if known is not None and known.rate_rps > 0 and known.fail_rps > known.rate_rps:
        return _bisect(run_trial, slo, known.rate_rps, known.attainment, known.fail_rps,
                       rel_tol, known.trials)
    trials = 0

    def passes(rate: float) -> tuple[bool, float]:
        nonlocal trials
        trials += 1
        attained = run_trial(rate, slo).attainment(slo)
        return attained >= slo.attainment, attained

    rate = _start_rate(estimate_rps)
    ok, attained = passes(rate)
    factor = STEP_FACTOR
    if ok:
        lo, lo_att, hi = rate, attained, None
        while hi is None:
            if rate >= MAX_RATE_RPS:
                return Goodput(rate, attained, trials)  # no miss seen below the cap
            rate = min(rate * factor, MAX_RATE_RPS)
            factor *= factor
            ok, attained = passes(rate)
            if ok:
                lo, lo_att = rate, attained
            else:
                hi = rate
    else:
        hi, lo, lo_att = rate, None, attained
        while lo is None and rate > estimate_rps / MAX_SHRINK:
            rate /= factor
            factor *= factor
            ok, attained = passes(rate)
            if ok:
                lo, lo_att = rate, attained
            else:
                hi, lo_att = rate, attained
        if lo is None:
            return Goodput(0.0, lo_att, trials, hi)
    return _bisect(run_trial, slo, lo, lo_att, hi, rel_tol, trials)


def _start_rate(estimate_rps: float) -> float:
    """Where stepping starts: the estimate, within (0, MAX_RATE_RPS]."""
    return min(max(estimate_rps, 1e-6), MAX_RATE_RPS) if math.isfinite(estimate_rps) else MAX_RATE_RPS


def _bisect(run_trial, slo: SLO, lo: float, lo_att: float, hi: float, rel_tol: float,
            trials: int) -> Goodput:
    """Narrow [lo passing, hi failing] until it is within rel_tol of lo."""
    while (hi - lo) > rel_tol * lo:
        mid = (lo + hi) / 2
        trials += 1
        attained = run_trial(mid, slo).attainment(slo)
        if attained >= slo.attainment:
            lo, lo_att = mid, attained
        else:
            hi = mid
    return Goodput(lo, lo_att, trials, hi)


def find_goodput_wide(
    run_trials: Callable[[list[float]], list[float]], slo: SLO, estimate_rps: float,
    width: int, rel_tol: float = REL_TOL, known: dict[float, float] | None = None,
) -> Goodput:
    """find_goodput with width trials at once: run_trials(rates) gives each rate's
    attainment. The steps are find_goodput's, width at a time, and the bracket is split
    into width + 1 (a third at a time on two workers, where bisection halves it).
    known: attainments already judged at some rates (not run again)."""
    target = slo.attainment
    judged: dict[float, float] = dict(known or {})

    def bracket() -> tuple[float | None, float | None]:
        """(highest passing rate below every miss, lowest missing rate)."""
        hi = min((r for r, a in judged.items() if a < target), default=None)
        lo = max((r for r, a in judged.items() if a >= target and (hi is None or r < hi)),
                 default=None)
        return lo, hi

    def judge(rates: list[float]) -> tuple[float | None, float | None]:
        judged.update(zip(rates, run_trials(rates), strict=True))
        return bracket()

    rate = _start_rate(estimate_rps)
    factor = STEP_FACTOR
    # NOTE: a round's rates are a step apart, and the step is raised to the width's
    # power after each round: the next round starts where this one ended
    if judged:
        lo, hi = bracket()
    else:
        lo, hi = judge(sorted({min(rate * factor**k, MAX_RATE_RPS) for k in range(width)}))
    while lo is None or hi is None:
        if hi is None:  # every rate met the target: further up
            if max(judged) >= MAX_RATE_RPS:
                return Goodput(lo, judged[lo], len(judged))
            rates = {min(max(judged) * factor**k, MAX_RATE_RPS) for k in range(1, width + 1)}
        else:  # every rate missed: further down
            if min(judged) <= estimate_rps / MAX_SHRINK:
                return Goodput(0.0, judged[min(judged)], len(judged), hi)
            rates = {min(judged) / factor**k for k in range(1, width + 1)}
        factor **= width
        lo, hi = judge(sorted(rates - judged.keys()))
    while (hi - lo) > rel_tol * lo:
        lo, hi = judge([lo + (hi - lo) * k / (width + 1) for k in range(1, width + 1)])
    return Goodput(lo, judged[lo], len(judged), hi)
