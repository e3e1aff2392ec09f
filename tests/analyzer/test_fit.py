"""Length fits on binned counts: the figures and the resampled lengths match known samples."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
from analyzer_factories import make_histogram

from distserve.analyzer.fit import fit_family, fit_lengths, log_likelihood
from distserve.workload.lengths import load_lengths

MAX_MODEL_LEN = 2048


def synthetic(family: str, num: int = 4000, seed: int = 0) -> np.ndarray:
    """Integer lengths drawn from a known family, within the context."""
    rng = np.random.default_rng(seed)
    dist = {"lognorm": scipy.stats.lognorm(0.8, scale=200), "gamma": scipy.stats.gamma(2.0, scale=50),
            "weibull_min": scipy.stats.weibull_min(1.5, scale=300),
            "short": scipy.stats.lognorm(0.6, scale=5)}[family]
    return np.clip(np.rint(dist.rvs(num, random_state=rng)), 1, MAX_MODEL_LEN).astype(np.int64)


CASES = {f"{name}.{kind}": (name, kind) for name in ("chatbot", "code", "summarization")
         for kind in ("prompt", "output")}
CASES.update({f"synthetic.{family}": (family, None) for family in ("lognorm", "gamma", "weibull_min", "short")})


def lengths_of(name: str, kind: str | None) -> np.ndarray:
    if kind is None:
        return synthetic(name)
    sample = load_lengths(name)
    return sample.prompt_tokens if kind == "prompt" else sample.output_tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_fit_on_binned_counts_matches_the_sample_mean_and_p90(case):
    lengths = lengths_of(*CASES[case])
    upper, counts = make_histogram(lengths, MAX_MODEL_LEN)
    fit = fit_lengths(upper, counts)
    mean, p90 = lengths.mean(), np.percentile(lengths, 90)
    resampled = fit.sample(100_000, np.random.default_rng(1), MAX_MODEL_LEN)
    print(f"{case}: {fit.family} mean {mean:.1f} fit {fit.mean_tokens:.1f} resampled {resampled.mean():.1f}; "
          f"p90 {p90:.0f} fit {fit.p90_tokens:.0f} resampled {np.percentile(resampled, 90):.0f}")
    assert fit.mean_tokens == pytest.approx(mean, rel=0.05)
    assert fit.p90_tokens == pytest.approx(p90, rel=0.10)
    assert resampled.mean() == pytest.approx(mean, rel=0.05)
    assert np.percentile(resampled, 90) == pytest.approx(p90, rel=0.10)
    assert fit.bucket_counts == tuple(counts) and sum(fit.bucket_counts) == len(lengths)


@pytest.mark.parametrize("family", ["lognorm", "gamma", "weibull_min"])
def test_the_true_family_wins_on_likelihood(family):
    upper, counts = make_histogram(synthetic(family, num=8000, seed=3))
    fit = fit_lengths(upper, counts)
    assert fit.family == family
    shape, _, scale = fit.params
    assert log_likelihood(family, (shape, scale), upper, counts) == pytest.approx(
        fit_family(family, upper, counts)[1])


def test_the_fit_is_the_likelihood_maximum():
    upper, counts = make_histogram(synthetic("gamma"))
    (shape, scale), best = fit_family("gamma", upper, counts)
    for factor in (0.9, 1.1):
        assert log_likelihood("gamma", (shape * factor, scale), upper, counts) < best
        assert log_likelihood("gamma", (shape, scale * factor), upper, counts) < best


def test_no_counts_no_fit_and_bad_histograms_name_the_problem():
    upper, counts = make_histogram(np.array([10]))
    assert fit_lengths(upper, counts * 0) is None
    with pytest.raises(ValueError, match="increasing"):
        fit_lengths((5.0, 3.0, float("inf")), (1.0, 1.0, 0.0))
    with pytest.raises(ValueError, match="bucket bounds but"):
        fit_lengths((5.0, float("inf")), (1.0,))
    with pytest.raises(ValueError, match="counts must be finite"):
        fit_lengths((5.0, float("inf")), (1.0, -2.0))
