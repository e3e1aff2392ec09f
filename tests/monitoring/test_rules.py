"""The rules file: promtool accepts it, and `promtool test rules` shows each alert firing on
the series that must fire it and staying quiet on those that must not (a burn within the
error budget, a burn that stopped, a load above the plan's goodput)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from distserve.monitoring import rules

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "charts" / "distserve" / "files" / "rules.yaml"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
GROUP = {"namespace": "serving", "deployment": "chat", "model_name": "opt-66b"}
SELECTOR = ", ".join(f'{k}="{v}"' for k, v in GROUP.items())
MINUTES = 240  # the series' length


def promtool(*args: str) -> subprocess.CompletedProcess:
    if not Path(PROMTOOL).exists():
        pytest.skip("promtool not found: apt-get install prometheus (scripts/setup-dev.sh does)")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def traffic(arrived_per_min: int, met_per_min: int, minutes: int = MINUTES) -> list[dict]:
    """Requests arriving and meeting both SLOs at steady rates."""
    return [{"series": f"distserve_requests_arrived_total{{{SELECTOR}, role=\"router\"}}",
             "values": f"0+{arrived_per_min}x{minutes}"},
            {"series": f"distserve_slo_met_requests_total{{{SELECTOR}, role=\"router\", slo=\"both\"}}",
             "values": f"0+{met_per_min}x{minutes}"}]


def expected(name: str, **extra: str) -> dict:
    """The alert `name` as it fires for GROUP (+ extra labels), annotations rendered."""
    alert = next(a for a in rules.alerts() if a.name == name)
    labels = {**GROUP, **extra}
    if name == "DistServeDeploymentDegraded":
        labels = {k: v for k, v in labels.items() if k != "model_name"}

    def render(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)

    return {"exp_labels": {**labels, "severity": alert.severity},
            "exp_annotations": {"summary": render(alert.summary),
                                "description": render(alert.description)}}


def case(input_series: list[dict], *checks: tuple[str, str, list[dict]]) -> dict:
    """One promtool test: series, then (eval time, alert, alerts expected) checks."""
    return {"interval": "1m", "input_series": input_series,
            "alert_rule_test": [{"eval_time": t, "alertname": name, "exp_alerts": exp}
                                for t, name, exp in checks]}


FAST, SLOW = "DistServeAttainmentBudgetFastBurn", "DistServeAttainmentBudgetSlowBurn"


def burn_cases() -> list[dict]:
    every_request_misses = case(traffic(60, 0), ("10m", FAST, [expected(FAST)]),
                                ("10m", SLOW, [expected(SLOW)]))
    within_budget = case(traffic(100, 95), ("30m", FAST, []), ("3h", FAST, []),
                         ("3h", SLOW, []))
    # 70% miss: the 6h/30m pair pages (0.6); 40% miss: only the 1d/2h ticket (0.3).
    seventy = case(traffic(100, 30), ("45m", FAST, [expected(FAST)]))
    forty = case(traffic(100, 60), ("3h", FAST, []), ("3h", SLOW, [expected(SLOW)]))
    # An hour of misses, then every request met: the 5m window clears the page at once.
    stopped = case([traffic(60, 0)[0],
                    {"series": traffic(60, 0)[1]["series"], "values": "0+0x60 60+60x120"}],
                   ("40m", FAST, [expected(FAST)]), ("90m", FAST, []))
    return [every_request_misses, within_budget, seventy, forty, stopped]


def other_cases() -> list[dict]:
    held = f"distserve_kv_held_requests{{{SELECTOR}, role=\"prefill\", instance=\"prefill-0\"}}"
    pulls = f"distserve_kv_transfer_seconds_count{{{SELECTOR}, role=\"router\", transport=\"tcp\"}}"
    stall = case([{"series": held, "values": "2x30"}, {"series": pulls, "values": "100x30"}],
                 ("3m", "DistServeKVTransferStalled", []),  # not yet for 5m
                 ("10m", "DistServeKVTransferStalled", [expected("DistServeKVTransferStalled")]))
    flowing = case([{"series": held, "values": "2x30"}, {"series": pulls, "values": "100+10x30"}],
                   ("10m", "DistServeKVTransferStalled", []))
    healthy = f'distserve_instance_healthy{{{SELECTOR}, role="decode", instance="decode-1"}}'
    unhealthy = case([{"series": healthy, "values": "1 1 0x20"}],
                     ("1m", "DistServeInstanceUnhealthy", []),
                     ("10m", "DistServeInstanceUnhealthy",
                      [expected("DistServeInstanceUnhealthy", role="decode", instance="decode-1")]))
    phase = 'distserve_deployment_phase{{namespace="serving", deployment="chat", phase="{}"}}'
    degraded = case([{"series": phase.format("Degraded"), "values": "0 0 1x30"},
                     {"series": phase.format("Ready"), "values": "1 1 0x30"}],
                    ("5m", "DistServeDeploymentDegraded", []),
                    ("20m", "DistServeDeploymentDegraded", [expected("DistServeDeploymentDegraded")]))
    plan = f'{{{SELECTOR}, role="router", instance="router", plan_id="p1"}}'
    predicted = [{"series": f"distserve_plan_predicted_attainment{plan}", "values": "0.95x120"},
                 {"series": f"distserve_plan_predicted_goodput_rps{plan}", "values": "2x120"}]
    name = "DistServeAttainmentBelowPrediction"
    # 60% met at 1 req/s (within the plan's 2 req/s): far below 95%; at 3 req/s the plan
    # is overloaded, which is the replanner's business, not this alert's.
    below = case(traffic(60, 36, 120) + predicted, ("60m", name, [expected(name)]))
    overloaded = case(traffic(180, 108, 120) + predicted, ("60m", name, []))
    return [stall, flowing, unhealthy, degraded, below, overloaded]


def test_promtool_checks_the_rules_file():
    result = promtool("check", "rules", str(RULES_FILE))
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules.recording_rules()) + len(rules.alerts())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_alerts(tmp_path):
    tests = {"rule_files": [str(RULES_FILE)], "evaluation_interval": "1m",
             "tests": burn_cases() + other_cases()}
    test_file = tmp_path / "rules_test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = promtool("test", "rules", str(test_file))
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_broken_expectation_fails_promtool(tmp_path):
    """The unit tests can fail: a burn within budget expected to page does not pass."""
    wrong = case(traffic(100, 95), ("30m", FAST, [expected(FAST)]))
    test_file = tmp_path / "wrong_test.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(RULES_FILE)], "tests": [wrong]}))
    result = promtool("test", "rules", str(test_file))
    assert result.returncode != 0 and FAST in result.stdout + result.stderr


def test_burn_thresholds_follow_the_workbook_capped_at_every_request():
    assert [rules.burn_threshold(f) for f in (14.4, 6.0, 3.0, 1.0)] == [1.0, 0.6, 0.3, 0.1]
    assert rules.ERROR_BUDGET == pytest.approx(1 - rules.ATTAINMENT_OBJECTIVE)
