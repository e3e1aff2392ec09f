"""The deployment's NetworkPolicies: valid for the API server; the instances' admits exactly
the deployment's own pods (any port) and the named peers (the http port only), the
router's its API port from the allowed sources only; the operator's settings as its chart
sets them; and the policies applied, turned off and re-applied against the API emulator."""

from __future__ import annotations

import ipaddress

import kubernetes_validate
import pytest
from k8s_factories import make_owner, make_plan, make_revision, make_spec
from kmock_cluster import NAMESPACE, VersionedEmulator, make_resource, prepare
from test_k8s_chart import render

from distserve.k8s import applying, naming, network, planning, reconciling, workers
from distserve.k8s.network import (
    NetworkSettings,
    Peer,
    build_instance_network_policy,
    build_network_policies,
    build_router_network_policy,
)
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


def admits(policy: dict, pod: dict[str, str], namespace: str, port: int, ip: str = "") -> bool:
    """Whether ingress from a pod (labels, namespace, address) on a port is allowed, by
    the NetworkPolicy rules: a rule without `from` admits every source, a peer without
    namespaceSelector means the policy's namespace, an ipBlock matches by address."""
    policy_ns = policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            if "ipBlock" in peer:
                block = peer["ipBlock"]
                if ip and ipaddress.ip_address(ip) in ipaddress.ip_network(block["cidr"]) and not any(
                        ipaddress.ip_address(ip) in ipaddress.ip_network(c) for c in block.get("except", [])):
                    return True
                continue
            ns_selector = peer.get("namespaceSelector")
            ns_ok = (namespace == policy_ns if ns_selector is None else
                     selects(ns_selector, {"kubernetes.io/metadata.name": namespace}))
            if ns_ok and selects(peer.get("podSelector", {}), pod):
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


GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
OFFICE = {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.9.0/24"]}}
PROMETHEUS_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_router_policy_opens_only_the_api_port_to_anyone_by_default():
    policy = build_router_network_policy(make_owner("opt"), HTTP_PORT, [], [PROMETHEUS_PEER])
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    revision = make_revision()
    selector = policy["spec"]["podSelector"]
    assert selects(selector, _router_labels(revision.owner))
    assert not selects(selector, naming.worker_labels(revision, "prefill", 0, 0))
    assert admits(policy, {}, "anywhere", HTTP_PORT, ip="203.0.113.7")
    assert not admits(policy, {}, "anywhere", RENDEZVOUS_PORT, ip="203.0.113.7")


def test_router_policy_with_api_from_admits_those_and_the_scrapers_only():
    policy = build_router_network_policy(make_owner("opt"), HTTP_PORT, [GATEWAY, OFFICE],
                                         [PROMETHEUS_PEER])
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    assert admits(policy, {"app": "envoy"}, "gateway", HTTP_PORT)
    assert admits(policy, {}, "", HTTP_PORT, ip="10.20.1.5")
    assert not admits(policy, {}, "", HTTP_PORT, ip="10.20.9.5")  # the excepted range
    assert admits(policy, {"app.kubernetes.io/name": "prometheus"}, "monitoring", HTTP_PORT)
    assert not admits(policy, {"app": "curl"}, "serving", HTTP_PORT)
    assert not admits(policy, {"app": "envoy"}, "gateway", RENDEZVOUS_PORT)


def test_the_spec_names_the_peers_and_the_settings_fill_in_the_rest():
    owner = make_owner("opt")
    found = NetworkSettings(operator=OPERATOR, api_from=(GATEWAY,))
    instances, router = build_network_policies(owner, make_spec(), found)
    for policy in (instances, router):
        kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    assert admits(instances, OPERATOR.pod_labels, "distserve-system", HTTP_PORT)
    assert admits(instances, {"app.kubernetes.io/name": "prometheus"}, "any", HTTP_PORT)
    assert admits(router, {}, "gateway", HTTP_PORT) and not admits(router, {}, "serving", HTTP_PORT)

    spec = make_spec(engine={"port": 9000}, networkPolicy={
        "apiFrom": [OFFICE], "metricsFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]})
    instances, router = build_network_policies(owner, spec, found)
    assert not admits(instances, {"app.kubernetes.io/name": "prometheus"}, "any", 9000)
    assert admits(instances, {}, "monitoring", 9000) and not admits(instances, {}, "monitoring", HTTP_PORT)
    assert admits(router, {}, "", 9000, ip="10.20.0.1") and not admits(router, {}, "gateway", 9000)
    assert admits(router, {}, "monitoring", 9000)


def test_no_policies_when_the_spec_or_the_operator_turns_them_off():
    owner = make_owner("opt")
    assert build_network_policies(owner, make_spec(networkPolicy={"enabled": False}),
                                  NetworkSettings()) == []
    assert build_network_policies(owner, make_spec(), NetworkSettings(is_managed=False)) == []


def test_the_charts_environment_gives_the_operator_its_identity_and_the_scrapers():
    deployment = next(d for d in render({"networkPolicy": {"apiFrom": [GATEWAY]}})
                      if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[network.OPERATOR_NAMESPACE_ENV] is None  # the downward API: the release namespace
    env[network.OPERATOR_NAMESPACE_ENV] = "distserve-system"
    found = NetworkSettings.from_env(env)
    assert found.is_managed
    assert found.operator == Peer(pod["metadata"]["labels"], "distserve-system")
    assert found.api_from == (GATEWAY,)
    assert found.metrics_from == network.DEFAULT_METRICS_FROM  # the chart's default is the code's
    off = next(d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in off["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert not NetworkSettings.from_env(env).is_managed


@pytest.mark.parametrize(("name", "value"), [
    (network.MANAGED_ENV, "maybe"),
    (network.OPERATOR_LABELS_ENV, "[1]"),
    (network.METRICS_FROM_ENV, "{not json"),
    (network.API_FROM_ENV, '[{"podSelecter": {}}]'),
])
def test_a_malformed_setting_is_named(name, value):
    with pytest.raises(ValueError, match=name):
        NetworkSettings.from_env({name: value})


@pytest.mark.k8s
@pytest.mark.kmock(cls=VersionedEmulator)
async def test_policies_are_applied_patched_and_removed_when_the_spec_turns_them_off(kmock):
    api = prepare(kmock)
    owner = naming.Owner("opt", NAMESPACE, "uid-opt")
    try:
        assert await applying.apply_network_policies(api, owner, make_spec()) == 2
        names = {"opt-instances", "opt-router"}
        labels = {naming.DEPLOYMENT_LABEL: "opt"}
        assert {p["metadata"]["name"] for p in await api.list("NetworkPolicy", NAMESPACE, labels)} == names
        await applying.apply_network_policies(api, owner, make_spec(networkPolicy={"apiFrom": [OFFICE]}))
        router = await api.get("NetworkPolicy", NAMESPACE, "opt-router")
        assert admits(router, {}, "", HTTP_PORT, ip="10.20.0.1")
        assert not admits(router, {}, "elsewhere", HTTP_PORT, ip="192.0.2.1")
        await applying.apply_network_policies(api, owner, make_spec())  # apiFrom removed again
        router = await api.get("NetworkPolicy", NAMESPACE, "opt-router")
        assert admits(router, {}, "elsewhere", HTTP_PORT, ip="192.0.2.1")
        await applying.apply_network_policies(api, owner, make_spec(networkPolicy={"enabled": False}))
        assert await api.list("NetworkPolicy", NAMESPACE, labels) == []
    finally:
        await api.close()


@pytest.mark.k8s
@pytest.mark.kmock(cls=VersionedEmulator)
async def test_a_spec_change_that_keeps_the_plan_reaches_the_policies_and_the_router(kmock):
    api = prepare(kmock)
    plan = make_plan()
    before = make_spec()
    after = make_spec(router={"apiKeySecret": {"name": "llm-api-keys", "key": "keys"}},
                      networkPolicy={"apiFrom": [OFFICE]})
    revision = naming.Revision(naming.Owner("opt", NAMESPACE, "uid-opt"), plan, before)
    assert naming.Revision(revision.owner, plan, after).id == revision.id  # no new revision
    try:
        body = await api.create(make_resource("opt", {"model": {"name": "facebook/opt-13b"},
                                                      "slo": {"ttftSeconds": 0.25, "tpotSeconds": 0.1}}))
        await api.patch("DistServeDeployment", NAMESPACE, "opt", {"status": {
            "revision": revision.id, "instances": []}}, subresource="status")
        endpoints = workers.instance_endpoints(revision)
        await applying.apply_router(api, revision.owner, before, endpoints, plan)
        await applying.apply_network_policies(api, revision.owner, before)

        await reconciling.apply_plan(api, body, revision.owner, planning.Planned(plan, after, frozenset()))
        deployment = await api.get("Deployment", NAMESPACE, "opt-router")
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "DISTSERVE_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": "llm-api-keys", "key": "keys"}}} in env
        assert [e["name"] for e in await applying.read_router_instances(api, revision.owner)] == \
            [e["name"] for e in endpoints]  # the same instances, still routed
        router_policy = await api.get("NetworkPolicy", NAMESPACE, "opt-router")
        assert not admits(router_policy, {}, "elsewhere", HTTP_PORT, ip="192.0.2.1")
        assert await api.list("Pod", NAMESPACE) == []  # nothing else was started
    finally:
        await api.close()
