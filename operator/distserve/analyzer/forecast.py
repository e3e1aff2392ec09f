"""Where the traffic will be while a plan chosen now serves: the window's trend carried forward.

A plan chosen at the end of a window serves from when its weights have loaded until the
next decision can correct it, `intervalSeconds + reloadSeconds` ahead. Judging it on
the window alone lags a rising rate or a length mix under way by half a window; the
observation also holds the window's last third (`recent`), and the rest of the window is
its older part. Their midpoints are half a window apart, so their difference per half
window is the trend, and carried from the recent midpoint to the end of the horizon it
gives the traffic there:
- the rate, when the older and the recent rate differ significantly (the shift test's
  rate test, so Poisson noise is no trend); never below the recent rate nor above
  `MAX_RATE_GROWTH` times it;
- the lengths: the recent part's, where the mix is now (a plan sized on the window's
  average mix can sit on a cliff the recent mix is already past); when the recent mix
  differs from the window's (the shift test, with `TREND_THRESHOLDS`: significant, and
  the mean moved by 5%), each histogram bucket's share carried forward along its trend
  and fitted as the observation's own histograms are. The trend is the recent part's
  against the third before it (`previous`, midpoints a third apart) where that holds
  `MIN_RECENT_REQUESTS`, else against the older part: a shift that began within the
  window is carried at its own pace, not diluted by the minutes before it began (at the
  benchmark's code -> summarization ramp, 5 minutes in, the older part read 515 prompt
  tokens ahead where 931 came; the last two thirds read 619). Where the third before the
  recent part is no trend against the window's first third, the shift began within the
  recent part: a ramp from its start has twice its average share at its end, so the
  trend is twice the difference (at that ramp's minute 45, seed 2, the horizon's mix
  read 628 prompt tokens carried at the difference, 886 at twice it, where ~1150 came
  by the horizon's end). A mix moving from one workload to another is a mixture whose
  weight moves; carried past the point where a bucket the old workload held runs empty
  it would invent a workload heavier than the new one, so the carry stops there: where
  the old workload's buckets (those of at least `MIN_BUCKET_SHARE` of the older part
  that shrink) run empty together. Each of them alone empties at its own step, and the
  first of those is noise's pick: stopped at the first, the carry of the replanning
  benchmark's code -> summarization ramp read 933 prompt tokens as the destination at
  minute 45 (seed 2), together 1038, and the plan sized at the first was outgrown five
  minutes later. Smaller buckets neither stop the carry nor count towards it, and end
  at zero: a small bucket the two workloads share empties long before the old
  workload's own buckets do. The joint histogram's cells (which prompts had which
  outputs) are carried the same way. The window's lengths stand when the recent part
  holds fewer than `MIN_RECENT_REQUESTS`.
The extrapolation is at most `MAX_STEPS` half windows: past that a trend is a guess.
A mix under way is also carried `DESTINATION_S` on (`destination`), where the same stop
at the old workload's emptied buckets makes it the new workload: where the shift leads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from distserve.analyzer.fit import fit_lengths
from distserve.analyzer.observation import JointLengths, LengthFit, Observation
from distserve.analyzer.shift import ShiftThresholds, is_shifted, rate_p_value

MAX_STEPS = 1.5  # half windows a trend is carried past the recent part's midpoint
MAX_RATE_GROWTH = 2.0  # the forecast rate is at most this times the recent rate
MIN_RECENT_REQUESTS = 100  # fewer in the recent part: its lengths are too noisy to use
TREND_THRESHOLDS = ShiftThresholds(min_mean_change=0.05)  # a mix trend worth carrying
MIN_BUCKET_SHARE = 0.1  # an older bucket's share below this does not stop the carry
DESTINATION_S = 1800.0  # how far ahead a mix under way is carried for `destination`


@dataclass(frozen=True)
class Forecast:
    """The traffic at the end of the horizon, and what it was carried from."""

    rate_rps: float  # arrivals per second (the recent rate when no trend is significant)
    workload: Observation  # the observation with the lengths ahead (its own when no mix shift)
    steps: float  # half windows carried past the recent midpoint (0: no recent part)
    is_rate_trend: bool
    is_mix_trend: bool
    # with a mix under way: the lengths where it leads, carried DESTINATION_S past the
    # recent midpoint (or until the old workload's buckets run empty, as `workload` is)
    destination: Observation | None = None


def forecast(
    observation: Observation, horizon_s: float, thresholds: ShiftThresholds | None = None,
) -> Forecast:
    """The traffic `horizon_s` after the window's end (see the module docstring)."""
    recent = observation.recent
    if recent is None or recent.window_s <= 0 or recent.window_s >= observation.window_s:
        return Forecast(observation.arrival_rate_rps, observation, 0.0, False, False)
    thresholds = thresholds or ShiftThresholds()
    older = _window_less(observation, recent)
    half_window_s = observation.window_s / 2  # the two parts' midpoints are this far apart
    steps = min(MAX_STEPS, (recent.window_s / 2 + max(0.0, horizon_s)) / half_window_s)
    rate_rps = recent.arrival_rate_rps
    p_value = rate_p_value(older, recent)
    is_rate_trend = p_value is not None and p_value < thresholds.p_value
    if is_rate_trend:
        carried = rate_rps + (rate_rps - older.arrival_rate_rps) * steps
        rate_rps = min(max(carried, rate_rps), MAX_RATE_GROWTH * rate_rps)
    workload, is_mix_trend, destination = observation, False, None
    if (recent.prompt is not None and recent.output is not None
            and recent.num_requests >= MIN_RECENT_REQUESTS):
        workload = replace(observation, prompt=recent.prompt, output=recent.output,
                           joint=recent.joint)
        if is_shifted(observation, recent, TREND_THRESHOLDS).is_mix_shifted:
            base, less_recent, step_s = observation, True, half_window_s
            previous = observation.previous
            if (previous is not None and previous.prompt is not None
                    and previous.output is not None
                    and previous.num_requests >= MIN_RECENT_REQUESTS):
                # the last two thirds: their midpoints a third apart
                base, less_recent, step_s = previous, False, recent.window_s
            mix_steps = steps * half_window_s / step_s  # as far ahead as the rate
            if not less_recent and _began_in_recent(observation, previous, recent):
                mix_steps *= 2  # a ramp from the recent part's start: twice its average
            far_steps = max(mix_steps, (recent.window_s / 2 + DESTINATION_S) / step_s)
            older = tuple(_older_counts(getattr(base, name), getattr(recent, name), less_recent)
                          for name in ("prompt", "output", "joint"))
            workload = _carried_workload(observation, recent, older, mix_steps)
            destination = _carried_workload(observation, recent, older, far_steps)
            is_mix_trend = True
    return Forecast(rate_rps, workload, steps, is_rate_trend, is_mix_trend, destination)


def _began_in_recent(observation: Observation, previous: Observation,
                     recent: Observation) -> bool:
    """Whether the mix began to move within the recent part: the third before it is no
    trend against the window's first third (the window less the two, which must hold
    `MIN_RECENT_REQUESTS`)."""
    start = _window_less(observation, previous, recent)
    if start.num_requests < MIN_RECENT_REQUESTS:
        return False
    first = {}
    for name in ("prompt", "output"):
        whole, before, last = (getattr(o, name) for o in (observation, previous, recent))
        if whole is None or before is None or last is None \
                or len({whole.bounds, before.bounds, last.bounds}) > 1:
            return False
        counts = np.maximum(np.asarray(whole.bucket_counts, dtype=float)
                            - np.asarray(before.bucket_counts, dtype=float)
                            - np.asarray(last.bucket_counts, dtype=float), 0.0)
        first[name] = fit_lengths(whole.bucket_upper_tokens, counts)
        if first[name] is None:
            return False
    return not is_shifted(replace(start, **first), previous, TREND_THRESHOLDS).is_mix_shifted


def _carried_workload(observation: Observation, recent: Observation,
                      older: tuple[np.ndarray | None, ...], steps: float) -> Observation:
    """The observation with the recent lengths carried `steps` along their trend from the
    older part's counts (`_older_counts` of the prompt, output and joint histograms)."""
    prompt_counts, output_counts, joint_counts = older
    return replace(observation, prompt=_carried(prompt_counts, recent.prompt, steps),
                   output=_carried(output_counts, recent.output, steps),
                   joint=_carried_joint(joint_counts, recent.joint, steps))


def _window_less(observation: Observation, *parts: Observation) -> Observation:
    """The window less its last parts (the recent part, or the third before it and the
    recent part): arrivals and rate only (lengths: `_carried`)."""
    taken_s = sum(part.window_s for part in parts)
    window_s = observation.window_s - taken_s
    num = max(0, observation.num_requests - sum(part.num_requests for part in parts))
    return Observation(end_s=observation.end_s - taken_s, window_s=window_s,
                       num_requests=num, arrival_rate_rps=num / window_s if window_s > 0 else 0.0,
                       arrival_cv=observation.arrival_cv, prompt=None, output=None)


def _older_counts(base: LengthFit | JointLengths | None,
                  recent: LengthFit | JointLengths | None, less_recent: bool) -> np.ndarray | None:
    """The older part's counts of one histogram: `base`'s (the third before the recent
    part), or with `less_recent` the window's less the recent part's; None when either
    histogram is missing or their bounds differ."""
    if base is None or recent is None or base.bounds != recent.bounds:
        return None
    older = np.asarray(base.cells, dtype=float)
    if less_recent:
        older = np.maximum(older - np.asarray(recent.cells, dtype=float), 0.0)
    return older


def _carried(older_counts: np.ndarray | None, recent: LengthFit, steps: float) -> LengthFit:
    """The recent histogram's bucket shares carried `steps` along their trend from the
    older part's shares; the recent fit when there is no older part to compare with."""
    if older_counts is None:
        return recent
    counts = _carried_counts(older_counts, np.asarray(recent.bucket_counts, dtype=float), steps)
    if counts is None:
        return recent
    return fit_lengths(recent.bucket_upper_tokens, counts) or recent


def _carried_joint(older_counts: np.ndarray | None, recent: JointLengths | None,
                   steps: float) -> JointLengths | None:
    """The recent joint histogram's cells carried as `_carried` carries buckets."""
    if recent is None or older_counts is None:
        return recent
    recent_counts = np.asarray(recent.counts, dtype=float)
    counts = _carried_counts(older_counts.ravel(), recent_counts.ravel(), steps)
    if counts is None:
        return recent
    return replace(recent, counts=tuple(tuple(float(c) for c in row)
                                        for row in counts.reshape(recent_counts.shape)))


def _carried_counts(older_counts: np.ndarray, recent_counts: np.ndarray,
                    steps: float) -> np.ndarray | None:
    """Counts with the recent part's total whose shares are the recent ones carried `steps`
    along the trend from the older part's; None when a part is empty."""
    if recent_counts.sum() <= 0 or older_counts.sum() <= 0:
        return None
    recent_share = recent_counts / recent_counts.sum()
    older_share = older_counts / older_counts.sum()
    trend = recent_share - older_share
    emptying = (trend < 0) & (older_share >= MIN_BUCKET_SHARE)
    if np.any(emptying):  # the carry stops where those buckets together run empty
        steps = min(steps, float(recent_share[emptying].sum() / -trend[emptying].sum()))
    ahead = np.maximum(recent_share + trend * steps, 0.0)
    return ahead / ahead.sum() * recent_counts.sum()  # as many requests as the recent part
