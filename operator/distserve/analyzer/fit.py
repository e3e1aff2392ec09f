"""Length distributions fitted to a Prometheus histogram's binned counts.

The engine exports request lengths as histograms (`vllm:request_prompt_tokens`,
`vllm:request_generation_tokens`), so the analyzer sees how many requests fell in each
bucket, never the lengths themselves. A fit here is maximum likelihood on those counts
with the buckets as censoring intervals: a bucket of `n` requests between bounds `lo`
and `hi` contributes `n * log(F(hi) - F(lo))`. Lengths are integers and
`LengthFit.sample` rounds a draw to the nearest integer (at least 1), so the bucket of
integers `(lo, hi]` is the continuous interval `(lo + 0.5, hi + 0.5]` (the first starts
at 0); the fit and the sampler agree on what a bucket holds.

Each family of `FAMILIES` (two parameters, location fixed at 0) is fitted, and the one
of highest likelihood is kept; with the same number of parameters that is also the
lowest AIC. A family is started from the moments of a log-normal fitted to the buckets'
geometric midpoints and refined with Nelder-Mead on the log of its parameters.

No two-parameter family holds a mixture of workloads (short code prompts beside long
summarization ones while traffic moves from one to the other): the best of them put
the mean of such a window's prompts 20% low. So the kept family is held against the
histogram itself (`HISTOGRAM`: each bucket's share spread evenly over its integers, as
`scipy.stats.rv_histogram` does; its likelihood is the highest any model reaches on
these counts), and the one of lower BIC wins: the histogram's free parameters are its
buckets with counts less one, so a small or well-fitted window keeps the smooth
family, and a large window the family cannot describe keeps its own shape. A window
with counts above the last finite bound (+Inf) always gets a family: the histogram
has no upper end there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from distserve.analyzer.observation import LengthFit

FAMILIES = ("lognorm", "gamma", "weibull_min")
HISTOGRAM = "histogram"  # `LengthFit.family` of a fit that is the histogram's own shape
MIN_PROBABILITY = 1e-300  # a bucket the fit gives no mass costs log(1e-300), not -inf


def bucket_intervals(bucket_upper_tokens: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The continuous (lo, hi] of each bucket: integers `(le_prev, le]` widened by 0.5."""
    upper = np.asarray(bucket_upper_tokens, dtype=float)
    hi = np.where(np.isinf(upper), np.inf, upper + 0.5)
    lo = np.concatenate([[0.0], hi[:-1]])
    return lo, hi


def check_histogram(bucket_upper_tokens: Sequence[float], bucket_counts: Sequence[float]) -> None:
    """Raise ValueError naming the problem when the buckets cannot be fitted."""
    upper = np.asarray(bucket_upper_tokens, dtype=float)
    counts = np.asarray(bucket_counts, dtype=float)
    if upper.shape != counts.shape or upper.ndim != 1 or len(upper) == 0:
        raise ValueError(f"histogram: {len(upper)} bucket bounds but {len(counts)} counts")
    if not np.all(np.diff(upper) > 0) or upper[0] <= 0:
        raise ValueError(f"histogram: bucket bounds must be positive and increasing, got {upper.tolist()}")
    if np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise ValueError(f"histogram: counts must be finite and >= 0, got {counts.tolist()}")


def log_likelihood(family: str, params: Sequence[float], bucket_upper_tokens: Sequence[float],
                   bucket_counts: Sequence[float]) -> float:
    """The interval-censored log-likelihood of (shape, scale) on the binned counts."""
    shape, scale = params
    return _log_likelihood(family, shape, scale, *bucket_intervals(bucket_upper_tokens),
                           np.asarray(bucket_counts, dtype=float))


def _tails(
    family: str, shape: float, scale: float, x: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float]:
    """The family's CDF and survival function at x, and its median: `scipy.stats`'s own
    formulas through `scipy.special`, without building a frozen distribution (its
    argument checks and docstring took most of a fit's time)."""
    from scipy import special

    z = x / scale
    if family == "lognorm":
        with np.errstate(divide="ignore"):
            u = np.log(z) / shape
        return special.ndtr(u), special.ndtr(-u), scale
    if family == "gamma":
        return (special.gammainc(shape, z), special.gammaincc(shape, z),
                scale * float(special.gammaincinv(shape, 0.5)))
    if family == "weibull_min":
        power = z**shape
        return -np.expm1(-power), np.exp(-power), scale * math.log(2.0) ** (1.0 / shape)
    raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")


def _log_likelihood(family: str, shape: float, scale: float, lo: np.ndarray, hi: np.ndarray,
                    counts: np.ndarray) -> float:
    # NOTE: a bucket's mass is taken from the survival function in the upper tail
    # and from the CDF below it, so neither end loses it to rounding near 1.
    cdf, sf, median = _tails(family, shape, scale, np.concatenate([lo, hi]))
    n = len(lo)
    mass = np.where(lo > median, sf[:n] - sf[n:], cdf[n:] - cdf[:n])
    used = counts > 0
    return float(np.sum(counts[used] * np.log(np.maximum(mass[used], MIN_PROBABILITY))))


def _start(family: str, lo: np.ndarray, hi: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(log shape, log scale) from the buckets' log-midpoints' mean and spread."""
    top = np.where(np.isinf(hi), np.maximum(lo, 1.0) * 2.0, hi)
    mid = np.log(np.sqrt(np.maximum(lo, 0.5) * top))
    mu = float(np.average(mid, weights=counts))
    sigma = max(math.sqrt(float(np.average((mid - mu) ** 2, weights=counts))), 0.05)
    mean = math.exp(mu + sigma**2 / 2)
    cv = math.sqrt(math.expm1(sigma**2))
    if family == "lognorm":
        return np.log([sigma, math.exp(mu)])
    if family == "gamma":
        shape = 1.0 / cv**2
        return np.log([shape, mean / shape])
    if family == "weibull_min":
        shape = 1.2 / max(sigma, 0.05)  # a Weibull's log has sd ~ 1.28 / shape
        return np.log([shape, mean / math.gamma(1.0 + 1.0 / shape)])
    raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")


def fit_family(family: str, bucket_upper_tokens: Sequence[float],
               bucket_counts: Sequence[float]) -> tuple[tuple[float, float], float]:
    """Maximum-likelihood (shape, scale) of one family on the binned counts, and its log-likelihood."""
    from scipy.optimize import minimize

    check_histogram(bucket_upper_tokens, bucket_counts)
    lo, hi = bucket_intervals(bucket_upper_tokens)
    counts = np.asarray(bucket_counts, dtype=float)

    def cost(log_params: np.ndarray) -> float:
        if np.any(np.abs(log_params) > 30):
            return math.inf
        return -_log_likelihood(family, *np.exp(log_params), lo, hi, counts)

    result = minimize(cost, _start(family, lo, hi, counts), method="Nelder-Mead",
                      options={"xatol": 1e-6, "fatol": 1e-6, "maxiter": 2000})
    shape, scale = np.exp(result.x)
    return (float(shape), float(scale)), -float(result.fun)


def fit_lengths(bucket_upper_tokens: Sequence[float], bucket_counts: Sequence[float],
                families: Sequence[str] = FAMILIES, with_histogram: bool = True) -> LengthFit | None:
    """The family of highest likelihood on the binned counts, or the histogram's own shape
    where its BIC is lower (see the module docstring); None when no request was counted."""
    check_histogram(bucket_upper_tokens, bucket_counts)
    counts = np.asarray(bucket_counts, dtype=float)
    total = float(np.sum(counts))
    if total <= 0:
        return None
    best: tuple[float, str, tuple[float, float]] | None = None
    for family in families:
        params, ll = fit_family(family, bucket_upper_tokens, bucket_counts)
        if best is None or ll > best[0]:
            best = (ll, family, params)
    best_ll, family, (shape, scale) = best
    upper = tuple(float(u) for u in bucket_upper_tokens)
    kept = tuple(float(c) for c in bucket_counts)
    if with_histogram and _histogram_wins(best_ll, counts, upper, total):
        fit = LengthFit(HISTOGRAM, (), 0.0, 0.0, 0.0, upper, kept)
    else:
        fit = LengthFit(family, (shape, 0.0, scale), 0.0, 0.0, 0.0, upper, kept)  # scipy.stats order
    dist = fit.distribution()
    return replace(fit, mean_tokens=float(dist.mean()), p50_tokens=float(dist.ppf(0.5)),
                   p90_tokens=float(dist.ppf(0.9)))


def _histogram_wins(family_ll: float, counts: np.ndarray, upper: tuple[float, ...],
                    total: float) -> bool:
    """Whether the histogram's BIC is below the family's (2 parameters) on these counts."""
    if math.isinf(upper[-1]) and counts[-1] > 0:
        return False
    used = counts[counts > 0]
    histogram_ll = float(np.sum(used * np.log(used / total)))
    penalty = (len(used) - 1 - 2) * math.log(total)
    return 2.0 * (histogram_ll - family_ll) > penalty
