"""Whether the traffic of one window differs from another's enough to reconsider the plan.

A shift needs both a size and a significance, so that neither noise in a small window
nor a negligible change in a large one moves a deployment:
- the length mix (prompt or output) shifted when a chi-square test of homogeneity on
  the two windows' binned counts rejects "same distribution" at `p_value` AND the
  mean moved by at least `min_mean_change` (relative);
- the rate shifted when it moved by at least `min_rate_change` AND a test on the two
  arrival counts (conditional binomial, the counts deflated by the burstiness CV^2,
  since bursty arrivals vary more than Poisson ones) rejects "same rate".
The decision (`decide.py`) then applies hysteresis; this module judges one pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distserve.analyzer.observation import LengthFit, Observation

MIN_MERGED_COUNT = 10.0  # adjacent buckets are merged until each column holds this many


@dataclass(frozen=True)
class ShiftThresholds:
    """How large and how significant a change must be to count as a shift."""

    p_value: float = 0.01  # significance of the homogeneity and rate tests
    min_mean_change: float = 0.2  # relative change of a mean length (0.2 = 20%)
    min_rate_change: float = 0.25  # relative change of the arrival rate


@dataclass(frozen=True)
class ShiftVerdict:
    """How the current window differs from the previous one, and whether it is a shift."""

    is_rate_shifted: bool
    is_mix_shifted: bool  # the prompt or the output length distribution
    rate_change: float  # current / previous - 1
    prompt_mean_change: float | None  # None: a window had no length histogram
    output_mean_change: float | None
    prompt_p_value: float | None  # None: no test possible (bounds differ, no counts)
    output_p_value: float | None
    rate_p_value: float | None

    @property
    def is_shifted(self) -> bool:
        """Whether anything shifted."""
        return self.is_rate_shifted or self.is_mix_shifted

    def describe(self) -> str:
        """One line for a user: what changed and how surely."""
        parts = [f"rate {self.rate_change:+.0%}" + _p(self.rate_p_value)]
        if self.prompt_mean_change is not None:
            parts.append(f"prompt mean {self.prompt_mean_change:+.0%}" + _p(self.prompt_p_value))
        if self.output_mean_change is not None:
            parts.append(f"output mean {self.output_mean_change:+.0%}" + _p(self.output_p_value))
        return ", ".join(parts)


def _p(p_value: float | None) -> str:
    return "" if p_value is None else f" (p={p_value:.2g})"


def homogeneity_p_value(previous: LengthFit, current: LengthFit) -> float | None:
    """p-value of a chi-square test that both windows' counts come from one distribution;
    None when the histograms have different buckets or too few counts to test."""
    import scipy.stats

    if previous.bucket_upper_tokens != current.bucket_upper_tokens:
        return None
    table = _merged(np.array([previous.bucket_counts, current.bucket_counts], dtype=float))
    if table.shape[1] < 2 or np.any(table.sum(axis=1) <= 0):
        return None
    return float(scipy.stats.chi2_contingency(table, correction=False).pvalue)


def _merged(table: np.ndarray) -> np.ndarray:
    """Columns (buckets) merged left to right until each holds MIN_MERGED_COUNT requests
    of both windows together, so that the chi-square approximation holds."""
    columns, pending = [], np.zeros(2)
    for column in table.T:
        pending = pending + column
        if pending.sum() >= MIN_MERGED_COUNT:
            columns.append(pending)
            pending = np.zeros(2)
    if pending.sum() > 0 and columns:
        columns[-1] = columns[-1] + pending
    elif pending.sum() > 0:
        columns.append(pending)
    return np.array(columns).T if columns else np.zeros((2, 0))


def rate_p_value(previous: Observation, current: Observation) -> float | None:
    """p-value of a test that both windows saw the same arrival rate; None without arrivals."""
    import scipy.stats

    dispersion = max(1.0, (current.arrival_cv or 1.0) ** 2, (previous.arrival_cv or 1.0) ** 2)
    n_previous = int(round(previous.num_requests / dispersion))
    n_current = int(round(current.num_requests / dispersion))
    if n_previous + n_current == 0 or previous.window_s <= 0 or current.window_s <= 0:
        return None
    share = current.window_s / (previous.window_s + current.window_s)
    return float(scipy.stats.binomtest(n_current, n_previous + n_current, share).pvalue)


def _mean_change(previous: LengthFit | None, current: LengthFit | None) -> float | None:
    if previous is None or current is None or previous.mean_tokens <= 0:
        return None
    return current.mean_tokens / previous.mean_tokens - 1.0


def is_shifted(
    previous: Observation, current: Observation, thresholds: ShiftThresholds | None = None
) -> ShiftVerdict:
    """Judge current against previous (the window the plan was made or last checked for)."""
    thresholds = thresholds or ShiftThresholds()
    rate_change = (
        current.arrival_rate_rps / previous.arrival_rate_rps - 1.0
        if previous.arrival_rate_rps > 0 else float("inf")
    )
    rate_p = rate_p_value(previous, current)
    is_rate_shifted = abs(rate_change) >= thresholds.min_rate_change and (
        rate_p is None or rate_p < thresholds.p_value
    )
    changes, p_values, is_mix_shifted = [], [], False
    for name in ("prompt", "output"):
        before, after = getattr(previous, name), getattr(current, name)
        change = _mean_change(before, after)
        p_value = homogeneity_p_value(before, after) if before and after else None
        changes.append(change)
        p_values.append(p_value)
        is_significant = p_value is None or p_value < thresholds.p_value
        if change is not None and abs(change) >= thresholds.min_mean_change and is_significant:
            is_mix_shifted = True
    return ShiftVerdict(
        is_rate_shifted, is_mix_shifted, rate_change, changes[0], changes[1],
        p_values[0], p_values[1], rate_p,
    )
