"""The pure parts of observing: burstiness from sub-window counts, buckets from samples, selectors."""

from __future__ import annotations

import numpy as np
import pytest

from distserve.analyzer.observe import (
    bucket_counts,
    dispersion_cv,
    label_selector,
    subwindow_counts,
    window_queries,
)
from distserve.analyzer.prometheus import Sample
from distserve.workload.arrivals import gamma_arrivals, poisson_arrivals

RATE_RPS = 10.0
NUM_REQUESTS = 60_000


def counts_per_subwindow(arrivals_s: np.ndarray, subwindow_s: float) -> np.ndarray:
    """Arrivals per sub-window, as the counter's differences give them."""
    edges = np.arange(0.0, arrivals_s[-1], subwindow_s)
    return np.diff(np.searchsorted(arrivals_s, edges))


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_dispersion_of_counts_gives_the_gaps_cv(cv):
    rng = np.random.default_rng(11)
    arrivals_s = (poisson_arrivals(RATE_RPS, NUM_REQUESTS, rng) if cv == 1.0
                  else gamma_arrivals(RATE_RPS, NUM_REQUESTS, cv, rng))
    estimate = dispersion_cv(counts_per_subwindow(arrivals_s, 30.0))  # 200 sub-windows of ~300
    assert estimate == pytest.approx(cv, rel=0.15)


@pytest.mark.parametrize("shape", ["climb", "burst"])
def test_a_rate_that_moves_within_the_window_is_not_read_as_burstiness(shape):
    # Poisson at every moment (CV 1): a climb from 2 to 6 req/s over the window, or a 2x
    # burst of 4.5 minutes in it; 30 sub-windows of 30 s, as the analyzer reads 15 minutes
    rng = np.random.default_rng(5)
    t = np.arange(30) * 30.0
    rate = 2.0 + 4.0 * t / 900.0 if shape == "climb" else np.where((t >= 300) & (t < 570), 8.0, 4.0)
    estimates, plain = [], []
    for _ in range(50):
        counts = rng.poisson(rate * 30.0).astype(float)
        estimates.append(dispersion_cv(counts))
        plain.append(float(np.sqrt(counts.var(ddof=1) / counts.mean())))
    print(f"{shape}: CV read {np.median(estimates):.2f} (p10-p90 {np.percentile(estimates, 10):.2f}-"
          f"{np.percentile(estimates, 90):.2f}); plain variance {np.median(plain):.2f}")
    assert 0.8 < np.median(estimates) < 1.3 and np.median(plain) > 2.5


def test_dispersion_needs_a_few_subwindows_with_arrivals():
    assert dispersion_cv([3.0, 4.0]) is None
    assert dispersion_cv([0.0, 0.0, 0.0]) is None
    assert dispersion_cv([5.0, 5.0, 5.0]) == 0.0  # perfectly regular


def test_subwindow_counts_leave_out_a_counter_reset():
    points = ((0.0, 10.0), (5.0, 14.0), (10.0, 2.0), (15.0, 9.0))
    assert subwindow_counts(points) == [4.0, 7.0]


def test_bucket_counts_from_cumulative_samples_in_any_order():
    samples = [Sample({"le": "+Inf"}, 10.0), Sample({"le": "2.0"}, 3.0), Sample({"le": "1.0"}, 1.0),
               Sample({"le": "5.0"}, 9.5)]
    upper, counts = bucket_counts(samples)
    assert upper == (1.0, 2.0, 5.0, float("inf"))
    assert counts == pytest.approx((1.0, 2.0, 6.5, 0.5))
    # Extrapolated increases may dip below a lower bucket's: never a negative count.
    _, counts = bucket_counts([Sample({"le": "1.0"}, 4.0), Sample({"le": "+Inf"}, 3.9)])
    assert counts == pytest.approx((4.0, 0.0))
    assert bucket_counts([]) is None


def test_selector_escapes_values_and_refuses_bad_names():
    assert label_selector({"deployment": 'a"b', "namespace": "ns"}) == '{deployment="a\\"b",namespace="ns"}'
    with pytest.raises(ValueError, match="not a Prometheus label name"):
        label_selector({"bad-name": "x"})
    queries = window_queries('{deployment="d"}', 899.5)
    assert 'increase(distserve_requests_arrived_total{deployment="d"}[900s])' in queries["arrived"]
