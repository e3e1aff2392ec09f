"""`distserve plan` and `distserve simulate` as a user runs them (in-process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from distserve.cli import main


def write_spec(tmp_path, **spec_overrides) -> str:
    """A small OPT-13B manifest on one node of 4 A100s; returns its path."""
    spec = {
        "model": {"name": "facebook/opt-13b"},
        "slo": {"ttftSeconds": 0.4, "tpotSeconds": 0.1},
        "cluster": {"nodes": 1, "gpusPerNode": 4, "accelerator": "A100-80GB"},
        "planner": {"numRequests": 100, "workers": 1},
    }
    spec.update(spec_overrides)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "distserve.io/v1alpha1", "kind": "DistServeDeployment",
        "metadata": {"name": "opt-13b-test"}, "spec": spec,
    }))
    return str(path)


def test_plan_json_is_one_object_with_the_plan_and_baselines(tmp_path, capsys):
    assert main(["plan", "-f", write_spec(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    for key in ("num_gpus", "per_gpu_goodput_rps", "attainment", "search_seconds"):
        assert key in doc
    assert doc["prefill"]["tp"] >= 1 and doc["decode"]["instances"] >= 1
    assert doc["baselines"]["colocated"]["per_gpu_goodput_rps"] > 0
    assert doc["latency_source"]["source"] == "profile" and doc["latency_source"]["tps"] == [1, 2, 4]
    assert doc["admit_by_ttft"] is False  # planned for a router that queues, refusing nothing
    assert "algorithm 2" in err  # progress went to stderr


def test_plan_table_shows_placement_latency_and_baselines(tmp_path, capsys):
    assert main(["plan", "-f", write_spec(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in ("goodput", "TTFT", "TPOT", "node-0", "colocated", "chunked_prefill"):
        assert text in out
    assert "latency      profile a100-opt-profile.json (tp 1, 2, 4 only)" in out
    assert "refusals" not in out


def test_plan_for_a_router_that_admits_by_ttft_says_its_refusals_count_as_misses(tmp_path,
                                                                                  capsys):
    path = write_spec(tmp_path, router={"admitByTtft": True}, placement={
        "prefill": {"tp": 1, "pp": 1, "instances": 1}, "decode": {"tp": 1, "pp": 1, "instances": 1}})
    assert main(["plan", "-f", path]) == 0
    out = capsys.readouterr().out
    assert ("refusals     the router turns away a request it predicts would miss the TTFT SLO "
            "(router.admitByTtft); each counted as a miss") in out
    assert main(["plan", "-f", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["admit_by_ttft"] is True


def test_plot_writes_a_png_of_attainment_curves(tmp_path, capsys):
    png = tmp_path / "curves.png"
    assert main(["plan", "-f", write_spec(tmp_path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000  # axes, three curves and a legend, not an empty canvas
    assert f"wrote {png}" in capsys.readouterr().err


def test_invalid_spec_names_the_field_and_exits_2(tmp_path, capsys):
    path = write_spec(tmp_path, slo={"ttftSeconds": -1, "tpotSeconds": 0.1})
    assert main(["plan", "-f", path]) == 2
    err = capsys.readouterr().err
    assert "spec.slo.ttftSeconds" in err and "Traceback" not in err


def test_unknown_model_is_a_spec_error(tmp_path, capsys):
    assert main(["plan", "-f", write_spec(tmp_path, model={"name": "no-such-model"})]) == 2
    assert "spec.model.name" in capsys.readouterr().err


def test_unattainable_slo_exits_nonzero_with_best_attainment(tmp_path, capsys):
    path = write_spec(tmp_path, slo={"ttftSeconds": 0.001, "tpotSeconds": 0.1})
    assert main(["plan", "-f", path]) == 1
    err = capsys.readouterr().err
    assert "no feasible plan" in err and "best attainment found" in err


def test_simulate_summarises_and_writes_csv(tmp_path, capsys):
    csv_path = tmp_path / "requests.csv"
    code = main(["simulate", "-f", write_spec(tmp_path), "--rate", "2",
                 "--prefill", "1x1x1", "--decode", "1x1x1", "--csv", str(csv_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "attainment" in out and "TPOT" in out
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("req_id,arrival_s") and len(rows) == 121  # 2 req/s x 60 s + header


def test_simulate_refuses_a_placement_that_does_not_fit(tmp_path, capsys):
    path = write_spec(tmp_path, model={"name": "facebook/opt-66b"})
    assert main(["simulate", "-f", path, "--rate", "1", "--prefill", "1x1x1", "--decode", "1x1x1"]) == 1
    assert "does not fit" in capsys.readouterr().err


def test_simulate_refuses_an_unprofiled_degree_of_a_profiled_model(tmp_path, capsys):
    path = write_spec(tmp_path)  # OPT-13B is profiled at tp 1, 2 and 4 on A100
    assert main(["simulate", "-f", path, "--rate", "1", "--prefill", "5x1x1", "--decode", "1x1x1"]) == 1
    assert "latencyModel: analytic" in capsys.readouterr().err
    analytic = write_spec(tmp_path, planner={"numRequests": 100, "workers": 1, "latencyModel": "analytic"})
    assert main(["simulate", "-f", analytic, "--rate", "1", "--prefill", "2x1x1", "--decode", "1x1x1"]) == 0
    assert "latency      analytic" in capsys.readouterr().out


def test_python_dash_m_distserve_runs_the_cli_where_it_is_not_installed(tmp_path):
    """Where the package is on the path but not installed (the GPU script's bare machine),
    `python -m distserve` is the console script: same commands, same exit status."""
    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{root / 'operator'}:{root / 'engine'}"}
    planned = subprocess.run([sys.executable, "-m", "distserve", "plan", "-f",
                              write_spec(tmp_path), "--json"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["num_gpus"] >= 2
    missing = subprocess.run([sys.executable, "-m", "distserve", "plan", "-f",
                              str(tmp_path / "absent.yaml")],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode != 0 and "absent.yaml" in missing.stderr
