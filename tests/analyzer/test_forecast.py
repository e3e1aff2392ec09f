"""The traffic ahead: a window's trend (its older part against its last third) carried to
the end of the horizon a plan chosen now serves."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from analyzer_factories import make_joint
from decision_factories import length_fit

from distserve.analyzer.forecast import MAX_RATE_GROWTH, MIN_RECENT_REQUESTS, forecast
from distserve.analyzer.observation import Observation
from distserve.workload import load_lengths

WINDOW_S, RECENT_S = 900.0, 300.0


def lengths(dataset: str, num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    sample = load_lengths(dataset)
    pick = np.random.default_rng(seed).integers(0, len(sample), num)
    return sample.prompt_tokens[pick], sample.output_tokens[pick]


def window(older: list[tuple[np.ndarray, np.ndarray]], recent: list[tuple[np.ndarray, np.ndarray]],
           previous: list[tuple[np.ndarray, np.ndarray]] | None = None) -> Observation:
    """A window of these requests (prompt, output arrays per part), its last third
    `recent`; with `previous`, the third before it (part of `older`)."""
    def observed(parts, window_s: float, **inner: Observation) -> Observation:
        prompts = np.concatenate([p for p, _ in parts])
        outputs = np.concatenate([o for _, o in parts])
        return Observation(
            end_s=WINDOW_S, window_s=window_s, num_requests=len(prompts),
            arrival_rate_rps=len(prompts) / window_s, arrival_cv=1.0,
            prompt=length_fit(prompts), output=length_fit(outputs),
            joint=make_joint(prompts, outputs), **inner)

    before = observed(previous, RECENT_S) if previous else None
    return observed([*older, *recent], WINDOW_S, recent=observed(recent, RECENT_S),
                    previous=before)


def test_a_steady_window_is_carried_as_it_is_now():
    steady = window([lengths("chatbot", 2400, 1)], [lengths("chatbot", 1200, 2)])
    ahead = forecast(steady, horizon_s=480)
    assert not ahead.is_rate_trend and not ahead.is_mix_trend
    assert ahead.rate_rps == pytest.approx(4.0)  # the last third's rate
    assert ahead.workload.prompt is steady.recent.prompt  # the lengths of now, not carried
    assert ahead.workload.joint is steady.recent.joint
    assert ahead.destination is None  # no mix under way: nowhere else it leads
    assert ahead.workload.arrival_rate_rps == steady.arrival_rate_rps
    few = replace(steady, recent=replace(steady.recent, num_requests=MIN_RECENT_REQUESTS - 1))
    assert forecast(few, horizon_s=480).workload is few  # too few to fit: the window's


def test_a_rising_rate_is_carried_forward_and_capped():
    rising = window([lengths("chatbot", 1800, 1)], [lengths("chatbot", 1500, 2)])  # 3 -> 5 req/s
    ahead = forecast(rising, horizon_s=480)
    # midpoints half a window (450 s) apart; 150 s + 480 s past the recent one: 1.4 steps
    assert ahead.is_rate_trend and ahead.steps == pytest.approx(1.4)
    assert ahead.rate_rps == pytest.approx(5.0 + 1.4 * 2.0)
    far = forecast(rising, horizon_s=10_000)  # the steps are capped, then the growth
    assert far.steps == pytest.approx(1.5) and far.rate_rps <= MAX_RATE_GROWTH * 5.0
    falling = window([lengths("chatbot", 3000, 1)], [lengths("chatbot", 900, 2)])
    assert forecast(falling, horizon_s=480).rate_rps == pytest.approx(3.0)  # never below now


def test_a_length_mix_under_way_is_carried_past_where_it_is_now():
    # chatbot for two thirds, then half summarization: the mix moves toward long prompts
    code_then_summaries = window(
        [lengths("chatbot", 2400, 1)],
        [lengths("chatbot", 600, 2), lengths("summarization", 600, 3)])
    ahead = forecast(code_then_summaries, horizon_s=480)
    assert ahead.is_mix_trend
    recent_mean = code_then_summaries.recent.prompt.mean_tokens
    summaries_mean = float(lengths("summarization", 4000, 4)[0].mean())
    assert recent_mean < ahead.workload.prompt.mean_tokens < summaries_mean * 1.1
    assert ahead.workload.output is not None and ahead.workload.arrival_rate_rps == pytest.approx(4.0)
    # the shift has reached the summaries within the horizon: it leads nowhere further
    assert ahead.destination.prompt.mean_tokens == pytest.approx(
        ahead.workload.prompt.mean_tokens)


def test_without_a_recent_part_the_window_stands():
    plain = window([lengths("code", 2400, 1)], [lengths("code", 1200, 2)])
    plain = replace(plain, recent=None)
    ahead = forecast(plain, horizon_s=480)
    assert ahead.workload is plain and ahead.rate_rps == pytest.approx(4.0) and ahead.steps == 0


def test_a_finished_shift_is_not_carried_past_the_new_workload():
    # chatbot for two thirds, then summarization only: the shift is over, nothing is left
    # of the old workload to move away from, so the forecast is the summaries themselves
    done = window([lengths("chatbot", 2400, 1)], [lengths("summarization", 1200, 2)])
    ahead = forecast(done, horizon_s=480)
    assert ahead.is_mix_trend
    assert ahead.workload.prompt.mean_tokens == pytest.approx(done.recent.prompt.mean_tokens, rel=0.05)



def test_a_small_bucket_both_workloads_hold_does_not_stop_the_carry():
    # a quarter summaries in the older part, half in the recent one: 1.4 half windows on
    # (150 s + 480 s past the recent midpoint), 85% summaries. A bucket of a few percent
    # that both workloads hold empties first; stopped there, the forecast stays near now
    moving = window([lengths("code", 1800, 1), lengths("summarization", 600, 5)],
                    [lengths("code", 600, 2), lengths("summarization", 600, 3)])
    ahead = forecast(moving, horizon_s=480)
    assert ahead.is_mix_trend and ahead.steps == pytest.approx(1.4)
    code_mean = float(lengths("code", 4000, 6)[0].mean())
    summaries_mean = float(lengths("summarization", 4000, 4)[0].mean())
    expected = 0.15 * code_mean + 0.85 * summaries_mean
    assert ahead.workload.prompt.mean_tokens == pytest.approx(expected, rel=0.05)
    # where it leads, past the horizon: carried until the code's own buckets run empty
    assert ahead.destination.prompt.mean_tokens > ahead.workload.prompt.mean_tokens
    assert ahead.destination.prompt.mean_tokens == pytest.approx(summaries_mean, rel=0.1)
    # the pairs are carried with the mix: 85% of the requests ahead are long prompts,
    # and those still have the summaries' outputs
    joint = ahead.workload.joint
    counts = np.asarray(joint.counts)
    long_rows = np.asarray(joint.prompt_upper_tokens) > 1000
    assert counts.sum() == pytest.approx(1200)  # as many requests as the recent part
    assert counts[long_rows].sum() / counts.sum() == pytest.approx(0.85, abs=0.03)
    summaries = make_joint(*lengths("summarization", 4000, 4))
    assert np.allclose(counts[long_rows].sum(axis=0) / counts[long_rows].sum(),
                       np.asarray(summaries.counts)[long_rows].sum(axis=0) / 4000, atol=0.05)


def share_of_summaries(forecast_ahead, where: str = "workload") -> float:
    """The share of long prompts (over 1000 tokens: summaries) in the forecast's lengths."""
    joint = getattr(forecast_ahead, where).joint
    counts = np.asarray(joint.counts)
    return counts[np.asarray(joint.prompt_upper_tokens) > 1000].sum() / counts.sum()


def test_a_shift_that_began_in_the_last_third_is_carried_at_its_own_pace():
    # code for two thirds, then 10% summaries in the last: against the whole older part
    # the trend is 10% per half window (1.4 of them ahead); against the third before
    # the last (code), 10% per third (2.1 of them); and since that third is no shift
    # from the first, the ramp began within the last third: at its end it is at twice
    # its average, and it moves twice as fast
    older = [lengths("code", 1200, 1)]
    before = [lengths("code", 1200, 2)]
    recent = [lengths("code", 1080, 3), lengths("summarization", 120, 4)]
    diluted = forecast(window([*older, *before], recent), horizon_s=480)
    paced = forecast(window([*older, *before], recent, previous=before), horizon_s=480)
    assert diluted.is_mix_trend and paced.is_mix_trend
    assert share_of_summaries(diluted) == pytest.approx(0.1 + 1.4 * 0.1, abs=0.04)
    assert share_of_summaries(paced) == pytest.approx(0.1 + 2 * 2.1 * 0.1, abs=0.04)
    # too few requests in the third before: the older part, as before
    few = window([*older, *before], recent, previous=[lengths("code", 50, 2)])
    assert forecast(few, horizon_s=480).workload.prompt == diluted.workload.prompt


def test_a_shift_under_way_before_the_last_third_is_carried_at_the_difference():
    # 5% summaries in the third before the last, 15% in the last: it began earlier, so
    # the difference per third is its pace (2.1 thirds ahead)
    older = [lengths("code", 1200, 1)]
    before = [lengths("code", 1140, 2), lengths("summarization", 60, 5)]
    recent = [lengths("code", 1020, 3), lengths("summarization", 180, 4)]
    ahead = forecast(window([*older, *before], recent, previous=before), horizon_s=480)
    assert ahead.is_mix_trend
    assert share_of_summaries(ahead) == pytest.approx(0.15 + 2.1 * 0.1, abs=0.04)


def test_where_a_shift_leads_is_where_the_old_workloads_buckets_run_empty_together():
    # prompts of 90 (A) and 300 (B) tokens give way to 1500 (C): A 45% -> 30%, B 45% ->
    # 40%, C 10% -> 30% from the third before the last to the last. A alone runs empty 2
    # thirds on (C 70%); A and B together 3.5 thirds on, where C is 82% of the mix
    def part(a: int, b: int, c: int) -> tuple[np.ndarray, np.ndarray]:
        prompts = np.repeat([90, 300, 1500], [a, b, c])
        return prompts, np.full(len(prompts), 50)

    before = [part(540, 540, 120)]
    ahead = forecast(window([part(540, 540, 0), *before], [part(360, 480, 360)],
                            previous=before), horizon_s=480)
    assert ahead.is_mix_trend
    assert share_of_summaries(ahead, "destination") == pytest.approx(1.0 / 1.225, abs=0.02)
