"""A measured CPU profile as the planner reads it, and `distserve profile`'s input errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from distserve.cli import main
from distserve.cli.profile import profile_document
from distserve.latency import choose_source, get_latency_model, kv_capacity_tokens, load_profile
from distserve.spec import load_manifest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def make_measured(prefill_abc=(120.0, 4.0, 1e-3), decode_abc=(110.0, 0.02, 3.0)) -> SimpleNamespace:
    """What the engine's profiler returns, with round coefficients (ms)."""
    fit = SimpleNamespace(mean_rel=0.05, max_rel=0.1)
    return SimpleNamespace(
        prefill_abc=prefill_abc, decode_small_batch_abc=decode_abc, decode_large_batch_abc=decode_abc,
        large_batch_from=33, kv_capacity_tokens=23296, prefill_error=fit, decode_error=fit,
        device="cpu", threads=1, seconds=60.0, prefill_timings=[], decode_timings=[],
        fit_entry=lambda: {"prefill_abc": [prefill_abc[0] - 1.0, *prefill_abc[1:]],
                           "decode_small_batch_abc": list(decode_abc),
                           "decode_large_batch_abc": list(decode_abc), "large_batch_from": 33},
    )


def write_profile(tmp_path, measured=None) -> Path:
    """A CPU profile of SmolLM2 as `distserve profile` writes it."""
    provenance = {"about": "test profile", "device": {"type": "cpu", "threads": 1}, "command": "test"}
    doc = profile_document(measured or make_measured(), SMOLLM2, "CPU", provenance)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(doc))
    return path


def write_spec(tmp_path, **planner) -> Path:
    spec = {
        "model": {"name": SMOLLM2},
        "slo": {"ttftSeconds": 6.0, "tpotSeconds": 0.4},
        "cluster": {"accelerator": "CPU", "nodes": 1, "gpusPerNode": 2},
        "planner": planner,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "distserve.io/v1alpha1", "kind": "DistServeDeployment",
                                    "metadata": {"name": "cpu"}, "spec": spec}))
    return path


def test_a_written_profile_times_the_cpu_as_measured(tmp_path):
    path = write_profile(tmp_path)
    assert load_profile(path).accelerator_name == "CPU"
    assert choose_source(SMOLLM2, "CPU", "auto", path).source == "profile"
    latency = get_latency_model(SMOLLM2, "CPU", 1, 1, profile_path=path, enable_dispatch_overhead=False)
    assert latency.prefill_stage_s([100]) == pytest.approx((120.0 + 4.0 * 100 + 1e-3 * 100**2) * 1e-3)
    assert latency.decode_stage_s([65, 257]) == pytest.approx((110.0 + 0.02 * 322 + 3.0 * 2) * 1e-3)
    assert kv_capacity_tokens(SMOLLM2, "CPU", 1, 1, profile_path=path) == 23296
    # Both serving modes come from the same runner, so the baselines are timed from it too.
    assert choose_source(SMOLLM2, "CPU", "auto", path).serving_modes == ("disaggregated", "colocated")


def test_a_cpu_profile_is_not_used_for_a_gpu(tmp_path):
    path = write_profile(tmp_path)
    assert choose_source(SMOLLM2, "A100-80GB", "auto", path).source == "analytic"
    with pytest.raises(ValueError, match="measured on CPU, not A100-80GB"):
        choose_source(SMOLLM2, "A100-80GB", "profile", path)
    assert kv_capacity_tokens(SMOLLM2, "A100-80GB", 1, 1, profile_path=path) != 23296


def test_a_relative_profile_path_is_read_beside_the_spec(tmp_path, monkeypatch):
    write_profile(tmp_path)
    spec_path = write_spec(tmp_path, profilePath="cpu.json", latencyModel="profile")
    monkeypatch.chdir("/")
    spec = load_manifest(spec_path).spec
    assert spec.planner.profile_path == str(tmp_path / "cpu.json")
    assert choose_source(SMOLLM2, "CPU", "profile", spec.planner.profile_path).source == "profile"


def test_the_committed_cpu_profile_is_used_by_the_local_example():
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    choice = choose_source(spec.model.name, spec.cluster.accelerator, spec.planner.latency_model,
                           spec.planner.profile_path)
    assert choice.source == "profile" and choice.tps == (1,)
    doc = json.loads(Path(spec.planner.profile_path).read_text())
    for key in ("command", "date", "load_average_1_5_15"):
        assert key in doc["provenance"]
    latency = get_latency_model(spec.model.name, "CPU", 1, 1, profile_path=spec.planner.profile_path)
    # A 512-token prompt on one core takes seconds, not the analytic model's tenths.
    assert latency.prefill_stage_s([512]) > 0.5


def test_profile_of_a_missing_spec_file_is_an_error(tmp_path, capsys):
    assert main(["profile", "-f", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "nope.yaml: no such file" in err and "Traceback" not in err


@pytest.mark.parametrize("output, message", [
    ("missing/out.json", "does not exist"),
    (".", "is a folder"),
])
def test_profile_to_an_unwritable_output_fails_before_measuring(tmp_path, capsys, output, message):
    spec = write_spec(tmp_path)
    assert main(["profile", "-f", str(spec), "-o", str(tmp_path / output)]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_profile_refuses_zero_threads(tmp_path, capsys):
    assert main(["profile", "-f", str(write_spec(tmp_path)), "-o", str(tmp_path / "p.json"),
                 "--threads", "0"]) == 1
    assert "--threads: must be >= 1" in capsys.readouterr().err
