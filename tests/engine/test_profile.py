"""The hardware profiler: its fits, a real profile of the tiny Llama, and `distserve profile`."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from distserve_engine.config import EngineConfig
from distserve_engine.profile import (
    ProfileGrid,
    Timing,
    fit_abc,
    fit_decode,
    profile_runner,
)
from distserve_engine.runner import ModelRunner


def make_timings(abc, points, noise=()) -> list[Timing]:
    """Timings exactly on a + b*x1 + c*x2, each scaled by (1 + noise[i]) where given."""
    a, b, c = abc
    scales = list(noise) + [0.0] * (len(points) - len(noise))
    return [Timing(x1, x2, (a + b * x1 + c * x2) * (1 + s), f"p{i}")
            for i, ((x1, x2), s) in enumerate(zip(points, scales, strict=True))]


PREFILL_POINTS = [(n, n * n) for n in (16, 64, 256, 512)] + [(512, 4 * 128 * 128), (512, 2 * 256 * 256)]


def test_fit_recovers_the_coefficients_of_exact_timings():
    fitted = fit_abc(make_timings((20.0, 0.5, 1e-4), PREFILL_POINTS))
    assert fitted == pytest.approx((20.0, 0.5, 1e-4), rel=1e-6)


def test_fit_never_returns_a_negative_coefficient():
    # The S2 term is pushed negative by noise: an unconstrained fit would go below zero.
    timings = make_timings((20.0, 0.5, 0.0), PREFILL_POINTS, noise=(0, 0, 0.02, -0.05, 0.05, 0.05))
    a, b, c = fit_abc(timings)
    assert min(a, b, c) >= 0.0
    for t in timings:
        assert a + b * t.x1 + c * t.x2 == pytest.approx(t.ms, rel=0.1)


def test_decode_fit_splits_where_the_batch_cost_changes():
    contexts = (64, 256, 512)
    small = [(b * (ctx + 1), b) for b in (1, 2, 4) for ctx in contexts]
    large = [(b * (ctx + 1), b) for b in (8, 16, 32) for ctx in contexts]
    timings = make_timings((10.0, 0.001, 2.0), small) + make_timings((20.0, 0.001, 0.5), large)
    small_abc, large_abc, large_from = fit_decode(timings)
    assert large_from == 8
    assert small_abc == pytest.approx((10.0, 0.001, 2.0), rel=1e-6)
    assert large_abc == pytest.approx((20.0, 0.001, 0.5), rel=1e-6)


def test_decode_fit_keeps_one_line_when_a_split_does_not_help():
    points = [(b * (ctx + 1), b) for b in (1, 2, 4, 8) for ctx in (64, 512)]
    small_abc, large_abc, large_from = fit_decode(make_timings((10.0, 0.001, 2.0), points))
    assert small_abc == large_abc == pytest.approx((10.0, 0.001, 2.0), rel=1e-6)
    assert large_from > 8


def test_the_default_grid_times_decode_batches_on_both_sides_of_the_cpu_layout_switch():
    # a CPU linear of 3 rows or more runs another weight layout than one of 1-2 rows
    assert ProfileGrid.default().decode_batch_sizes == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    assert ProfileGrid.default(max_decode_batch=4).decode_batch_sizes == (1, 2, 3, 4)
    assert ProfileGrid.default(max_decode_batch=2).decode_batch_sizes == (1, 2)
    # a step whose cost jumps from 3 rows on is split there, the small side fitted on 1-2
    points = [(b * ctx, b) for b in (1, 2, 3, 4, 6, 8) for ctx in (64, 256, 512)]  # (T, B)
    timings = make_timings((30.0, 0.01, 10.0), [p for p in points if p[1] < 3]) + \
        make_timings((45.0, 0.015, 1.0), [p for p in points if p[1] >= 3])
    small_abc, large_abc, large_from = fit_decode(timings)
    assert large_from == 3
    assert small_abc == pytest.approx((30.0, 0.01, 10.0), rel=1e-6)
    assert large_abc == pytest.approx((45.0, 0.015, 1.0), rel=1e-6)


def test_the_default_grid_times_prompt_lengths_between_the_powers_of_two():
    singles = [b[0] for b in ProfileGrid.default(max_prefill_tokens=512).prefill_batches
               if len(b) == 1]
    assert singles == [16, 17, 32, 41, 64, 89, 128, 185, 256, 377, 512]
    # one between each two powers, odd, and not a multiple of a padded product's row step
    assert all(n % 2 == 1 and n % 16 for n in singles[1::2])
    assert [b[0] for b in ProfileGrid.default(max_prefill_tokens=16).prefill_batches] == [16]


@pytest.fixture(scope="module")
def tiny_runner(tiny_llama_dir):
    """The tiny Llama on one thread, as `distserve up` runs an instance on the CPU."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ModelRunner(EngineConfig(model=str(tiny_llama_dir), num_blocks=96, block_size=16))
    torch.set_num_threads(previous_threads)


def test_profile_of_the_tiny_llama_reproduces_its_timings(tiny_runner):
    grid = ProfileGrid.default(max_prefill_tokens=128, max_decode_batch=4, max_context_len=128)
    profile = profile_runner(tiny_runner, grid)
    assert len(profile.prefill_timings) == len(grid.prefill_batches)
    assert len(profile.decode_timings) == len(grid.decode_batch_sizes) * len(grid.decode_context_lens)
    for abc in (profile.prefill_abc, profile.decode_small_batch_abc, profile.decode_large_batch_abc):
        assert min(abc) >= 0.0
    # No bound on the fit error here: a 2-layer model's timings are mostly Python overhead
    # and scheduler noise on a shared machine. The fit itself is checked on exact data above.
    assert profile.prefill_error.max_rel >= profile.prefill_error.mean_rel >= 0.0
    t = profile.prefill_timings[-1]
    assert profile.prefill_error.max_rel >= abs(
        profile.prefill_abc[0] + profile.prefill_abc[1] * t.x1 + profile.prefill_abc[2] * t.x2 - t.ms
    ) / t.ms
    assert profile.kv_capacity_tokens == 96 * 16
    assert tiny_runner.block_manager.num_free_blocks == 96  # every timed sequence was freed


def test_a_grid_that_does_not_fit_the_cache_is_refused(tiny_runner):
    grid = ProfileGrid(prefill_batches=((4096,),), decode_batch_sizes=(1,), decode_context_lens=(64,))
    with pytest.raises(ValueError, match="fewer than 3"):
        profile_runner(tiny_runner, grid)


def write_tiny_spec(tmp_path, model_dir, profile_path=None) -> str:
    """A CPU spec of the tiny Llama with a small grid (Lm 64, decode batches up to 4)."""
    planner = {"maxPrefillTokens": 64, "maxDecodeBatch": 4}
    if profile_path:
        planner["profilePath"] = profile_path
    spec = {
        "model": {"name": str(model_dir), "path": str(model_dir), "maxModelLen": 512},
        "slo": {"ttftSeconds": 1.0, "tpotSeconds": 0.1},
        "cluster": {"accelerator": "CPU", "nodes": 1, "gpusPerNode": 2},
        "planner": planner,
        "engine": {"device": "cpu"},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "distserve.io/v1alpha1",
                                    "kind": "DistServeDeployment",
                                    "metadata": {"name": "tiny"}, "spec": spec}))
    return str(path)


def test_profile_command_writes_a_profile_the_planner_reads(tmp_path, tiny_llama_dir, capsys):
    from distserve.cli import main
    from distserve.cli.profile import ROW_MS_DIGITS
    from distserve.latency import choose_source, get_latency_model, kv_capacity_tokens
    from distserve.spec import load_manifest

    out = tmp_path / "tiny-cpu.json"
    assert main(["profile", "-f", write_tiny_spec(tmp_path, tiny_llama_dir), "-o", str(out),
                 "--repeats", "1"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["accelerator"] == "CPU" and doc["device"]["threads"] == 1
    assert doc["provenance"]["command"].startswith("distserve profile")
    (model_name,) = doc["engines"]["disaggregated"]["models"]
    # The spec names the profile relative to its own folder; the planner finds it.
    spec = load_manifest(write_tiny_spec(tmp_path, tiny_llama_dir, out.name)).spec
    choice = choose_source(spec.model.name, "CPU", "profile", spec.planner.profile_path)
    assert choice.source == "profile" and choice.tps == (1,)
    latency = get_latency_model(spec.model.name, "CPU", 1, 1, source="profile",
                                profile_path=spec.planner.profile_path, enable_dispatch_overhead=False)
    # The planner reproduces every measured single-prompt prefill within the reported error
    # (the error is of the unrounded time; the file holds it rounded to half a unit of its last digit).
    half_unit = 0.5 * 10 ** -ROW_MS_DIGITS
    for row in doc["measurements"]["prefill"]:
        if row["S2"] == row["S1"] ** 2:
            planner_ms = latency.prefill_stage_s([row["S1"]]) * 1e3
            allowed = doc["fit_error"]["prefill"]["max_rel"] * (row["ms"] + half_unit) + half_unit
            assert abs(planner_ms - row["ms"]) <= allowed * (1 + 1e-9), (row, planner_ms)
    capacity = kv_capacity_tokens(spec.model.name, "CPU", 1, 1, profile_path=spec.planner.profile_path)
    assert capacity == doc["kv_capacity"]["rows"][0]["kv_capacity_tokens"]
