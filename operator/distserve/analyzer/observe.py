"""One window of traffic, read from Prometheus, as an `Observation`.

Every figure comes from the series the router exports (`distserve_engine.metrics`),
summed over the deployment's routers and instances that match the selector:
- arrivals: the increase of `distserve_requests_arrived_total` over the window (refused
  requests included); the rate is that over `window_s`;
- burstiness: the counter's raw values every `subwindow_s` give arrivals per
  sub-window (kept as `arrival_counts`: the window as it came); for a renewal process
  the counts' index of dispersion (variance / mean) tends to the squared coefficient of
  variation of the gaps, so `arrival_cv` is its square root (1 for Poisson), the
  variance read from successive differences (`dispersion_cv`). A sub-window that spans
  a counter reset is left out.
  Arrivals, the length histograms and the attainment over the window's last third make
  `recent`: where a rising rate or a shift of the length mix under way is now, which the
  window lags, and the service after a reshuffle early in the window; arrivals and
  lengths over the third before it make `previous` (the mix's latest trend);
- lengths: the increase of each bucket of `vllm:request_prompt_tokens` and
  `vllm:request_generation_tokens`, fitted by `fit.py` (interval-censored maximum
  likelihood over a few `scipy.stats` families), and of
  `distserve_request_generation_tokens_by_prompt` by prompt class: how they pair;
- service: attainment from `distserve_slo_met_requests_total` over
  `distserve_requests_total`, p90 TTFT and TPOT, p90 queue time per phase, mean KV
  usage per role, and the plan served (`distserve_plan_info`, the router's first).

The queries run concurrently, each off the event loop (`prometheus.py`); the fits run
in a worker thread too. Any failure of Prometheus raises `PrometheusError`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping

import numpy as np
import scipy.stats

from distserve.analyzer.fit import fit_lengths
from distserve.analyzer.observation import (
    JointLengths,
    LengthFit,
    Observation,
    PhaseObservation,
)
from distserve.analyzer.prometheus import PrometheusClient, Sample, finite_or_none

DEFAULT_WINDOW_S = 900.0  # 15 minutes
RECENT_SHARE = 3  # `recent` is the window's last 1/RECENT_SHARE
NUM_SUBWINDOWS = 30  # sub-windows of the burstiness estimate (at least MIN_SUBWINDOW_S each)
MIN_SUBWINDOW_S = 2.0  # a sub-window spans at least a couple of scrapes
MIN_SUBWINDOWS_FOR_CV = 3
TRIM_SHARE = 0.1  # the largest successive differences the burstiness leaves out
PHASE_ROLES = ("prefill", "decode", "colocated")


def label_selector(labels: Mapping[str, str]) -> str:
    """`{k="v",...}` with the values escaped; `labels` must name at least the deployment."""
    if not labels:
        raise ValueError("selector: give at least one label, e.g. {'deployment': NAME}")
    parts = []
    for key, value in labels.items():
        if not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise ValueError(f"selector: {key!r} is not a Prometheus label name")
        escaped = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{key}="{escaped}"')
    return "{" + ",".join(parts) + "}"


def window_queries(selector: str, window_s: float) -> dict[str, str]:
    """The instant queries of one window, by name (evaluated at the window's end)."""
    w = f"[{int(math.ceil(window_s))}s]"

    def inc(name: str, by: str = "") -> str:
        return f"sum{f' by ({by})' if by else ''} (increase({name}{selector}{w}))"

    def p90(name: str, by: str = "le") -> str:
        return f"histogram_quantile(0.9, {inc(name + '_bucket', by)})"

    return {
        "arrived": inc("distserve_requests_arrived_total"),
        "refused": inc("distserve_requests_rejected_total"),
        "finished": inc("distserve_requests_total"),
        "slo_met": inc("distserve_slo_met_requests_total", "slo"),
        "prompt": inc("vllm:request_prompt_tokens_bucket", "le"),
        "output": inc("vllm:request_generation_tokens_bucket", "le"),
        "joint": inc("distserve_request_generation_tokens_by_prompt_bucket", "prompt_le, le"),
        "ttft_p90": p90("vllm:time_to_first_token_seconds"),
        "tpot_p90": p90("vllm:time_per_output_token_seconds"),
        "queue_p90": p90("distserve_queue_time_seconds", "le, phase"),
        "kv_usage": f"avg by (role) (avg_over_time(vllm:kv_cache_usage_perc{selector}{w}))",
        "plan": f"max by (plan_id, role) (distserve_plan_info{selector})",
    }


def bucket_counts(samples: list[Sample]) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """Per-bucket counts (not cumulative) by upper bound, +Inf last; None without buckets."""
    by_le = sorted((float(s.labels["le"]), s.value) for s in samples
                   if "le" in s.labels and math.isfinite(s.value))
    if not by_le:
        return None
    upper = tuple(le for le, _ in by_le)
    cumulative = np.maximum.accumulate(np.maximum([c for _, c in by_le], 0.0))
    counts = np.diff(cumulative, prepend=0.0)
    return upper, tuple(float(c) for c in counts)


def joint_counts(samples: list[Sample]) -> JointLengths | None:
    """The joint histogram (per prompt class, per output bucket) from its cumulative buckets
    by `prompt_le` and `le`; None without them or when the classes' buckets differ."""
    by_class: dict[float, list[Sample]] = {}
    for sample in samples:
        if "prompt_le" in sample.labels:
            by_class.setdefault(float(sample.labels["prompt_le"]), []).append(sample)
    rows = {upper: bucket_counts(group) for upper, group in sorted(by_class.items())}
    if not rows or any(row is None for row in rows.values()):
        return None
    output_upper = {row[0] for row in rows.values()}
    if len(output_upper) != 1:
        return None
    return JointLengths(tuple(rows), output_upper.pop(),
                        tuple(row[1] for row in rows.values()))


def dispersion_cv(counts: list[float] | np.ndarray) -> float | None:
    """sqrt(variance / mean) of arrivals per sub-window: the gaps' CV of a renewal process.

    The variance is half the mean square of successive differences, so that a rate moving
    within the window (the morning's climb) is not read as burstiness: the plain variance
    of the counts holds the rate's own spread too, and read a Poisson stream under a 2x
    burst as CV 3-4. The largest `TRIM_SHARE` of the squared differences (a step of the
    rate: a burst's start and end) are left out, and the rest scaled up as for normal
    differences (for X ~ chi2(1), E[X; X < q] = P(chi2(3) < q))."""
    counts = np.asarray(counts, dtype=float)
    if len(counts) < MIN_SUBWINDOWS_FOR_CV or counts.mean() <= 0:
        return None
    squares = np.sort(np.diff(counts) ** 2)
    kept = len(squares) - int(TRIM_SHARE * len(squares))
    share = kept / len(squares)
    scale = 1.0 if kept == len(squares) else float(
        scipy.stats.chi2(3).cdf(scipy.stats.chi2(1).ppf(share)) / share)
    return float(math.sqrt(squares[:kept].mean() / 2.0 / scale / counts.mean()))


def subwindow_counts(points: tuple[tuple[float, float], ...]) -> list[float]:
    """Arrivals between consecutive points of a counter; a drop (a reset) is left out."""
    values = [v for _, v in points]
    return [b - a for a, b in zip(values, values[1:], strict=False) if b >= a]


def _one(samples: list[Sample]) -> float | None:
    return finite_or_none(samples[0].value) if samples else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return min(1.0, num / den) if num is not None and den else None


def _plan_id(samples: list[Sample]) -> str | None:
    """The router's plan (the one requests are routed under), else any instance's."""
    ranked = sorted((s.labels.get("role") != "router", s.labels.get("plan_id", "")) for s in samples
                    if s.value > 0 and s.labels.get("plan_id"))
    return ranked[0][1] if ranked else None


def _phases(queue: list[Sample], kv: list[Sample]) -> dict[str, PhaseObservation]:
    queue_by = {s.labels.get("phase"): finite_or_none(s.value) for s in queue}
    kv_by = {s.labels.get("role"): finite_or_none(s.value) for s in kv}
    phases = {}
    for phase in PHASE_ROLES:
        queue_s, kv_usage = queue_by.get(phase), kv_by.get(phase)
        if queue_s is not None or kv_usage is not None:
            phases[phase] = PhaseObservation(queue_time_p90_s=queue_s, kv_usage_mean=kv_usage)
    return phases


async def observe(client: PrometheusClient, labels: Mapping[str, str],
                  window_s: float = DEFAULT_WINDOW_S, end_s: float | None = None,
                  subwindow_s: float | None = None) -> Observation:
    """What the deployment matching `labels` saw over `[end_s - window_s, end_s]` (end: now)."""
    if not window_s > 0:
        raise ValueError(f"window_s: must be > 0, got {window_s}")
    end_s = time.time() if end_s is None else end_s
    selector = label_selector(labels)
    sub_s = subwindow_s or max(MIN_SUBWINDOW_S, window_s / NUM_SUBWINDOWS)
    recent_s = window_s / RECENT_SHARE
    queries = window_queries(selector, window_s)
    recent_queries = {f"recent_{name}": query
                      for name, query in window_queries(selector, recent_s).items()
                      if name in ("arrived", "prompt", "output", "joint", "finished",
                                  "slo_met")}
    queries.update(recent_queries)
    names = list(queries)
    previous_names = ("arrived", "prompt", "output", "joint")  # the third before `recent`
    answers = await asyncio.gather(
        *(client.aquery(queries[n], end_s) for n in names),
        *(client.aquery(queries[f"recent_{n}"], end_s - recent_s) for n in previous_names),
        client.aquery_range(f"sum(distserve_requests_arrived_total{selector})",
                            end_s - window_s, end_s, sub_s))
    got = dict(zip(names, answers[:len(names)], strict=True))
    got.update(zip((f"previous_{n}" for n in previous_names), answers[len(names):-1], strict=True))
    arrived = _one(got["arrived"]) or 0.0
    finished = _one(got["finished"])
    met = {s.labels.get("slo"): finite_or_none(s.value) for s in got["slo_met"]}
    counts = subwindow_counts(answers[-1][0].points) if answers[-1] else []
    prompt, output, recent_prompt, recent_output, previous_prompt, previous_output = (
        await asyncio.gather(*(asyncio.to_thread(_fit, got[n]) for n in (
            "prompt", "output", "recent_prompt", "recent_output", "previous_prompt",
            "previous_output"))))
    previous_arrived = _one(got["previous_arrived"]) or 0.0
    previous = Observation(
        end_s=end_s - recent_s, window_s=recent_s, num_requests=int(round(previous_arrived)),
        arrival_rate_rps=previous_arrived / recent_s, arrival_cv=None,
        prompt=previous_prompt, output=previous_output, joint=joint_counts(got["previous_joint"]),
    )
    recent_arrived = _one(got["recent_arrived"]) or 0.0
    recent_finished = _one(got["recent_finished"])
    recent_met = {s.labels.get("slo"): finite_or_none(s.value) for s in got["recent_slo_met"]}
    recent_counts = counts[max(0, len(counts) - int(round(recent_s / sub_s))):]
    recent = Observation(
        end_s=end_s, window_s=recent_s, num_requests=int(round(recent_arrived)),
        arrival_rate_rps=recent_arrived / recent_s, arrival_cv=dispersion_cv(counts),
        arrival_counts=tuple(recent_counts), subwindow_s=sub_s,
        prompt=recent_prompt, output=recent_output, joint=joint_counts(got["recent_joint"]),
        ttft_attainment=_ratio(recent_met.get("ttft"), recent_finished),
        tpot_attainment=_ratio(recent_met.get("tpot"), recent_finished),
        attainment=_ratio(recent_met.get("both"), recent_finished),
    )
    return Observation(
        end_s=end_s, window_s=window_s,
        num_requests=int(round(arrived)),
        arrival_rate_rps=arrived / window_s,
        arrival_cv=dispersion_cv(counts), arrival_counts=tuple(counts), subwindow_s=sub_s,
        prompt=prompt, output=output, joint=joint_counts(got["joint"]),
        ttft_attainment=_ratio(met.get("ttft"), finished),
        tpot_attainment=_ratio(met.get("tpot"), finished),
        attainment=_ratio(met.get("both"), finished),
        ttft_p90_s=_one(got["ttft_p90"]),
        tpot_p90_s=_one(got["tpot_p90"]),
        num_refused=int(round(_one(got["refused"]) or 0.0)),
        phases=_phases(got["queue_p90"], got["kv_usage"]),
        plan_id=_plan_id(got["plan"]),
        recent=recent,
        previous=previous,
    )


def _fit(samples: list[Sample]) -> LengthFit | None:
    buckets = bucket_counts(samples)
    return fit_lengths(*buckets) if buckets is not None else None
