"""The generated files: equal to what the source builds (else: run the script), the
dashboards well formed (read back by the SDK's own types, one Prometheus datasource
variable, unique panel ids, every target a query), and the chart shipping them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as prometheus_models

from distserve.monitoring.dashboards import BUILDERS, render_all
from distserve.monitoring.rules import render_rules

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "distserve"
sys.path.insert(0, str(ROOT / "scripts"))
from gen_monitoring import outputs  # noqa: E402

VARIABLES = ["datasource", "namespace", "deployment", "model"]


def load(name: str) -> dict:
    return json.loads((ROOT / "dashboards" / name).read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def test_generated_files_match_their_source():
    drifted = [str(p.relative_to(ROOT)) for p, text in outputs().items()
               if not p.exists() or p.read_text() != text]
    assert drifted == [], f"{drifted} drifted from distserve.monitoring: run python scripts/gen_monitoring.py"
    assert sorted(p.name for p in (ROOT / "dashboards").glob("*.json")) == sorted(BUILDERS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_dashboard_reads_back_with_the_sdk_types(name):
    register_default_plugins()
    doc = load(name)
    dashboard = dm.Dashboard.from_json(doc)
    assert json.loads(json.dumps(dashboard.to_json(), default=lambda o: o.to_json())) == \
        json.loads(render_all()[name])
    targets = [t for p in dashboard.panels or [] if isinstance(p, dm.Panel) for t in p.targets or []]
    assert targets and all(isinstance(t, prometheus_models.Dataquery) for t in targets)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_dashboard_structure(name):
    doc = load(name)
    assert doc["uid"] == name.removesuffix(".json") and doc["title"].startswith("DistServe / ")
    variables = doc["templating"]["list"]
    assert [v["name"] for v in variables] == VARIABLES
    assert variables[0] == {**variables[0], "type": "datasource", "query": "prometheus"}
    for variable in variables[1:]:
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variable["query"].startswith("label_values(") and variable["includeAll"]
    panels = all_panels(doc)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and 0 not in ids
    queries = [p for p in panels if p["type"] != "row"]
    assert queries
    for panel in queries:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids) and all(ref_ids)
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${datasource}"
            assert "$namespace" in target["expr"] and "$deployment" in target["expr"]
        assert panel["gridPos"]["w"] > 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    for annotation in doc["annotations"]["list"]:
        assert annotation["datasource"]["uid"] == "${datasource}" and annotation["expr"]


def render_chart(values: dict | None = None) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="distserve", namespace="distserve-system", is_install=True)
    return [d for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def test_chart_ships_nothing_of_it_by_default():
    kinds = [d["kind"] for d in render_chart()]
    assert "PrometheusRule" not in kinds and "ConfigMap" not in kinds


def test_chart_ships_dashboards_to_the_sidecar_and_the_rules():
    values = {"metrics": {
        "grafanaDashboards": {"enabled": True, "namespace": "monitoring",
                              "annotations": {"grafana_folder": "DistServe"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}}
    docs = render_chart(values)
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert sorted(k for m in maps for k in m["data"]) == sorted(BUILDERS)
    for config_map in maps:
        kubernetes_validate.validate(config_map, "1.30.0", strict=True)
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["namespace"] == "monitoring"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "DistServe"}
        (name, text), = config_map["data"].items()
        assert json.loads(text) == load(name)
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(render_rules())


def test_pod_monitor_keeps_the_engine_instance_label():
    docs = render_chart({"metrics": {"podMonitor": {"enabled": True}}})
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    assert all(e["honorLabels"] for e in monitor["spec"]["podMetricsEndpoints"])
