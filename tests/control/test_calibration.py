"""The profile held to a deployment's own iterations (`local.calibration`), and
`distserve fidelity` calibrating on another sample before it compares, its knee judged
in steady state (the deployment, the load generator and the instances' iteration logs
replaced by fakes)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from distserve.cli.fidelity import (
    CALIBRATION_KNEE_FACTOR,
    IN_RUN_REQUESTS,
    KNEE_TRACE_REQUESTS,
    WARMUP_REQUESTS,
    _sample_trace,
    compare_deployment,
    load_run,
)
from distserve.latency import Correction
from distserve.local.calibration import (
    DECODE_DRIFT_WINDOW_S,
    PREFILL_DRIFT_WINDOW_S,
    _busy_within,
    fit_drift,
    fit_history,
    fit_iterations,
    fit_window,
    profiled_s,
    same_batches,
    speeds_by_window,
)
from distserve.local.load import Outcome
from distserve.local.prediction import LocalShape, engine_context, predicted_knee_rps
from distserve.local.settings import instance_counts, instance_parallel, serve_settings
from distserve.search import build_context
from distserve.search.candidates import Config
from distserve.spec import load_manifest
from distserve_engine.instance.iterations import Iteration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PREFILL_BATCHES = [(300,), (97, 120), (500,), (64, 64, 64)]
DECODE_BATCHES = [(200,), (150, 301, 80), (90,) * 8, (400, 33)]


def deployment(num_colocated: int):
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    settings = serve_settings(spec, instance_counts(spec, None, num_colocated), "t", "/model",
                              instance_parallel(spec, None, num_colocated), None)
    return spec, LocalShape.from_settings(settings), engine_context(build_context(spec), settings)


def timed(ctx, serving_mode: str, kind: str, batches, factor: float) -> list[Iteration]:
    """Iterations that ran `factor` times the profile's time for their batch."""
    out = []
    for i, lens in enumerate(batches):
        profiled = profiled_s(ctx, serving_mode, Config(1, 1), Iteration(kind, 0.0, 0.0, lens))
        out.append(Iteration(kind, float(i), profiled * factor, lens))
    return out


def fitted(ctx, shape, name: str, iterations: list[Iteration]):
    """The fit of one instance's iterations, and the part of it of their phase."""
    fit = fit_iterations(ctx, shape, {name: iterations})
    return fit, next(f for f in fit.phases if f.phase == iterations[0].kind)


def test_iterations_that_ran_a_known_factor_slower_give_that_factor_per_phase():
    _, shape, ctx = deployment(0)
    iterations = {"prefill-0": timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 1.3),
                  "decode-0": timed(ctx, "disaggregated", "decode", DECODE_BATCHES, 0.8)}
    fit = fit_iterations(ctx, shape, iterations)
    by_phase = {f.phase: f for f in fit.phases}
    assert by_phase["prefill"].factor == pytest.approx(1.3)
    assert by_phase["decode"].factor == pytest.approx(0.8)
    assert (by_phase["prefill"].p10, by_phase["prefill"].p90) == pytest.approx((1.3, 1.3))
    assert (by_phase["prefill"].num_iterations, by_phase["decode"].num_iterations) == (4, 4)
    assert (fit.correction.prefill_factor, fit.correction.decode_factor) == pytest.approx((1.3, 0.8))
    assert ("prefill x1.30 (per iteration x1.30-1.30, 4 iterations, 0% of the time between "
            "runner calls)") in fit.describe()
    # a context already corrected is fitted against the profile as measured
    corrected = dataclasses.replace(ctx, correction=Correction(2.0, 2.0))
    assert fit_iterations(corrected, shape, iterations).correction == fit.correction


def test_the_engine_threads_time_between_runner_calls_counts_as_the_iterations():
    _, shape, ctx = deployment(0)
    runner_only = timed(ctx, "disaggregated", "decode", DECODE_BATCHES, 1.0)
    with_overhead = [dataclasses.replace(i, overhead_s=0.25 * i.seconds) for i in runner_only]
    fit, decode = fitted(ctx, shape, "decode-0", with_overhead)
    assert decode.factor == pytest.approx(1.25)
    assert "decode x1.25" in fit.describe() and "20% of the time between runner calls" in fit.describe()


def test_decode_steps_that_grow_with_their_batch_beyond_the_profile_give_a_time_per_sequence():
    _, shape, ctx = deployment(0)
    batches = [(200,) * n for n in (1, 2, 4, 8, 16, 3)]
    steps = [dataclasses.replace(i, seconds=0.9 * i.seconds + 0.0005 * len(i.lens))
             for i in timed(ctx, "disaggregated", "decode", batches, 1.0)]
    fit, decode = fitted(ctx, shape, "decode-0", steps)
    assert decode.sequence_s == pytest.approx(0.0005, rel=1e-3)
    assert decode.factor == pytest.approx(0.9, rel=1e-3)
    assert fit.correction.decode_sequence_s == pytest.approx(0.0005, rel=1e-3)
    assert "decode x0.90 + 0.50 ms a sequence" in fit.describe()
    # steps that only scale with the profile: no time per sequence
    scaled = fit_iterations(ctx, shape, {"decode-0": timed(ctx, "disaggregated", "decode",
                                                           batches, 1.2)})
    c = scaled.correction
    assert (c.decode_factor, c.decode_sequence_s) == (pytest.approx(1.2), 0.0)


def test_the_fit_says_how_much_of_its_calls_the_runner_held_its_core():
    _, shape, ctx = deployment(0)
    runner = timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 1.25)
    on_core = [dataclasses.replace(i, cpu_s=0.8 * i.seconds) for i in runner]
    fit, prefill = fitted(ctx, shape, "prefill-0", on_core)
    assert prefill.runner_cpu_s == pytest.approx(0.8 * prefill.runner_s)
    assert "prefill x1.25" in fit.describe()
    assert "the runner on its core 80% of its calls' time" in fit.describe()
    # iterations from an instance that did not time their CPU say nothing of it
    assert "on its core" not in fit_iterations(ctx, shape, {"prefill-0": runner}).describe()


def test_the_ratio_weighs_each_iteration_by_its_time():
    _, shape, ctx = deployment(0)
    short, long = timed(ctx, "disaggregated", "prefill", [(32,)], 2.0), \
        timed(ctx, "disaggregated", "prefill", [(512,)], 1.0)
    _, prefill = fitted(ctx, shape, "prefill-0", short + long)
    assert (prefill.p10, prefill.p90) == pytest.approx((1.1, 1.9))
    # the ratio of sums: the long batch, most of the time, pulls it towards its own 1.0
    (short_s,), (long_s,) = (i.seconds for i in short), (i.seconds for i in long)
    assert prefill.factor == pytest.approx((short_s + long_s) / (short_s / 2.0 + long_s))


def test_a_runs_speed_per_window_is_told_against_the_whole_runs_factors():
    _, shape, ctx = deployment(0)

    def at(items: list[Iteration], first_s: float) -> list[Iteration]:
        return [dataclasses.replace(item, started_s=first_s + i) for i, item in enumerate(items)]

    prefill = (at(timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 3.0), 990.0)  # before
               + at(timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 1.2), 1000.0)
               + at(timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 1.5), 1030.0)
               # the last window takes the rest, past the run's end too
               + at(timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 1.8), 1088.0))
    decode = at(timed(ctx, "disaggregated", "decode", DECODE_BATCHES, 1.0), 1000.0)
    name_to_items = {"prefill-0": prefill, "decode-0": decode}
    run_fit = fit_window(ctx, shape, name_to_items, 1000.0)
    speeds = speeds_by_window(ctx, shape, name_to_items, run_fit, 1000.0, 1090.0, 30.0,
                              len(PREFILL_BATCHES))
    # the whole run is x1.5: its windows ran x1.2, x1.5 and x1.8, that is 0.8, 1.0, 1.2 of it
    assert speeds.phase_to_speeds["prefill"] == pytest.approx([0.8, 1.0, 1.2])
    # the other windows ran no decode step
    assert speeds.phase_to_speeds["decode"] == pytest.approx([1.0])
    # each window's batches ran at its speed exactly: all the spread is drift, none noise
    assert speeds.between_sd("prefill") == pytest.approx(np.std(np.log([0.8, 1.0, 1.2]), ddof=1))
    assert speeds.prefill_batch_sd == pytest.approx(0.0)
    assert speeds.between_sd("decode") == 0.0  # one window tells no spread
    assert "prefill x0.80-1.20 (3 windows), decode x1.00-1.00 (1 windows)" in speeds.describe()


def test_a_runs_speed_window_by_window_is_the_history_the_simulator_replays():
    _, shape, ctx = deployment(0)

    def at(items: list[Iteration], first_s: float) -> list[Iteration]:
        return [dataclasses.replace(item, started_s=first_s + i) for i, item in enumerate(items)]

    prefill = (at(timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 1.2), 1000.0)
               + at(timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 1.5), 1010.0)
               # no prefill from 1020 to 1030 s: that window keeps the speed before it
               + at(timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 1.8), 1030.0)
               # the last window takes the rest, past the run's end too
               + at(timed(ctx, "disaggregated", "prefill", PREFILL_BATCHES, 1.8), 1041.0))
    # no decode step before 1020 s: those windows take the first measured one's speed
    decode = (at(timed(ctx, "disaggregated", "decode", DECODE_BATCHES, 1.0), 1020.0)
              + at(timed(ctx, "disaggregated", "decode", DECODE_BATCHES, 2.0), 1030.0))
    name_to_items = {"prefill-0": prefill, "decode-0": decode}
    run_fit = fit_window(ctx, shape, name_to_items, 1000.0, tell_slowdown=False)
    by = {fit.phase: fit for fit in run_fit.phases}
    history = fit_history(ctx, shape, name_to_items, run_fit, 1000.0, 1045.0,
                          prefill_window_s=10.0, decode_window_s=10.0,
                          min_iterations=len(DECODE_BATCHES))
    p, d = by["prefill"].factor, by["decode"].factor
    assert history.prefill_speeds == pytest.approx([1.2 / p, 1.5 / p, 1.5 / p, 1.8 / p])
    assert history.decode_speeds == pytest.approx([1.0 / d, 1.0 / d, 1.0 / d, 2.0 / d])
    # the run's factor times each window's speed: the time the window's batches took
    assert p * history.prefill_speeds[0] == pytest.approx(1.2)
    assert history.decode_window_s == 10.0 and history.prefill_window_s == 10.0


def test_batches_that_scatter_alike_in_every_window_are_a_batch_spread_not_a_drift():
    _, shape, ctx = deployment(0)
    items = []
    for window in range(4):
        for i, lens in enumerate(PREFILL_BATCHES * 3):
            factor = 1.2 if i % 2 else 1.8  # the same scatter in each window
            (item,) = timed(ctx, "disaggregated", "prefill", [lens], factor)
            items.append(dataclasses.replace(item, started_s=1000.0 + 30 * window + i))
    name_to_items = {"prefill-0": items}
    run_fit = fit_window(ctx, shape, name_to_items, 1000.0)
    speeds = speeds_by_window(ctx, shape, name_to_items, run_fit, 1000.0, 1120.0, 30.0, 4)
    assert speeds.phase_to_speeds["prefill"] == pytest.approx([1.0] * 4)
    assert speeds.between_sd("prefill") == 0.0
    # x1.2 and x1.8 about the windows' x1.5: +-0.2 in log
    assert 0.15 < speeds.prefill_batch_sd < 0.3
    # fit_drift: prefill over 30 s windows, decode over 2 s ones (none ran here)
    drift, _ = fit_drift(ctx, shape, name_to_items, run_fit, 1000.0, 1120.0, 4)
    assert (drift.prefill_window_s, drift.decode_window_s) == (PREFILL_DRIFT_WINDOW_S,
                                                               DECODE_DRIFT_WINDOW_S)
    assert (drift.prefill_sd, drift.decode_sd) == (0.0, 0.0)
    assert drift.prefill_batch_sd == pytest.approx(speeds.prefill_batch_sd)


def test_the_time_another_instance_was_busy_is_counted_within_each_span():
    # one thread's spans, out of order: [0, 1), [3, 5), [2, 2.5)
    starts, ends = np.array([0.0, 3.0, 2.0]), np.array([1.0, 5.0, 2.5])
    lo, hi = np.array([0.5, -1.0, 1.0, 2.25, 6.0]), np.array([4.0, 10.0, 2.0, 3.5, 7.0])
    assert _busy_within(starts, ends, lo, hi) == pytest.approx([2.0, 3.5, 0.0, 0.75, 0.0])
    assert _busy_within(np.array([]), np.array([]), lo, hi) == pytest.approx([0.0] * 5)


def beside_each_other(ctx, slowdown: float, prefill_factor: float, decode_factor: float,
                      with_idle_prefill: bool = True) -> dict[str, list[Iteration]]:
    """1P+1D iterations on one host: a prefill batch every 8 s, beside a burst of decode
    steps (and, with_idle_prefill, every other one alone), and a burst of decode steps
    alone between them; each iteration x(1 + slowdown x the share of it the other
    instance was busy) slower than its factor gives (found by iterating to the fixed
    point)."""
    def profiled(kind, lens):
        return profiled_s(ctx, "disaggregated", Config(1, 1), Iteration(kind, 0.0, 0.0, lens))

    def busy_share(other: list[Iteration], started_s: float, seconds: float) -> float:
        starts = np.array([i.started_s for i in other])
        ends = starts + np.array([i.seconds for i in other])
        return float(_busy_within(starts, ends, np.array([started_s]),
                                  np.array([started_s + seconds]))[0]) / seconds

    bursts = [(8.0 * j - 0.5, 4.5) for j in range(60) if j % 2 == 0 or not with_idle_prefill]
    bursts += [(8.0 * j + 4.6, 2.4) for j in range(60)]
    prefill = [Iteration("prefill", 8.0 * j, prefill_factor * profiled("prefill", lens), lens)
               for j, lens in enumerate(PREFILL_BATCHES * 15)]
    for _ in range(4):
        steps = []
        for first_s, length_s in bursts:
            t, n = first_s, 0
            while t < first_s + length_s:
                lens = DECODE_BATCHES[n % 4]
                alone = decode_factor * profiled("decode", lens)
                seconds = alone
                for _ in range(4):
                    seconds = alone * (1 + slowdown * busy_share(prefill, t, seconds))
                steps.append(Iteration("decode", t, seconds, lens))
                t, n = t + seconds, n + 1
        prefill = [dataclasses.replace(item, seconds=prefill_factor * profiled("prefill", item.lens)
                                       * (1 + slowdown * busy_share(steps, item.started_s,
                                                                     item.seconds)))
                   for item in prefill]
    return {"prefill-0": prefill, "decode-0": steps}


def test_a_runner_slowed_while_the_other_instance_is_busy_gives_that_slowdown():
    _, shape, ctx = deployment(0)
    name_to_items = beside_each_other(ctx, 0.12, 1.1, 0.9)
    fit = fit_iterations(ctx, shape, name_to_items)
    assert fit.is_slowdown_measured and fit.busy_slowdown == pytest.approx(0.12, abs=0.005)
    c = fit.correction
    assert (c.prefill_factor, c.decode_factor) == pytest.approx((1.1, 0.9), rel=0.01)
    assert c.busy_slowdown == fit.busy_slowdown and c.decode_sequence_s < 1e-4
    assert "each x1.12 while the other instances are busy" in fit.describe()
    # one factor a phase stands for the run's mix of both: the prefill batches' measured
    # over profiled time, between alone (1.1) and beside a busy decode throughout (1.1 x 1.12)
    mixed = fit_iterations(ctx, shape, name_to_items, tell_slowdown=False)
    prefill = name_to_items["prefill-0"]
    ratio = sum(i.seconds for i in prefill) / sum(
        profiled_s(ctx, "disaggregated", Config(1, 1), i) for i in prefill)
    assert mixed.correction.prefill_factor == pytest.approx(ratio, rel=1e-9)
    # the batches at even slots (PREFILL_BATCHES 0 and 2) ran beside a busy decode
    # throughout, the others beside an idle one: x1.12 on the former's share of the time
    p = [profiled_s(ctx, "disaggregated", Config(1, 1), Iteration("prefill", 0.0, 0.0, lens))
         for lens in PREFILL_BATCHES]
    assert ratio == pytest.approx(1.1 * (1 + 0.12 * (p[0] + p[2]) / sum(p)), rel=1e-9)
    assert not mixed.is_slowdown_measured and mixed.correction.busy_slowdown == 0.0


def test_a_run_never_apart_from_the_others_keeps_the_slowdown_told_before():
    _, shape, ctx = deployment(0)
    # every prefill batch beside a decode burst: prefill cannot tell; decode can
    name_to_items = beside_each_other(ctx, 0.1, 1.1, 0.9, with_idle_prefill=False)
    told = fit_iterations(ctx, shape, name_to_items)
    assert told.is_slowdown_measured and told.busy_slowdown == pytest.approx(0.1, abs=0.005)
    # decode steps all beside the prefill too: neither phase tells; the one given holds
    busy_only = {"prefill-0": name_to_items["prefill-0"],
                 "decode-0": [i for i in name_to_items["decode-0"]
                              if any(p.started_s <= i.started_s
                                     and i.started_s + i.seconds <= p.started_s + p.seconds
                                     for p in name_to_items["prefill-0"])]}
    kept = fit_iterations(ctx, shape, busy_only, busy_slowdown=0.1)
    assert not kept.is_slowdown_measured and kept.busy_slowdown == 0.1
    assert kept.correction.prefill_factor == pytest.approx(1.1, rel=0.01)
    assert "x1.10 while the other instances are busy, as measured before" in kept.describe()
    assert fit_iterations(ctx, shape, busy_only).busy_slowdown == 0.0


def test_the_same_batches_of_two_runs_tell_how_much_slower_the_same_work_ran():
    def run(started_s, batches, wall_s, cpu_s):
        return [Iteration("prefill", started_s + k, wall_s(lens), lens, cpu_s=cpu_s(lens))
                for k, lens in enumerate(batches)]

    def seconds(lens):
        return 0.001 * sum(lens)

    before = {"prefill-0": run(0.0, [(300,), (97, 120), (500,)], seconds, seconds),
              "decode-0": [Iteration("decode", 1.0, 0.05, (300,))]}
    after = {"prefill-0": run(100.0, [(300,), (97, 120), (64, 64, 64)],
                              lambda lens: 1.1 * seconds(lens), lambda lens: 1.05 * seconds(lens))
             # outside the later run's window: not its batch
             + [Iteration("prefill", 500.0, 9.0, (500,), cpu_s=9.0)],
             "decode-0": [Iteration("decode", 101.0, 0.5, (300,))]}
    same = same_batches(before, after, (0.0, 50.0), (100.0, 200.0))
    assert same.count == 2  # (300,) and (97, 120): a decode step is no prefill batch
    assert (same.wall, same.cpu) == pytest.approx((1.1, 1.05))
    assert same.describe() == "2 batches, wall time x1.100 (CPU time x1.050)"
    # the same lengths on another instance are other work
    elsewhere = {"prefill-1": after["prefill-0"]}
    assert same_batches(before, elsewhere).describe() == "none in common"


def test_a_colocated_instance_is_fitted_per_kind_with_the_colocated_profile():
    _, shape, ctx = deployment(2)
    iterations = {
        "colocated-0": timed(ctx, "colocated", "prefill", PREFILL_BATCHES, 1.5)
        + timed(ctx, "colocated", "decode", DECODE_BATCHES, 1.1),
        "colocated-1": timed(ctx, "colocated", "decode", DECODE_BATCHES[:2], 1.1),
    }
    fit = fit_iterations(ctx, shape, iterations)
    assert (fit.correction.prefill_factor, fit.correction.decode_factor) == pytest.approx((1.5, 1.1))
    assert [f.num_iterations for f in fit.phases] == [4, 6]


def test_a_phase_with_no_iterations_is_left_as_profiled_and_a_stranger_is_an_error():
    _, shape, ctx = deployment(0)
    fit = fit_iterations(ctx, shape, {"prefill-0": timed(ctx, "disaggregated", "prefill",
                                                         PREFILL_BATCHES, 1.2)})
    assert (fit.correction.prefill_factor, fit.correction.decode_factor) == pytest.approx((1.2, 1.0))
    assert "decode: no iterations (x1.00)" in fit.describe()
    with pytest.raises(ValueError, match=r"instance 'decode-3'.*\['decode-0', 'prefill-0'\]"):
        fit_iterations(ctx, shape, {"decode-3": []})


class SlowPrefillDeployment:
    """A fake deployment whose runners ran prefill 1.5x and decode 1.0x the profile: every
    request it is sent is answered at once, and each prefill of the calibration is logged."""

    def __init__(self, ctx) -> None:
        self.ctx, self.sent = ctx, []
        self.iterations: dict[str, list[Iteration]] = {"prefill-0": [], "decode-0": []}

    def drive(self, url, requests):
        import time

        self.sent.append(list(requests))
        now = time.time()
        for r in requests:
            self.iterations["prefill-0"] += timed(self.ctx, "disaggregated", "prefill",
                                                  [(r.prompt_tokens,)], 1.5)
            self.iterations["decode-0"] += timed(self.ctx, "disaggregated", "decode",
                                                 [(r.prompt_tokens + 1,)], 1.0)
        for items in self.iterations.values():  # logged during this replay
            items[:] = [dataclasses.replace(i, started_s=now) for i in items]
        return [Outcome(r.req_id, r.prompt_tokens, r.output_tokens, 1.0, 0.1, r.output_tokens)
                for r in requests]


def test_fidelity_calibrates_on_another_sample_then_judges_the_knee_with_the_correction(capsys):
    spec, shape, ctx = deployment(0)
    knee_trace = _sample_trace(spec, KNEE_TRACE_REQUESTS)
    trace, calibration = knee_trace.at_rate(1.0, 12), _sample_trace(spec, 10, skip=12)
    fake = SlowPrefillDeployment(ctx)

    def launch(settings, port):
        return contextlib.nullcontext(SimpleNamespace(url=f"http://127.0.0.1:{port}"))

    rows = compare_deployment(spec, None, "local", "/model", 0, trace, None, 18000,
                              drive_fn=fake.drive, launch=launch, knee_trace=knee_trace,
                              calibration=calibration, iterations_fn=lambda _: fake.iterations)
    out = capsys.readouterr().out
    warmup, calibrated, *replays = fake.sent
    assert len(warmup) == WARMUP_REQUESTS and len(replays) == 3
    assert [r.prompt_tokens for r in calibrated] == calibration.prompt_tokens.tolist()
    assert calibration.prompt_tokens.tolist() == knee_trace.prompt_tokens.tolist()[12:22]
    assert calibration.arrival_s[0] == pytest.approx(knee_trace.arrival_s[12] - knee_trace.arrival_s[11])
    uncorrected_knee, _ = predicted_knee_rps(ctx, shape, knee_trace, 1.0)
    rate = calibration.arrival_s[-1] / calibrated[-1].arrival_s  # sampled at 1 req/s
    assert rate == pytest.approx(uncorrected_knee * CALIBRATION_KNEE_FACTOR, rel=1e-2)
    assert "prefill x1.50" in out and "decode x1.00" in out
    knee = float(re.search(r"simulated knee ([\d.]+) req/s", out).group(1))
    corrected = dataclasses.replace(ctx, correction=Correction(1.5, 1.0))
    assert knee == pytest.approx(predicted_knee_rps(corrected, shape, knee_trace, 1.0)[0], rel=2e-2)
    assert knee < uncorrected_knee * 0.8  # prefill is the bottleneck: 1.5x slower, a lower knee
    assert len(rows) == 3 and out.count("with the profile as measured: attainment") == 3
    assert out.count("this run's iterations against the profile: prefill x1.50") == 3
    assert out.count("with this run's own factors and drift: attainment") == 3
    # each rate after the first is predicted with the factors of the run just before it
    sources = re.findall(r"simulated with the factors of (.*?): prefill x1.50", out)
    assert sources == ["the calibration"] + [f"the run at {r:g} req/s" for r, *_ in rows[:2]]
    # and each set beside the run before it on the very same prefill batches
    befores = re.findall(r"^  the same prefill batches as in (.*?): ", out, re.M)
    assert befores == ["the calibration"] + [f"the run before ({r:g} req/s)" for r, *_ in rows[:2]]
    # and replayed at its own speed as it moved, whose verdicts the last line counts
    assert out.count("replaying this run's speed as it moved (prefill x1.50, decode x1.00; "
                     "prefill x1.00-1.00 over 1 window of 10 s") == 3
    met = [int(n) for n in re.findall(r"^    gap attainment .*: (\d) of 5 within the goal$", out,
                                      re.M)]
    replayed = re.search(r"replaying each run's speed as it moved .* for attainment at (\d) of "
                         r"3 runs and for (\d+) of 12 percentiles", out)
    assert len(met) == 3 and sum(met) == int(replayed.group(1)) + int(replayed.group(2))


def test_repeated_replays_are_each_set_beside_their_own_speed_as_it_moved(capsys):
    spec, shape, ctx = deployment(0)
    trace = _sample_trace(spec, 12)
    fake = SlowPrefillDeployment(ctx)

    def launch(settings, port):
        return contextlib.nullcontext(SimpleNamespace(url=f"http://127.0.0.1:{port}"))

    compare_deployment(spec, None, "local", "/model", 0, trace, [0.5], 18000, drive_fn=fake.drive,
                       launch=launch, iterations_fn=lambda _: fake.iterations, repeat=2)
    out = capsys.readouterr().out
    # each replay's own gap, as printed under it, comes back in the replays' summary
    gaps = re.findall(r"^    gap attainment ([+-][\d.]+ pt), TTFT p50 ([+-][\d.]+%)", out, re.M)
    assert len(gaps) == 2
    summary = out[out.index("2 replays of the same requests"):]
    (attainment,) = [line for line in summary.splitlines() if line.startswith("  attainment")]
    assert attainment.endswith(f"; replaying each one's speed as it moved, gaps "
                               f"{gaps[0][0]}, {gaps[1][0]}")
    (ttft,) = [line for line in summary.splitlines() if line.startswith("  TTFT p50")]
    assert ttft.endswith(f"; replaying each one's speed as it moved, gaps {gaps[0][1]}, "
                         f"{gaps[1][1]}")


def test_fidelity_saves_each_run_to_be_predicted_again_offline(tmp_path, capsys):
    spec, shape, ctx = deployment(0)
    trace, calibration = _sample_trace(spec, 12), _sample_trace(spec, 10, skip=12)
    fake = SlowPrefillDeployment(ctx)

    def launch(settings, port):
        return contextlib.nullcontext(SimpleNamespace(url=f"http://127.0.0.1:{port}"))

    compare_deployment(spec, None, "local", "/model", 0, trace, [0.5, 0.8], 18000,
                       drive_fn=fake.drive, launch=launch, calibration=calibration,
                       iterations_fn=lambda _: fake.iterations, save_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "disaggregated-calibration.json", "disaggregated-rate-1.json", "disaggregated-rate-2.json"]
    _, calibrated, first, second = fake.sent
    run = load_run(tmp_path / "disaggregated-rate-2.json")
    assert (run["deployment"], run["num_colocated"], run["rate"]) == ("disaggregated", 0, 0.8)
    assert run["requests"] == second  # what was sent, at its rate
    assert [o.ttft_s for o in run["outcomes"]] == [1.0] * len(second)
    assert run["iterations"] == fake.iterations and run["started_s"] <= run["ended_s"]
    saved = load_run(tmp_path / "disaggregated-calibration.json")
    assert saved["requests"] == calibrated and saved["label"] == "calibration"
    # the saved iterations fit as the live ones did
    fit = fit_window(ctx, shape, run["iterations"], run["started_s"])
    assert fit.correction.prefill_factor == pytest.approx(1.5)


def test_fidelity_predicts_the_rest_of_each_run_from_its_first_requests_iterations(capsys):
    spec, shape, ctx = deployment(0)
    trace = _sample_trace(spec, 2 * IN_RUN_REQUESTS + 20)
    fake = SlowPrefillDeployment(ctx)

    def launch(settings, port):
        return contextlib.nullcontext(SimpleNamespace(url=f"http://127.0.0.1:{port}"))

    compare_deployment(spec, None, "local", "/model", 0, trace, [0.5], 18000,
                       drive_fn=fake.drive, launch=launch, iterations_fn=lambda _: fake.iterations)
    out = capsys.readouterr().out
    head = (f"1 prefill + 1 decode, the run's requests after its first {IN_RUN_REQUESTS}, "
            "simulated with the factors of the iterations while those arrived (prefill x1.50, "
            f"decode x1.00) at 0.5 req/s: {IN_RUN_REQUESTS + 20} requests, 0 errors")
    assert head in out
    block = out[out.index(head):].splitlines()
    assert block[1].startswith("  attainment  measured 100.0%")  # answered at once, all met


def test_the_knee_is_judged_in_steady_state_not_on_a_burst_that_drains():
    spec, shape, ctx = deployment(2)
    burst_knee, _ = predicted_knee_rps(ctx, shape, _sample_trace(spec, 12), 1.0)
    steady_knee, _ = predicted_knee_rps(ctx, shape, _sample_trace(spec, KNEE_TRACE_REQUESTS), 1.0)
    # twelve requests at a high rate arrive as one burst that drains within the TTFT SLO
    assert steady_knee < 0.8 * burst_knee


def test_fidelity_says_when_an_instance_no_longer_holds_the_start_of_a_run(capsys, monkeypatch):
    import distserve_engine.instance.iterations as iterations

    spec, shape, ctx = deployment(0)
    trace = _sample_trace(spec, 12)
    fake = SlowPrefillDeployment(ctx)
    monkeypatch.setattr(iterations, "ITERATION_HISTORY", 5)  # the log full after 5

    def launch(settings, port):
        return contextlib.nullcontext(SimpleNamespace(url=f"http://127.0.0.1:{port}"))

    compare_deployment(spec, None, "local", "/model", 0, trace, [0.5], 18000,
                       drive_fn=fake.drive, launch=launch, iterations_fn=lambda _: fake.iterations)
    out = capsys.readouterr().out
    # every iteration the fake logs is stamped after the run began: the log's oldest too
    assert re.search(r"note: prefill-0 keeps its last 5 iterations, which began \d+ s into "
                     r"the window: the fit is of those", out)
