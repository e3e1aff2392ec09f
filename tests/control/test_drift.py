"""A drifting speed in the simulator (`simulator.drift`): the mean a correction gives is
kept, a queue follows the speed of its stretch as queueing theory says, and how much a
run's speed drifted is told from its iterations (`local.calibration.speeds_by_window`); a
run's speed as measured window by window (`SpeedHistory`) is replayed as it was."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sim_factories import make_instance, make_trace

from distserve.simulator import (
    SpeedDrift,
    SpeedHistory,
    Trace,
    simulate_colocated,
    simulate_disaggregated,
)
from distserve.simulator.drift import SpeedTrack

PROMPT = 512
D_S = 0.1  # one prompt's prefill (prefill_s_per_token * PROMPT)


def prefill_only(trace: Trace, drift: SpeedDrift | None):
    instance = make_instance(prefill_s_per_token=D_S / PROMPT)
    return simulate_disaggregated(trace, [instance], [], transfer=None,
                                  max_prefill_tokens=PROMPT, drift=drift)


def lone_requests(num_requests: int, output_tokens: int = 1) -> Trace:
    """Requests 10 s apart: each runs alone, its TTFT its prefill's time."""
    return Trace(np.arange(num_requests) * 10.0, np.full(num_requests, PROMPT),
                 np.full(num_requests, output_tokens))


def test_a_drift_spreads_batch_times_about_the_mean_the_correction_gives():
    drift = SpeedDrift(prefill_window_s=30.0, prefill_sd=0.1, decode_window_s=2.0, decode_sd=0.0,
                       prefill_batch_sd=0.2, seed=3)
    ttft = prefill_only(lone_requests(5000), drift).ttft_s
    # mean 1: the correction's factor still holds on average
    assert np.mean(ttft) == pytest.approx(D_S, rel=0.02)
    # the spread of log time: a batch's own and its window's, independent
    assert np.std(np.log(ttft / D_S)) == pytest.approx(np.hypot(0.1, 0.2), rel=0.05)
    # no drift: every batch the profile's time
    assert np.ptp(prefill_only(lone_requests(50), None).ttft_s) == pytest.approx(0.0, abs=1e-12)


def test_a_still_drift_simulates_exactly_as_none():
    trace = make_trace(300, 4.0, seed=7)
    still = SpeedDrift(30.0, prefill_sd=0.0, decode_window_s=2.0, decode_sd=0.0)
    a = simulate_colocated(trace, [make_instance()] * 2, drift=still)
    b = simulate_colocated(trace, [make_instance()] * 2)
    assert np.array_equal(a.ttft_s, b.ttft_s) and np.array_equal(a.tpot_s, b.tpot_s, equal_nan=True)


def test_a_queue_follows_the_speed_of_its_stretch_as_md1_says():
    """Windows far longer than a queue takes to settle: each stretch is an M/D/1 queue at
    its own speed, so the mean TTFT is Eq. 1 averaged over the arrivals' windows."""
    rate = 7.0  # 70% busy at the mean speed
    drift = SpeedDrift(500.0, prefill_sd=0.1, decode_window_s=2.0, decode_sd=0.0, seed=7)
    # NOTE: 57 windows of 3,500 requests: the mean of each stretch's waits is within
    # ~1% of Eq. 1 (seeds 5-7 read 0.5-1.1% over it); 60,000 requests read 2.6%
    trace = make_trace(200000, rate, prompt_tokens=PROMPT, output_tokens=1, seed=2)
    simulated = float(np.mean(prefill_only(trace, drift).ttft_s))

    def md1(d: float) -> float:
        return d + rate * d * d / (2 * (1 - rate * d))

    track = SpeedTrack(drift)  # the same seed: the trial's history
    expected = float(np.mean([md1(D_S * track.window_at(t)[0]) for t in trace.arrival_s]))
    assert simulated == pytest.approx(expected, rel=0.02)
    steady = float(np.mean(prefill_only(trace, None).ttft_s))
    assert steady == pytest.approx(md1(D_S), rel=0.02)


def test_decode_steps_follow_the_decode_speed_of_their_window():
    drift = SpeedDrift(30.0, prefill_sd=0.0, decode_window_s=5.0, decode_sd=0.15, seed=1)
    trace = lone_requests(400, output_tokens=11)  # 10 steps well within one window
    instance = make_instance(decode_s_per_token=0.0)
    result = simulate_colocated(trace, [instance], drift=drift)
    track = SpeedTrack(drift)
    decode_base_s = 0.02  # the fake model's decode step
    expected = [decode_base_s * track.window_at(float(ft))[1]
                for ft in trace.arrival_s + result.ttft_s]
    assert result.tpot_s == pytest.approx(expected, rel=1e-6, abs=0)
    assert np.std(np.log(result.tpot_s)) == pytest.approx(0.15, rel=0.15)


@pytest.mark.parametrize(("field", "value"), [
    ("prefill_window_s", 0.0), ("decode_window_s", -1.0), ("prefill_sd", -0.1),
    ("decode_sd", 1.5), ("prefill_batch_sd", 1.0)])
def test_a_drift_out_of_range_is_refused_naming_the_field(field, value):
    good = dict(prefill_window_s=30.0, prefill_sd=0.1, decode_window_s=2.0, decode_sd=0.1)
    with pytest.raises(ValueError, match=field):
        SpeedDrift(**{**good, field: value})


def test_the_same_seed_draws_the_same_windows_whatever_batches_ran():
    drift = SpeedDrift(10.0, prefill_sd=0.2, decode_window_s=3.0, decode_sd=0.2, prefill_batch_sd=0.3,
                       seed=4)
    busy, idle = SpeedTrack(drift), SpeedTrack(drift)
    for t in np.linspace(0, 100, 500):
        busy.prefill_at(float(t))  # draws a batch's own spread each time
    assert [busy.window_at(t) for t in range(0, 100, 10)] == \
        [idle.window_at(t) for t in range(0, 100, 10)]
    other = SpeedTrack(dataclasses.replace(drift, seed=5))
    assert [other.window_at(t) for t in range(0, 100, 10)] != \
        [idle.window_at(t) for t in range(0, 100, 10)]


def test_a_measured_history_replays_each_window_at_its_speed_the_last_holding_on():
    history = SpeedHistory(prefill_window_s=10.0, prefill_speeds=(1.0, 2.0, 0.5),
                           decode_window_s=10.0, decode_speeds=(1.0,))
    ttft = prefill_only(lone_requests(5), history).ttft_s  # arrivals at 0, 10, ..., 40 s
    assert ttft == pytest.approx([D_S, 2 * D_S, 0.5 * D_S, 0.5 * D_S, 0.5 * D_S], rel=1e-9)
    # decode steps take the speed of the window their batch was formed in
    decode = SpeedHistory(10.0, (1.0,), 5.0, (1.0, 1.5, 0.8, 1.2))
    trace = lone_requests(3, output_tokens=11)  # first tokens at ~0.1, ~10.1, ~20.1 s
    result = simulate_colocated(trace, [make_instance(decode_s_per_token=0.0)], drift=decode)
    decode_base_s = 0.02  # the fake model's decode step
    assert result.tpot_s == pytest.approx([decode_base_s * 1.0, decode_base_s * 0.8,
                                           decode_base_s * 1.2], rel=1e-6)
    # one history, however many draws a prediction takes
    assert history.histories(8) == [history]
    assert "prefill x0.50-2.00 over 3 windows of 10 s, decode x1.00-1.00 over 1 of 10 s" \
        == history.describe()


@pytest.mark.parametrize(("field", "value"), [
    ("prefill_window_s", 0.0), ("decode_window_s", -2.0), ("prefill_speeds", ()),
    ("decode_speeds", (1.0, 0.0)), ("prefill_speeds", (float("nan"),))])
def test_a_history_out_of_range_is_refused_naming_the_field(field, value):
    good = dict(prefill_window_s=10.0, prefill_speeds=(1.0,), decode_window_s=2.0,
                decode_speeds=(1.1, 0.9))
    with pytest.raises(ValueError, match=field):
        SpeedHistory(**{**good, field: value})
