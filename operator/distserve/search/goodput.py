"""Goodput: the highest request rate whose SLO attainment still reaches the target.

Attainment falls as the rate rises (queues grow), so the rate is bracketed by
doubling or halving from a capacity estimate and then bisected to a relative
tolerance. Every trial replays the same sampled requests with arrivals scaled to the
rate, so two rates differ only in load, and a trial stops as soon as the target is
out of reach (a failing rate costs little).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from distserve.simulator import SLO, SimResult

REL_TOL = 0.03  # bisection stops when the bracket is this narrow relative to the rate
MAX_HALVINGS = 10  # below estimate / 2**10 the SLOs are unattainable at any rate


@dataclass(frozen=True)
class Goodput:
    """The result of one bisection."""

    rate_rps: float  # 0.0 when no rate meets the target
    attainment: float  # attainment measured at rate_rps (or at the lowest rate tried)
    trials: int


def find_goodput(
    run_trial: Callable[[float, SLO | None], SimResult],
    slo: SLO,
    estimate_rps: float,
    rel_tol: float = REL_TOL,
) -> Goodput:
    """Bisect on rate. run_trial(rate, slo) simulates one trial (slo enables early exit)."""
    trials = 0

    def passes(rate: float) -> tuple[bool, float]:
        nonlocal trials
        trials += 1
        attained = run_trial(rate, slo).attainment(slo)
        return attained >= slo.attainment, attained

    rate = max(estimate_rps, 1e-6)
    ok, attained = passes(rate)
    if ok:
        lo, lo_att, hi = rate, attained, None
        while hi is None:
            rate *= 2
            ok, attained = passes(rate)
            if ok:
                lo, lo_att = rate, attained
            else:
                hi = rate
    else:
        hi, lo, lo_att = rate, None, attained
        for _ in range(MAX_HALVINGS):
            rate /= 2
            ok, attained = passes(rate)
            if ok:
                lo, lo_att = rate, attained
                break
            hi, lo_att = rate, attained
        if lo is None:
            return Goodput(0.0, lo_att, trials)
    while (hi - lo) > rel_tol * lo:
        mid = (lo + hi) / 2
        ok, attained = passes(mid)
        if ok:
            lo, lo_att = mid, attained
        else:
            hi = mid
    return Goodput(lo, lo_att, trials)
