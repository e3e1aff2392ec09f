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


def format_summary(s: RunSummary, plan: Plan | None, target: float) -> str:
    """Measured figures, with the planner's prediction beside them when there is one."""
    lat = plan.latency if plan else None

    def pred(value: float | None, fmt: str) -> str:
        return f"   (planner: {value:{fmt}})" if value is not None else ""

    lines = [
        f"  rate        {s.rate_rps:.2f} req/s, {s.num_requests} requests, {s.num_errors} errors",
        f"  TTFT        p50 {s.ttft_p_s[50]:.3f} s  p90 {s.ttft_p_s[90]:.3f} s  p99 {s.ttft_p_s[99]:.3f} s"
        + pred(lat.ttft_p90_s if lat else None, ".3f") .replace("planner:", "planner p90:"),
        f"  TPOT        p50 {s.tpot_p_s[50]:.4f} s p90 {s.tpot_p_s[90]:.4f} s p99 {s.tpot_p_s[99]:.4f} s"
        + pred(lat.tpot_p90_s if lat else None, ".4f").replace("planner:", "planner p90:"),
        f"  attainment  {s.attainment:.1%} of requests met both SLOs (target {target:.0%})"
        + pred(plan.attainment if plan else None, ".1%"),
        f"  goodput     {s.slo_goodput_rps:.2f} req/s within SLO at this rate; "
        f"{'meets' if s.attainment >= target else 'misses'} the target"
        + (f"   (planner goodput: {plan.goodput_rps:.2f} req/s)" if plan else ""),
    ]
    return "\n".join(lines)
