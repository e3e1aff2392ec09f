"""The instances' NetworkPolicy: valid for the API server, and it admits exactly the
deployment's own pods (any port) and the named peers (the http port only)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from k8s_factories import make_owner, make_revision

from distserve.k8s import naming
from distserve.k8s.network import Peer, build_instance_network_policy
from distserve.k8s.router import _router_labels

KUBE_VERSION = "1.30.0"
HTTP_PORT = 8000
RENDEZVOUS_PORT = 29500
OPERATOR = Peer({"app.kubernetes.io/name": "distserve", "app.kubernetes.io/component": "operator"},
                namespace="distserve-system")
PROMETHEUS = Peer({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector against labels (matchLabels, and matchExpressions with In)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def admits(policy: dict, pod: dict[str, str], namespace: str, port: int) -> bool:
    """Whether ingress from a pod (labels, namespace) on a port is allowed, by the
    NetworkPolicy rules: a peer without namespaceSelector means the policy's namespace."""
    policy_ns = policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        for peer in rule["from"]:
            ns_selector = peer.get("namespaceSelector")
            ns_ok = (namespace == policy_ns if ns_selector is None else
                     selects(ns_selector, {"kubernetes.io/metadata.name": namespace}))
            if ns_ok and selects(peer["podSelector"], pod):
                return True
    return False


@pytest.fixture
def policy():
    return build_instance_network_policy(make_owner("opt"), HTTP_PORT, [OPERATOR, PROMETHEUS])


def test_policy_is_valid_for_the_api_server(policy):
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    no_peers = build_instance_network_policy(make_owner("opt"), "http", [])
    kubernetes_validate.validate(no_peers, KUBE_VERSION, strict=True)


def test_policy_selects_the_instances_and_not_the_router(policy):
    revision = make_revision()
    selector = policy["spec"]["podSelector"]
    for role in ("prefill", "decode"):
        assert selects(selector, naming.worker_labels(revision, role, 0, 0))
    assert not selects(selector, _router_labels(revision.owner))
    other = naming.worker_labels(make_revision(), "decode", 0, 0) | {naming.DEPLOYMENT_LABEL: "x"}
    assert not selects(selector, other)


def test_own_pods_on_any_port_peers_on_http_only_nobody_else(policy):
    revision = make_revision()
    ns = revision.owner.namespace
    router = _router_labels(revision.owner)
    prefill = naming.worker_labels(revision, "prefill", 0, 1)
    for port in (HTTP_PORT, RENDEZVOUS_PORT):
        assert admits(policy, router, ns, port) and admits(policy, prefill, ns, port)
    assert admits(policy, OPERATOR.pod_labels, "distserve-system", HTTP_PORT)
    assert not admits(policy, OPERATOR.pod_labels, "distserve-system", RENDEZVOUS_PORT)
    assert admits(policy, PROMETHEUS.pod_labels, "monitoring", HTTP_PORT)
    assert not admits(policy, PROMETHEUS.pod_labels, "elsewhere", HTTP_PORT)
    other_deployment = naming.owner_labels(make_owner("other"))
    assert not admits(policy, other_deployment, ns, HTTP_PORT)
    assert not admits(policy, router, "another-namespace", HTTP_PORT)  # same labels elsewhere


def test_bad_port_is_named():
    with pytest.raises(ValueError, match="http_port"):
        build_instance_network_policy(make_owner(), 70000, [])
