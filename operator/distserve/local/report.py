"""Latency percentiles, SLO attainment and goodput of a load run, beside a plan's prediction."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distserve.local.load import Outcome
from distserve.plan import Plan


@dataclass
class RunSummary:
    """One load run at one rate."""

    rate_rps: float
    num_requests: int
    num_errors: int
    attainment: float  # share of requests meeting both SLOs
    ttft_p_s: dict[int, float]  # percentile -> seconds
    tpot_p_s: dict[int, float]

    @property
    def slo_goodput_rps(self) -> float:
        """Requests per second served within both SLOs at this rate."""
        return self.rate_rps * self.attainment


def summarize(outcomes: list[Outcome], rate_rps: float, ttft_slo_s: float,
              tpot_slo_s: float) -> RunSummary:
    """Percentiles over the successful requests; attainment over all of them."""
    ok = [o for o in outcomes if o.error is None and o.ttft_s is not None]
    ttfts = np.array([o.ttft_s for o in ok]) if ok else np.array([np.nan])
    tpots = np.array([o.tpot_s for o in ok if o.tpot_s is not None]) if ok else np.array([np.nan])
    if tpots.size == 0:
        tpots = np.array([np.nan])
    met = sum(o.meets(ttft_slo_s, tpot_slo_s) for o in outcomes)
    return RunSummary(
        rate_rps=rate_rps,
        num_requests=len(outcomes),
        num_errors=len(outcomes) - len(ok),
        attainment=met / max(1, len(outcomes)),
        ttft_p_s={p: float(np.percentile(ttfts, p)) for p in (50, 90, 99)},
        tpot_p_s={p: float(np.percentile(tpots, p)) for p in (50, 90, 99)},
    )


def format_summary(s: RunSummary, plan: Plan | None, target: float,
                   predicted: RunSummary | None = None) -> str:
    """Measured figures; beside them the simulator's for the same requests (predicted)
    when given, and the planner's goodput when there is a plan."""
    def sim(text: str) -> str:
        return f"   (simulated: {text})" if predicted is not None else ""

    p = predicted
    lines = [
        f"  rate        {s.rate_rps:.2f} req/s, {s.num_requests} requests, {s.num_errors} errors"
        + sim("the same requests at the same times"),
        f"  TTFT        {_percentiles(s.ttft_p_s, '.3f')}" + (sim(_percentiles(p.ttft_p_s, '.3f')) if p else ""),
        f"  TPOT        {_percentiles(s.tpot_p_s, '.4f')}" + (sim(_percentiles(p.tpot_p_s, '.4f')) if p else ""),
        f"  attainment  {s.attainment:.1%} of requests met both SLOs (target {target:.0%})"
        + (sim(f"{p.attainment:.1%}") if p else ""),
        f"  goodput     {s.slo_goodput_rps:.2f} req/s within SLO at this rate; "
        f"{'meets' if s.attainment >= target else 'misses'} the target"
        + (sim(f"{p.slo_goodput_rps:.2f} req/s") if p else "")
        + (f"   (planner goodput: {plan.goodput_rps:.2f} req/s)" if plan else ""),
    ]
    return "\n".join(lines)


def _percentiles(p_s: dict[int, float], fmt: str) -> str:
    return "  ".join(f"p{q} {p_s[q]:{fmt}} s" for q in (50, 90, 99))
