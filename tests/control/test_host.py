"""Instances on one host slow each other down (`simulator.host`), in both simulators, and
a run's iterations tell by how much (`local.calibration`)."""

from __future__ import annotations

import numpy as np
import pytest
from sim_factories import make_instance

from distserve.latency import Correction
from distserve.simulator import Trace, simulate_colocated, simulate_disaggregated

STEP_S = 0.02  # the fake model's decode step (no growth with context)
LONG_PROMPT = 2000  # prefilled in 0.2 s at the fake model's 1e-4 s a token


def simulate(kind: str, trace: Trace, slowdown: float):
    instance = make_instance(decode_s_per_token=0.0)
    if kind == "disaggregated":
        return simulate_disaggregated(trace, [instance], [instance], transfer=None,
                                      max_prefill_tokens=4096, busy_slowdown=slowdown)
    return simulate_colocated(trace, [instance, instance], busy_slowdown=slowdown)


@pytest.mark.parametrize("kind", ["disaggregated", "colocated"])
def test_a_decode_runs_slower_while_another_instance_prefills(kind):
    """A decodes 100 steps alone; at 1 s, B's long prompt is prefilled on the other
    instance (1P+1D: the prefill instance; colocated: the idle one) and its decode steps
    take x(1 + slowdown) from the first boundary after that until the first boundary
    after the prefill ends; B's prefill, beside A's decode, takes x(1 + slowdown) too."""
    trace = Trace(np.array([0.0, 1.0]), np.array([512, LONG_PROMPT]), np.array([101, 1]))
    k = 0.2
    result = simulate(kind, trace, k)
    first_s = 512e-4  # A's prefill, nothing else busy: the profile's time
    slowed_from = first_s + np.ceil((1.0 - first_s) / STEP_S) * STEP_S  # step 48's end
    prefill_end = 1.0 + LONG_PROMPT * 1e-4 * (1 + k)
    slow_steps = int(np.ceil((prefill_end - slowed_from) / (STEP_S * (1 + k))))
    fast_steps = 100 - slow_steps
    assert result.ttft_s == pytest.approx([first_s, prefill_end - 1.0])
    assert result.tpot_s[0] == pytest.approx(
        (fast_steps * STEP_S + slow_steps * STEP_S * (1 + k)) / 100)
    # with no slowdown, every step and batch the profile's time
    steady = simulate(kind, trace, 0.0)
    assert steady.ttft_s == pytest.approx([first_s, LONG_PROMPT * 1e-4])
    assert steady.tpot_s[0] == pytest.approx(STEP_S)


@pytest.mark.parametrize("kind", ["disaggregated", "colocated"])
def test_instances_never_busy_together_run_as_profiled(kind):
    trace = Trace(np.arange(20) * 10.0, np.full(20, 300), np.full(20, 30))
    slowed, steady = simulate(kind, trace, 0.5), simulate(kind, trace, 0.0)
    # 1P+1D: a request's prefill ends before its decode starts; colocated: one at a time
    assert np.array_equal(slowed.ttft_s, steady.ttft_s)
    assert np.array_equal(slowed.tpot_s, steady.tpot_s)


def test_one_instance_has_no_neighbour_and_a_bad_slowdown_is_refused():
    trace = Trace(np.array([0.0, 0.01]), np.array([300, 300]), np.array([20, 20]))
    alone = simulate_colocated(trace, [make_instance()], busy_slowdown=0.5)
    steady = simulate_colocated(trace, [make_instance()])
    assert np.array_equal(alone.ttft_s, steady.ttft_s)
    with pytest.raises(ValueError, match=r"busy_slowdown must be a number >= 0, got -0.1"):
        simulate_colocated(trace, [make_instance()] * 2, busy_slowdown=-0.1)
    with pytest.raises(ValueError, match=r"busy_slowdown must be in \[0, 1.0\], got 1.5"):
        Correction(busy_slowdown=1.5)
    assert "each x1.09 while the others are busy" in Correction(1.1, 1.0, 0.0, 0.09).describe()
