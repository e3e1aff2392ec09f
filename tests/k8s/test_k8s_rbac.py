"""Least privilege, measured: every API call the operator (kopf and its own client) makes
through a whole lifecycle against kmock, as (API group, resource, verb), must be granted
by the chart's RBAC, and the RBAC must grant nothing beyond them but a short list of
verbs the emulator cannot show (each with its reason). Both chart modes: a ClusterRole
for all namespaces, and a Role per watched namespace."""

from __future__ import annotations

import pytest
from kmock_cluster import (
    NAMESPACE,
    VersionedEmulator,
    make_resource,
    owned,
    play_kubelet,
    prepare,
)
from kopf.testing import KopfRunner
from test_k8s_chart import render
from test_k8s_operator import _all_gone, _applied, _only_revision, _phase, opt13b_spec, stop
from test_k8s_rollout import _wait

from distserve.cli.operator import operator_settings
from distserve.k8s.client import USER_AGENT, ApiClient

pytestmark = [pytest.mark.k8s]

Grant = tuple[str, str, str]  # (API group, resource[/subresource], verb)
TESTER = "distserve-rbac-test"
# Granted but never seen against the emulator, and why they are needed.
UNEXERCISED: dict[Grant, str] = {
    # The API server checks it when an owned object's ownerReference sets
    # blockOwnerDeletion (OwnerReferencesPermissionEnforcement); no request is sent.
    ("distserve.io", "distservedeployments/finalizers", "update"): "owner references",
}
# kopf's runtime observation of CRDs (all-namespaces mode only).
CRD_WATCH = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}


def rbac_verb(request) -> str:
    """The RBAC verb of one HTTP request (as the API server's authorizer derives it)."""
    method = str(request.method.value if hasattr(request.method, "value") else request.method)
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    if method == "DELETE" and not request.name:
        return "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]


def operator_calls(emulator) -> list[tuple[Grant, str | None]]:
    """((group, resource, verb), namespace) of every resource request kopf or the operator made."""
    calls = []
    for request in list(emulator):
        agent = request.headers.get("User-Agent", "")
        if not (agent.startswith("kopf/") or agent == USER_AGENT):
            continue
        if request.resource is None or not request.resource.plural:
            continue  # discovery (/api, /apis/...): open to every authenticated client
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        calls.append(((request.resource.group or "", resource, rbac_verb(request)), request.namespace))
    return calls


def grants(rules: list[dict]) -> set[Grant]:
    """Every (group, resource, verb) a list of RBAC rules allows (no wildcards allowed)."""
    granted = set()
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert not rule.get("resourceNames"), rule
        granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"]
                    for v in rule["verbs"]}
    return granted


async def drive_lifecycle(api: ApiClient, emulator) -> None:
    """Create, serve, heal, re-plan and roll out, change the engine and who may reach the
    router, delete."""
    await api.create(make_resource("opt", opt13b_spec(0.15, 0.1)))
    first = await _wait(lambda: _applied(api, "opt"))
    await play_kubelet(api, "opt")
    await _wait(lambda: _phase(api, "opt", "Ready"))
    gone = (await owned(api, "Pod", "opt"))[0]["metadata"]["name"]
    await api.delete("Pod", NAMESPACE, gone)
    await _wait(lambda: _has_pod(api, gone))
    await api.patch("DistServeDeployment", NAMESPACE, "opt",
                    {"spec": {"slo": {"ttftSeconds": 0.25, "tpotSeconds": 0.05}}})
    second = await _wait(lambda: _applied(api, "opt", not_plan=first["planId"]))
    await play_kubelet(api, "opt")
    await _wait(lambda: _only_revision(api, "opt", second["revision"]))
    await api.patch("DistServeDeployment", NAMESPACE, "opt", {"spec": {
        "engine": {"serviceType": "NodePort"},
        "networkPolicy": {"apiFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}}})
    await _wait(lambda: _service_type(api, "NodePort"))
    await _wait(lambda: _router_policy_admits(api, "10.0.0.0/8"))
    await api.delete("DistServeDeployment", NAMESPACE, "opt")
    await _wait(lambda: _all_gone(api, "opt"))


@pytest.mark.kmock(cls=VersionedEmulator)
async def test_cluster_role_grants_exactly_what_the_operator_uses(kmock):
    prepare(kmock)
    api = ApiClient(user_agent=TESTER)
    runner = KopfRunner(["run", "-m", "distserve.k8s.handlers", "--all-namespaces", "--standalone"],
                        timeout=30, settings=operator_settings([])).__enter__()
    try:
        await drive_lifecycle(api, kmock)
    finally:
        await stop(runner)
        await api.close()
    used = {grant for grant, _ in operator_calls(kmock)}
    docs = render()
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    granted = grants(next(d for d in docs if d["kind"] == "ClusterRole")["rules"])
    assert used - granted == set(), "used but not granted"
    assert granted - used == set(UNEXERCISED), "granted but never used"
    assert CRD_WATCH <= used


@pytest.mark.kmock(cls=VersionedEmulator)
async def test_namespaced_roles_grant_exactly_what_the_operator_uses(kmock):
    prepare(kmock)
    api = ApiClient(user_agent=TESTER)
    runner = KopfRunner(["run", "-m", "distserve.k8s.handlers", "--namespace", NAMESPACE,
                         "--standalone"], timeout=30,
                        settings=operator_settings([NAMESPACE])).__enter__()
    try:
        await drive_lifecycle(api, kmock)
    finally:
        await stop(runner)
        await api.close()
    calls = operator_calls(kmock)
    docs = render({"watchNamespaces": [NAMESPACE, "research"]})
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    assert sorted(roles) == ["research", NAMESPACE]
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["research", NAMESPACE]
    assert all(b["roleRef"]["name"] == roles[NAMESPACE]["metadata"]["name"] for b in bindings)
    cluster_granted = grants(next(d for d in docs if d["kind"] == "ClusterRole")["rules"])
    role_granted = grants(roles[NAMESPACE]["rules"])
    cluster_used = {grant for grant, namespace in calls if namespace is None}
    role_used = {grant for grant, namespace in calls if namespace is not None}
    assert {namespace for _, namespace in calls} <= {None, NAMESPACE}
    # no CRD or Namespace watch in this mode; pods are listed cluster-wide for the GPUs
    # other pods hold (a reshuffle plans against the free ones)
    assert cluster_used == {("", "nodes", "list"), ("", "pods", "list")}
    assert cluster_granted == cluster_used
    assert role_used - role_granted == set(), "used but not granted"
    assert role_granted - role_used == set(UNEXERCISED), "granted but never used"


def test_nodes_are_not_read_when_the_chart_is_told_so():
    docs = render({"watchNamespaces": [NAMESPACE], "rbac": {"readNodes": False}})
    assert [d["kind"] for d in docs if d["kind"].startswith("Cluster")] == []
    docs = render({"rbac": {"readNodes": False}})
    granted = grants(next(d for d in docs if d["kind"] == "ClusterRole")["rules"])
    assert not {g for g in granted if g[1] == "nodes"}


def test_pod_groups_are_granted_only_when_gang_scheduling_is_on():
    def pod_group_grants(values: dict) -> set[Grant]:
        roles = [d for d in render(values) if d["kind"] in ("Role", "ClusterRole")]
        return {g for role in roles for g in grants(role["rules"]) if g[1] == "podgroups"}

    assert pod_group_grants({}) == set()
    on = {("scheduling.x-k8s.io", "podgroups", v) for v in ("get", "list", "create", "patch", "delete")}
    assert pod_group_grants({"rbac": {"gangScheduling": True}}) == on
    assert pod_group_grants({"rbac": {"gangScheduling": True}, "watchNamespaces": ["a"]}) == on


def test_network_policies_are_granted_only_when_the_chart_manages_them():
    def policy_grants(values: dict) -> set[Grant]:
        roles = [d for d in render(values) if d["kind"] in ("Role", "ClusterRole")]
        return {g for role in roles for g in grants(role["rules"]) if g[1] == "networkpolicies"}

    on = {("networking.k8s.io", "networkpolicies", v) for v in ("get", "list", "create", "patch", "delete")}
    assert policy_grants({}) == on
    assert policy_grants({"watchNamespaces": ["a"]}) == on
    assert policy_grants({"networkPolicy": {"enabled": False}}) == set()


async def _has_pod(api, name):
    return name in {p["metadata"]["name"] for p in await owned(api, "Pod", "opt")}


async def _service_type(api, kind):
    found = await api.get("Service", NAMESPACE, "opt")
    return found and found["spec"].get("type") == kind


async def _router_policy_admits(api, cidr):
    """Whether the router's NetworkPolicy lets `cidr` in."""
    found = await api.get("NetworkPolicy", NAMESPACE, "opt-router")
    peers = found["spec"]["ingress"][0].get("from", []) if found else []
    return any(p.get("ipBlock", {}).get("cidr") == cidr for p in peers)
