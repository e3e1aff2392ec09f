"""Shifts judged on windows as the analyzer observes them (binned counts, fitted lengths):
noise in small windows is no shift; a 4x prompt growth and a doubled rate are."""

from __future__ import annotations

import numpy as np
import pytest
from analyzer_factories import make_histogram

from distserve.analyzer.fit import fit_lengths
from distserve.analyzer.observation import Observation
from distserve.analyzer.shift import is_shifted

WINDOW_S = 60.0


def make_window(rate_rps: float, prompt_median: float, seed: int, window_s: float = WINDOW_S) -> Observation:
    """One window of Poisson arrivals with log-normal prompt and output lengths, binned."""
    rng = np.random.default_rng(seed)
    num = int(rng.poisson(rate_rps * window_s))
    prompts = np.clip(np.rint(rng.lognormal(np.log(prompt_median), 0.6, num)), 1, 2048)
    outputs = np.clip(np.rint(rng.lognormal(np.log(40), 0.6, num)), 1, 2048)
    prompt, output = (fit_lengths(*make_histogram(x), families=("lognorm",)) for x in (prompts, outputs))
    return Observation(end_s=seed * window_s, window_s=window_s, num_requests=num,
                       arrival_rate_rps=num / window_s, arrival_cv=1.0, prompt=prompt, output=output)


@pytest.mark.slow
def test_noise_between_small_windows_of_one_workload_is_no_shift():
    verdicts = [is_shifted(make_window(0.5, 200, seed), make_window(0.5, 200, seed + 100))
                for seed in range(12)]  # ~30 requests a window
    assert not any(v.is_shifted for v in verdicts), [v.describe() for v in verdicts if v.is_shifted]


def test_prompts_four_times_longer_are_a_mix_shift_not_a_rate_shift():
    verdict = is_shifted(make_window(0.5, 200, 1), make_window(0.5, 800, 2))
    print(verdict.describe())
    assert verdict.is_mix_shifted and not verdict.is_rate_shifted
    assert verdict.prompt_mean_change > 2.5 and verdict.prompt_p_value < 1e-6


def test_a_doubled_rate_is_a_rate_shift_not_a_mix_shift():
    verdict = is_shifted(make_window(2.0, 200, 3, 300.0), make_window(4.0, 200, 4, 300.0))
    print(verdict.describe())
    assert verdict.is_rate_shifted and not verdict.is_mix_shifted
    assert 0.5 < verdict.rate_change < 1.5  # +100%, give or take the Poisson counts
