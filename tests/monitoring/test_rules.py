"""The rules file: promtool accepts it, and `promtool test rules` shows each alert firing on
the series that must fire it and staying quiet on those that must not (a burn within the
error budget, a burn that stopped, a load above the plan's goodput), each deployment's
budget measured against its own attainment objective (90% where it exports none)."""

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


def selector(group: dict[str, str]) -> str:
    return ", ".join(f'{k}="{v}"' for k, v in group.items())


def traffic(arrived_per_min: int, met_per_min: int, minutes: int = MINUTES,
            group: dict[str, str] = GROUP) -> list[dict]:
    """Requests arriving and meeting both SLOs at steady rates."""
    labels = f'{selector(group)}, role="router", instance="router-0"'
    return [{"series": f"distserve_requests_arrived_total{{{labels}}}",
             "values": f"0+{arrived_per_min}x{minutes}"},
            {"series": f"distserve_slo_met_requests_total{{{labels}, slo=\"both\"}}",
             "values": f"0+{met_per_min}x{minutes}"}]


def objective(attainment: float, group: dict[str, str] = GROUP) -> dict:
    """The attainment objective the router exports (spec.slo.attainment)."""
    return {"series": f'distserve_slo_attainment_objective{{{selector(group)}, role="router", '
                      f'instance="router-0"}}', "values": f"{attainment}x{MINUTES}"}


def expected(name: str, objective_text: str = "90%", group: dict[str, str] = GROUP,
             **extra: str) -> dict:
    """The alert `name` as it fires for `group` (+ extra labels), annotations rendered (a
    burn alert's value is the objective)."""
    alert = next(a for a in rules.alerts() if a.name == name)
    labels = {**group, **extra}
    if name == "DistServeDeploymentDegraded":
        labels = {k: v for k, v in labels.items() if k != "model_name"}

    def render(text: str) -> str:
        text = text.replace("{{ $value | humanizePercentage }}", objective_text)
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
    # 70% miss burns a 10% budget 7x: the 6h/30m pair (6x) pages; 40% (4x): only the 1d/2h ticket (3x).
    seventy = case(traffic(100, 30), ("45m", FAST, [expected(FAST)]))
    forty = case(traffic(100, 60), ("3h", FAST, []), ("3h", SLOW, [expected(SLOW)]))
    # An hour of misses, then every request met: the 5m window clears the page at once.
    stopped = case([traffic(60, 0)[0],
                    {"series": traffic(60, 0)[1]["series"], "values": "0+0x60 60+60x120"}],
                   ("40m", FAST, [expected(FAST)]), ("90m", FAST, []))
    return [every_request_misses, within_budget, seventy, forty, stopped]


def objective_cases() -> list[dict]:
    """The same misses burn a 99% objective's budget ten times faster than a 90% one's."""
    # 20% miss: burn 20x a 1% budget (pages), 2x a 10% budget (no page).
    strict = case(traffic(100, 80) + [objective(0.99)], ("10m", FAST, [expected(FAST, "99%")]))
    default = case(traffic(100, 80), ("10m", FAST, []), ("3h", FAST, []))
    # 5% miss: 5x a 1% budget is a ticket, not a page; within a 10% budget (within_budget).
    ticket = case(traffic(100, 95) + [objective(0.99)], ("30m", FAST, []),
                  ("3h", SLOW, [expected(SLOW, "99%")]))
    # Two deployments, the same 20% miss: only the one with the 99% objective pages.
    other = {**GROUP, "deployment": "batch"}
    side_by_side = case(traffic(100, 80) + [objective(0.99)] + traffic(100, 80, group=other),
                        ("10m", FAST, [expected(FAST, "99%")]))
    # An exported 90% is the default's 90%: every request missing pages, 70% does not.
    exported = case(traffic(60, 0) + [objective(0.9)], ("10m", FAST, [expected(FAST)]))
    return [strict, default, ticket, side_by_side, exported]


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
             "tests": burn_cases() + objective_cases() + other_cases()}
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
