"""Which latency profile `distserve up` plans with: measured once per machine, then cached;
`--profile` wins; `--no-measure` warns when the spec's profile is another machine's.

The measurement is a fake that writes a profile file (the real one is timed in
tests/serving/test_up_profile.py); the cache lives under a temporary XDG_CACHE_HOME.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import pytest
import yaml

from distserve.local import profiles
from distserve.local.machine import Machine
from distserve.local.profiles import choose_profile
from distserve.spec import load_manifest
from distserve_engine.config import EngineConfig

ENGINE = EngineConfig(model="/models/smollm2", device="cpu", dtype="auto", block_size=16,
                      max_model_len=2048, seed=0)
OTHER_CPU = "Test CPU 9000 (not this one)"
SHIPPED_PROFILE = Path(__file__).parents[2] / "examples" / "profiles" / "cpu-smollm2-135m.json"


def make_profile(path, machine: Machine, date: str = "2026-11-29T16:19:47Z") -> str:
    """A profile file that records the machine and date it was measured on."""
    path.write_text(json.dumps({
        "accelerator": "CPU", "engines": {},
        "device": {"type": machine.device, "threads": machine.threads, "cpu_model": machine.cpu_model,
                   "cpu_cores": machine.cpu_cores, "torch": machine.torch},
        "provenance": {"date": date},
    }))
    return str(path)


def write_spec(tmp_path, profile_path: str | None = None, max_decode_batch: int = 32) -> Path:
    """A CPU spec file of SmolLM2 (weights in tmp_path), with planner.profilePath when given."""
    planner = {"maxPrefillTokens": 512, "maxDecodeBatch": max_decode_batch}
    if profile_path:
        planner["profilePath"] = profile_path
    doc = {"apiVersion": "distserve.io/v1alpha1", "kind": "DistServeDeployment",
           "metadata": {"name": "local"},
           "spec": {"model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "path": str(tmp_path)},
                    "slo": {"ttftSeconds": 6.0, "tpotSeconds": 0.4},
                    "cluster": {"accelerator": "CPU", "nodes": 1, "gpusPerNode": 2},
                    "planner": planner, "engine": {"device": "cpu"}}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def make_spec(tmp_path, profile_path: str | None = None, max_decode_batch: int = 32):
    """The spec of write_spec, loaded."""
    return load_manifest(write_spec(tmp_path, profile_path, max_decode_batch)).spec


class FakeMeasure:
    """Writes this machine's profile where asked and counts the calls."""

    def __init__(self, error: Exception | None = None) -> None:
        self.paths, self.error = [], error

    def __call__(self, path, key: dict) -> None:
        if self.error:
            raise self.error
        self.paths.append(path)
        make_profile(path, Machine.here("cpu"), "2026-12-01T10:00:00Z")


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_first_use_measures_and_caches_then_the_cache_is_read(tmp_path, cache_home):
    spec, measure, lines = make_spec(tmp_path), FakeMeasure(), []
    first = choose_profile(spec, ENGINE, None, True, measure, lines.append)
    assert len(measure.paths) == 1 and first.origin == "measured"
    assert first.path == str(measure.paths[0])
    assert first.path.startswith(str(cache_home / "distserve" / "profiles"))
    assert any(line.startswith("measuring this machine's latency profile") for line in lines)
    lines.clear()
    second = choose_profile(spec, ENGINE, None, True, measure, lines.append)
    assert len(measure.paths) == 1  # not measured again
    assert second.origin == "cached" and second.path == first.path and second.is_this_machine
    assert lines == []
    assert second.describe() == (f"{first.path} (cached; measured on 2026-12-01T10:00:00Z on this "
                                 f"machine: {Machine.here('cpu').describe()})")


def test_a_change_the_timings_depend_on_measures_anew(tmp_path):
    measure = FakeMeasure()
    choose_profile(make_spec(tmp_path), ENGINE, None, True, measure, print)
    choose_profile(make_spec(tmp_path, max_decode_batch=8), ENGINE, None, True, measure, print)
    choose_profile(make_spec(tmp_path), dataclasses.replace(ENGINE, dtype="bfloat16"), None, True, measure, print)
    assert len(set(measure.paths)) == 3


def test_a_change_of_the_engines_c_kernels_measures_anew(tmp_path, monkeypatch):
    measure = FakeMeasure()
    choose_profile(make_spec(tmp_path), ENGINE, None, True, measure, print)
    monkeypatch.setattr(profiles, "_kernels_digest", lambda: "another source")
    choose_profile(make_spec(tmp_path), ENGINE, None, True, measure, print)
    assert len(set(measure.paths)) == 2


def test_profile_flag_wins_over_the_cache(tmp_path):
    spec, measure = make_spec(tmp_path), FakeMeasure()
    choose_profile(spec, ENGINE, None, True, measure, print)  # fills the cache
    given = make_profile(tmp_path / "mine.json", Machine("cpu", OTHER_CPU, 64, 1, "2.13.0+cpu"))
    source = choose_profile(spec, ENGINE, given, True, measure, print)
    assert source.path == given and source.origin == "--profile" and not source.is_this_machine
    assert len(measure.paths) == 1
    assert source.describe() == (f"{given} (given by --profile; measured on 2026-11-29T16:19:47Z on "
                                 f"another machine: 1 thread of {OTHER_CPU} (64 cores), torch 2.13.0+cpu)")


def test_an_unreadable_profile_flag_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"^--profile: .*missing\.json"):
        choose_profile(make_spec(tmp_path), ENGINE, str(tmp_path / "missing.json"), True,
                       FakeMeasure(), print)


def test_no_measure_warns_that_the_spec_profile_is_another_machines(tmp_path):
    other = Machine("cpu", OTHER_CPU, 2, 1, "2.13.0+cpu")
    spec_profile = make_profile(tmp_path / "shipped.json", other)
    measure, lines = FakeMeasure(), []
    source = choose_profile(make_spec(tmp_path, spec_profile), ENGINE, None, False, measure, lines.append)
    assert source.path == spec_profile and source.origin == "spec" and measure.paths == []
    (warning,) = lines
    assert warning.startswith(f"warning: predictions come from {spec_profile}, measured on 1 thread "
                              f"of {OTHER_CPU} (2 cores)")
    assert f"not on this machine ({Machine.here('cpu').describe()})" in warning


def test_a_failed_measurement_falls_back_to_the_spec_profile_with_a_warning(tmp_path):
    spec_profile = make_profile(tmp_path / "shipped.json", Machine("cpu", OTHER_CPU, 2, 1, "x"))
    lines = []
    source = choose_profile(make_spec(tmp_path, spec_profile), ENGINE, None, True,
                            FakeMeasure(RuntimeError("the engine is not installed")), lines.append)
    assert source.path == spec_profile
    assert "warning: could not measure this machine's profile: the engine is not installed" in lines
    assert any(line.startswith("warning: predictions come from") for line in lines)


def test_on_a_gpu_nothing_is_measured(tmp_path):
    measure = FakeMeasure()
    source = choose_profile(make_spec(tmp_path), dataclasses.replace(ENGINE, device="cuda"), None, True, measure, print)
    assert measure.paths == [] and source.path is None


def test_the_shipped_profile_records_the_machine_it_was_measured_on():
    doc = json.loads(SHIPPED_PROFILE.read_text())
    machine = Machine.of_profile(doc)
    assert machine == Machine("cpu", "Intel(R) Xeon(R) Processor", 2, 1, "2.13.0+cpu")


def test_up_refuses_an_unreadable_profile_before_starting_anything(tmp_path, capsys):
    from distserve.cli import main

    spec = write_spec(tmp_path)
    sigterm_handler = signal.getsignal(signal.SIGTERM)  # `up` sets its own
    try:
        assert main(["up", "-f", str(spec), "--profile", str(tmp_path / "missing.json")]) == 2
    finally:
        signal.signal(signal.SIGTERM, sigterm_handler)
    err = capsys.readouterr().err
    assert err.startswith(f"error: --profile: {tmp_path / 'missing.json'}: cannot read a latency profile")
    assert "work folder" not in err and "planning" not in err
