"""Non-stationary traffic for the replanning benchmark, and what the analyzer sees of it.

The day: a diurnal rate swing of 3x (low at both ends, peak in the middle); the length
mix moves code completion -> summarization (a hard shift: the best shapes differ in
ratio and parallelism), then summarization -> chatbot -> summarization (the milder
shift), each over a ramp of minutes; one burst of twice the rate. Requests arrive as a
Poisson process whose rate follows the day; each takes its lengths from the shipped
sample of the application the mix draws.

An observation is built as the analyzer builds one from Prometheus: arrivals counted,
lengths only as the engine's histogram buckets (fitted by `analyzer.fit`) and its joint
histogram (which prompt class had which output bucket), the
burstiness from sub-window counts, the window's last third as `recent` and the third
before it as `previous`, the latencies from what the deployment served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from distserve.analyzer.fit import fit_lengths
from distserve.analyzer.observation import JointLengths, Observation
from distserve.analyzer.observe import RECENT_SHARE, dispersion_cv
from distserve.simulator import SLO
from distserve.workload import load_lengths
from distserve_engine.metrics import length_buckets_tokens

APPS = ("code", "chatbot", "summarization")
# (share of the day, mix at that point) pairs; the mix is linear in between.
MIX_POINTS = [
    (0.00, (1, 0, 0)), (0.27, (1, 0, 0)), (0.40, (0, 0, 1)), (0.60, (0, 0, 1)),
    (0.67, (0, 1, 0)), (0.83, (0, 1, 0)), (0.90, (0, 0, 1)), (1.00, (0, 0, 1)),
]
BURST_AT, BURST_SHARE, BURST_FACTOR = 0.75, 0.03, 2.0  # start and length (share of day)
SUB_WINDOW_S = 30.0  # counts per sub-window give the burstiness


@dataclass(frozen=True)
class Traffic:
    """Every request of the day as columns, sorted by arrival."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    app: np.ndarray  # index into APPS

    def between(self, start_s: float, end_s: float) -> np.ndarray:
        """Indices of the requests arriving in [start_s, end_s)."""
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s], side="left")
        return np.arange(lo, hi)


def mix_at(share: float) -> np.ndarray:
    """The application mix (code, chatbot, summarization) at this share of the day."""
    for (s0, m0), (s1, m1) in zip(MIX_POINTS, MIX_POINTS[1:], strict=False):
        if s0 <= share <= s1:
            w = 0.0 if s1 == s0 else (share - s0) / (s1 - s0)
            return (1 - w) * np.array(m0, float) + w * np.array(m1, float)
    return np.array(MIX_POINTS[-1][1], float)


def rate_at(share: float, base_rps: float) -> float:
    """Requests per second: base at both ends of the day, 3 x base at noon, and the burst."""
    rate = base_rps * (1.0 + 2.0 * (1.0 - math.cos(2 * math.pi * share)) / 2.0)
    if BURST_AT <= share < BURST_AT + BURST_SHARE:
        rate *= BURST_FACTOR
    return rate


def make_traffic(day_s: float, base_rps: float, seed: int) -> Traffic:
    """The day's requests: Poisson arrivals second by second, lengths by the mix."""
    rng = np.random.default_rng(seed)
    samples = [load_lengths(app) for app in APPS]
    arrivals, apps = [], []
    for second in range(int(day_s)):
        share = second / day_s
        count = rng.poisson(rate_at(share, base_rps))
        arrivals.append(second + np.sort(rng.random(count)))
        apps.append(rng.choice(len(APPS), count, p=mix_at(share)))
    arrival_s, app = np.concatenate(arrivals), np.concatenate(apps)
    prompts, outputs = np.empty(len(app), np.int64), np.empty(len(app), np.int64)
    for i, sample in enumerate(samples):
        mine = app == i
        pick = rng.integers(0, len(sample), int(mine.sum()))
        prompts[mine], outputs[mine] = sample.prompt_tokens[pick], sample.output_tokens[pick]
    return Traffic(arrival_s, prompts, outputs, app)


def histogram(lengths: np.ndarray, max_model_len: int) -> tuple[tuple[float, ...], np.ndarray]:
    """The engine's histogram of these lengths: bucket bounds (+Inf last) and counts."""
    upper = (*(float(b) for b in length_buckets_tokens(max_model_len)), math.inf)
    index = np.searchsorted(np.asarray(upper[:-1]), lengths, side="left")
    return upper, np.bincount(index, minlength=len(upper)).astype(float)


@dataclass(frozen=True)
class Seen:
    """What a deployment served in a window: per-request TTFT and TPOT (NaN: not served)."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray


def observe(
    traffic: Traffic, end_s: float, window_s: float, max_model_len: int,
    served: Seen | None, slo: SLO,
) -> Observation:
    """The window [end_s - window_s, end_s) as the analyzer reads it from Prometheus."""
    start_s = max(0.0, end_s - window_s)
    index = traffic.between(start_s, end_s)
    span_s = end_s - start_s
    counts = np.histogram(traffic.arrival_s[index],
                          bins=np.arange(start_s, end_s + 1e-9, SUB_WINDOW_S))[0]
    cv = dispersion_cv(counts)
    recent_counts = counts[len(counts) - int(round(span_s / RECENT_SHARE / SUB_WINDOW_S)):]
    fields = {}
    if served is not None and len(served.ttft_s):
        with np.errstate(invalid="ignore"):
            ttft_ok = served.ttft_s <= slo.ttft_s
            tpot_ok = served.tpot_s <= slo.tpot_s
        fields = dict(
            ttft_attainment=float(ttft_ok.mean()), tpot_attainment=float(tpot_ok.mean()),
            attainment=float((ttft_ok & tpot_ok).mean()),
            ttft_p90_s=_p90(served.ttft_s), tpot_p90_s=_p90(served.tpot_s),
        )
    recent_s = span_s / RECENT_SHARE

    def part(start_s: float, stop_s: float, **more) -> Observation:
        """Arrivals and lengths of [start_s, stop_s), as Prometheus holds them."""
        part_index = traffic.between(start_s, stop_s)
        prompts, outputs = traffic.prompt_tokens[part_index], traffic.output_tokens[part_index]
        return Observation(
            end_s=stop_s, window_s=stop_s - start_s, num_requests=len(part_index),
            arrival_rate_rps=len(part_index) / (stop_s - start_s),
            prompt=fit_lengths(*histogram(prompts, max_model_len)),
            output=fit_lengths(*histogram(outputs, max_model_len)),
            joint=JointLengths.of_lengths(prompts, outputs, max_model_len), **more)

    return part(
        start_s, end_s, arrival_cv=cv, arrival_counts=tuple(float(c) for c in counts),
        subwindow_s=SUB_WINDOW_S,
        recent=part(end_s - recent_s, end_s, arrival_cv=cv,
                    arrival_counts=tuple(float(c) for c in recent_counts),
                    subwindow_s=SUB_WINDOW_S),
        previous=part(end_s - 2 * recent_s, end_s - recent_s, arrival_cv=None),
        **fields,
    )


def _p90(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(np.percentile(finite, 90)) if len(finite) else None
