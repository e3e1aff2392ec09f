"""Prometheus finds every engine and router pod: the scrape annotations point at the
container port that serves /metrics, and the chart's PodMonitor (off by default)
selects those pods, and only those, by label and port name."""

from __future__ import annotations

import helm_python as helm
import pytest
from k8s_factories import make_plan, make_revision
from test_k8s_chart import CHART, render

from distserve.k8s import naming, router, scraping, workers


def engine_and_router_pods() -> list[dict]:
    """(metadata, spec) of every worker pod and of the router's pod template."""
    revision = make_revision(make_plan("low-affinity", prefill=(2, 2, 1), decode=(1, 2, 1)))
    owner, spec = revision.owner, revision.spec
    config = router.build_router_config(owner, spec, workers.instance_endpoints(revision))
    pods = [o for o in workers.build_revision_objects(revision, {"gpu-node-a", "gpu-node-b"})
            if o["kind"] == "Pod"]
    template = router.build_router_deployment_spec(owner, spec, config)["spec"]["template"]
    return [*pods, template]


def test_every_engine_and_router_pod_asks_to_be_scraped_on_its_http_port():
    pods = engine_and_router_pods()
    roles = {p["metadata"]["labels"][naming.ROLE_LABEL] for p in pods}
    assert roles == {"prefill", "decode", "router"}
    for pod in pods:
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"]
                 for p in c.get("ports", [])}
        assert annotations["prometheus.io/port"] == str(ports["http"])


def test_pod_monitor_is_off_by_default():
    assert [d for d in render() if d["kind"] == "PodMonitor"] == []


@pytest.mark.parametrize(("values", "namespace_selector", "namespace"), [
    ({}, {"any": True}, "distserve-system"),
    ({"watchNamespaces": ["serving"], "metrics": {"podMonitor": {"namespace": "monitoring"}}},
     {"matchNames": ["serving"]}, "monitoring"),
])
def test_pod_monitor_selects_the_engine_and_router_pods(values, namespace_selector, namespace):
    values = {**values, "metrics": {"podMonitor": {
        "enabled": True, "labels": {"release": "kube-prometheus-stack"},
        **values.get("metrics", {}).get("podMonitor", {})}}}
    monitors = {d["metadata"]["name"]: d for d in render(values) if d["kind"] == "PodMonitor"}
    monitor = monitors["distserve-operator-engines"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == namespace
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == namespace_selector
    [endpoint] = spec["podMetricsEndpoints"]
    assert endpoint["path"] == scraping.METRICS_PATH
    selector = spec["selector"]["matchLabels"]
    for pod in engine_and_router_pods():
        labels = pod["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items())
        port_names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert endpoint["port"] in port_names
    operator_pod = next(d for d in render(values) if d["kind"] == "Deployment")
    operator_labels = operator_pod["spec"]["template"]["metadata"]["labels"]
    assert not all(operator_labels.get(k) == v for k, v in selector.items())
    # The operator's own series, by a second PodMonitor on its `metrics` port.
    own = monitors["distserve-operator"]["spec"]
    assert all(operator_labels.get(k) == v for k, v in own["selector"]["matchLabels"].items())
    [own_endpoint] = own["podMetricsEndpoints"]
    operator_ports = {p["name"] for c in operator_pod["spec"]["template"]["spec"]["containers"]
                      for p in c.get("ports", [])}
    assert own_endpoint["port"] in operator_ports and own_endpoint["honorLabels"] is True
    assert own["namespaceSelector"] == {"matchNames": ["distserve-system"]}


def test_pod_monitor_values_are_checked():
    with helm.Chart.load(CHART) as chart:
        for bad in ({"metrics": {"podMonitor": {"enabled": "yes"}}},
                    {"metrics": {"podMonitor": {"interval": "often"}}},
                    {"rbac": {"readNodes": "no"}},
                    {"rbac": {"everything": True}}):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)
