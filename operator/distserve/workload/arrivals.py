"""Arrival processes: when requests come, at a given mean rate.

Poisson arrivals have exponential gaps (coefficient of variation 1). Gamma gaps with a
coefficient of variation cv model bursts (cv > 1) or smoother traffic (cv < 1) at the
same mean rate. A trace's own gaps can be replayed scaled to any mean rate.
"""

from __future__ import annotations

import numpy as np


def _check(rate_rps: float, num_requests: int) -> None:
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be positive, got {rate_rps}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be non-negative, got {num_requests}")


def poisson_arrivals(rate_rps: float, num_requests: int, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of a Poisson process, starting after the first gap."""
    _check(rate_rps, num_requests)
    return np.cumsum(rng.exponential(1.0 / rate_rps, num_requests))


def gamma_arrivals(
    rate_rps: float, num_requests: int, cv: float, rng: np.random.Generator
) -> np.ndarray:
    """Arrival times (s) whose gaps are gamma distributed with mean 1/rate and this cv."""
    _check(rate_rps, num_requests)
    if cv <= 0:
        raise ValueError(f"cv must be positive, got {cv}")
    shape = 1.0 / cv**2  # a gamma's cv is 1 / sqrt(shape)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate_rps * shape), num_requests))


def scaled_trace_arrivals(
    gaps_s: np.ndarray, rate_rps: float, num_requests: int, start: int = 0
) -> np.ndarray:
    """A trace's inter-arrival gaps, cycled from `start` and scaled to this mean rate."""
    _check(rate_rps, num_requests)
    mean_gap_s = float(np.mean(gaps_s))
    if mean_gap_s <= 0:
        raise ValueError("a trace whose requests all arrive at once has no rate to scale")
    index = (start + np.arange(num_requests)) % len(gaps_s)
    return np.cumsum(gaps_s[index] / (mean_gap_s * rate_rps))
