"""Every PromQL expression the dashboards and rules hold, run against a real Prometheus
scraping a real deployment (router, one prefill and one decode instance over the tiny
model) under generated load, with the template variables substituted.

Each panel query, annotation and recording rule returns data, with every label its
legend names; each alert's signals return data and the alert itself does not fire on
this healthy deployment; the variables list the deployment. The operator's series
(replan decisions, phase) have no exporter in a local deployment: their queries must
run, and are counted apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_process import PrometheusProcess

from distserve.monitoring import promql as q
from distserve.monitoring import rules
from distserve.monitoring.dashboards import BUILDERS
from distserve.monitoring.render import render_dashboard

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "charts" / "distserve" / "files" / "rules.yaml"
NAMESPACE, DEPLOYMENT, MODEL = "test-ns", "monitored", "tiny"
VARIABLES = {"$namespace": NAMESPACE, "$deployment": DEPLOYMENT, "$model": MODEL,
             "$__rate_interval": "10s"}
PLAN_A = {"id": "plan-a", "predicted_attainment": 0.92, "predicted_goodput_rps": 6.0,
          "prefill": "tp1pp1x1", "decode": "tp1pp1x1"}
PLAN_B = {"plan_id": "plan-b", "prefill": "tp1pp1x1", "decode": "tp1pp1x2",
          "predicted_attainment": 0.95, "predicted_goodput_rps": 9.0}
RATE_RPS = 4.0
NUM_REQUESTS = 120
SEED_PROMPT = 11


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
            params, path = {"query": expression.promql, "start": start_s, "end": end_s, "step": 1}, "query_range"
        answer = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        assert answer["status"] == "success", f"{expression.where}: {expression.promql}: {answer}"
        return answer["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        params = {"match[]": match}
        return httpx.get(f"{self.url}/api/v1/label/{label}/values", params=params, timeout=10).json()["data"]


@contextlib.contextmanager
def serving(model: str):
    """Router + 1 prefill + 1 decode of the tiny model in this process, over HTTP."""
    from serving_helpers import ServerThread, make_settings

    from distserve_engine.server import assembly

    settings = make_settings(model, deployment=DEPLOYMENT, plan=PLAN_A, max_waiting_requests=512,
                             slo={"ttft_s": 30.0, "tpot_s": 5.0},
                             engine={"model": model, "num_blocks": 256, "max_model_len": 512})
    router, instances, runner = assembly.build_in_process(settings)
    app = assembly.build_frontend_app(settings, router, runner.tokenizer, runner.max_model_len)
    try:
        with ServerThread(app) as server:
            yield server, router
    finally:
        for instance in instances:
            instance.stop()


async def send_load(url: str, num_requests: int, rate_rps: float) -> list[int]:
    """Requests at a steady rate, prompts of 8 to 120 tokens, 2 to 17 output tokens."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> int:
            await asyncio.sleep(i / rate_rps)
            prompt = [7 + (i * SEED_PROMPT + j) % 200 for j in range(8 + (i * 37) % 113)]
            body = {"prompt": prompt, "max_tokens": 2 + i % 16, "ignore_eos": True}
            return (await client.post(f"{url}/v1/completions", json=body)).status_code

        return await asyncio.gather(*(one(i) for i in range(num_requests)))


def legend_labels(legend: str) -> set[str]:
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))


def result_labels(expression: Expression, result: list[dict]) -> set[str]:
    """Labels present on every series of the result."""
    return set.intersection(*(set(series["metric"]) for series in result))


@pytest.mark.slow
def test_every_dashboard_and_rule_query_returns_data(tiny_model, tmp_path):
    expressions = dashboard_expressions() + rule_expressions()
    with serving(tiny_model) as (server, router), \
            PrometheusProcess([server.url.removeprefix("http://")], tmp_path, rule_files=(RULES_FILE,),
                              labels={"namespace": NAMESPACE}, honor_labels=True) as prom:
        prom.wait_for_scrapes()
        start_s = time.time()
        statuses = asyncio.run(send_load(server.url, NUM_REQUESTS, RATE_RPS))
        time.sleep(70)  # `offset 1m` of the reshuffle annotation passes plan-a's start
        router.metrics.set_plan(**PLAN_B)  # what a reshuffle's settings reload does
        statuses += asyncio.run(send_load(server.url, NUM_REQUESTS // 4, RATE_RPS))
        time.sleep(4)  # the last scrapes and rule evaluations
        end_s = time.time()
        api = PrometheusAPI(prom.url)
        results = {e: api.query(e, start_s, end_s) for e in expressions}
        values = {name: api.label_values(*variable) for name, variable in variable_queries().items()}
    assert statuses.count(200) == len(statuses)

    with_data = [e for e, r in results.items() if r]
    operator = [e for e in expressions if e.is_operator]
    alerts = [e for e in expressions if e.is_alert]
    print(f"\n{len(expressions)} expressions executed: {len(with_data)} returned data; "
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
    check_values(results)
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


def check_values(results: dict[Expression, list[dict]]) -> None:
    """A few figures the deployment makes known: attainment, GPUs, the reshuffle."""
    by_where = {e.where: r for e, r in results.items()}
    recorded = by_where["recorded distserve:slo_attainment:ratio_rate5m"]
    assert recorded[0]["metric"] == {"__name__": "distserve:slo_attainment:ratio_rate5m",
                                     "namespace": NAMESPACE, "deployment": DEPLOYMENT, "model_name": MODEL}
    assert max(sample_values(recorded)) == pytest.approx(1.0, abs=0.02)
    gpus = sample_values(by_where["recorded distserve:plan_gpus:sum"])
    assert set(gpus) == {2.0, 3.0}  # plan-a, then plan-b with a second decode instance
    reshuffles = by_where["distserve-planner.json: annotation Reshuffles"]
    assert {s["metric"]["plan_id"] for s in reshuffles} == {"plan-a", "plan-b"}
    goodput = sample_values(by_where["recorded distserve:goodput_rps_per_gpu:rate5m"])
    assert 0 < max(goodput) <= RATE_RPS
