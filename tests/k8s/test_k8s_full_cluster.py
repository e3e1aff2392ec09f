"""A reshuffle on a cluster the plan fills, against kmock: one node of 10 GPUs, 2 of them
held by another team's pod, so the 8 the plan takes are all there is. The prefill:decode
ratio moves from 2:2 to 1:3; the instances both plans share are never touched, the old
prefill instance is drained and deleted before its replacement is created, and no pod
is ever created that the free GPUs could not hold."""

from __future__ import annotations

import pytest
from k8s_factories import make_node
from kmock_cluster import (
    NAMESPACE,
    OPERATOR_ARGS,
    VersionedEmulator,
    make_resource,
    owned,
    play_kubelet,
    prepare,
    status_of,
    wait_for,
)
from kopf.testing import KopfRunner
from test_k8s_operator import _applied, _phase, stop

from distserve.k8s import naming

pytestmark = [pytest.mark.k8s, pytest.mark.kmock(cls=VersionedEmulator)]


def fixed_spec(prefill_instances: int, decode_instances: int) -> dict:
    """OPT-13B at tp2 in both phases, the placement fixed (no search)."""
    return {
        "model": {"name": "facebook/opt-13b"},
        "slo": {"ttftSeconds": 0.25, "tpotSeconds": 0.1},
        "planner": {"workers": 1, "numRequests": 100},
        "placement": {"prefill": {"tp": 2, "instances": prefill_instances},
                      "decode": {"tp": 2, "instances": decode_instances}},
    }


def other_team_pod() -> dict:
    """A pod of someone else, bound to the node, holding 2 GPUs."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "training", "namespace": "research"},
            "spec": {"nodeName": "gpu-node-a", "containers": [
                {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]},
            "status": {"phase": "Running"}}


def writes(emulator, since: int) -> list[str]:
    """`POST pods/<name>`, `DELETE services/<name>`... of the operator's own objects."""
    found = []
    for request in list(emulator)[since:]:
        resource = request.resource
        method = str(getattr(request.method, "value", request.method))
        if method not in ("POST", "DELETE") or resource is None \
                or resource.plural not in ("pods", "services", "configmaps"):
            continue
        name = request.name or (request.data or {}).get("metadata", {}).get("name")
        if name and name.startswith("opt-") and name != "opt-router":
            found.append(f"{method} {resource.plural}/{name}")
    return found


async def _settled(api) -> dict | None:
    """The status once Ready with no reshuffle left, playing the kubelet meanwhile."""
    await play_kubelet(api, "opt")
    status = await _phase(api, "opt", "Ready")
    return status if status and not status.get("reshuffle") else None


async def test_ratio_change_on_a_full_node_drains_before_it_creates(kmock):
    api = prepare(kmock, nodes=0)
    kmock.objects["v1/nodes", None, "gpu-node-a"] = make_node("gpu-node-a", gpus=10)
    kmock.objects["v1/namespaces", None, "research"] = {"metadata": {"name": "research"}}
    kmock.objects["v1/pods", "research", "training"] = other_team_pod()
    spec = fixed_spec(2, 2)
    spec["cluster"] = {"nodeNames": ["gpu-node-a"], "nodes": 1, "gpusPerNode": 8}
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", spec))
        first = await wait_for(lambda: _applied(api, "opt"), what="first plan applied")
        old = first["revision"]
        await wait_for(lambda: _settled(api), timeout_s=120, what="first plan Ready")
        kept_pods = {f"opt-{old}-p0-s0", f"opt-{old}-d0-s0", f"opt-{old}-d1-s0"}
        assert {p["metadata"]["name"] for p in await owned(api, "Pod", "opt")} == \
            kept_pods | {f"opt-{old}-p1-s0"}
        seen = len(list(kmock))

        await api.patch("DistServeDeployment", NAMESPACE, "opt",
                        {"spec": {"placement": fixed_spec(1, 3)["placement"]}})
        second = await wait_for(lambda: _applied(api, "opt", not_plan=first["planId"]),
                                what="second plan applied")
        new = second["revision"]
        status = await wait_for(lambda: _settled(api), timeout_s=120, what="reshuffled")

        # 3 of the 4 instances are the same in both plans (same role, tp, node and GPUs):
        # kept with their names; the old p1 (GPUs 2,3) makes room for the new d0.
        assert writes(kmock, seen) == [
            f"POST configmaps/opt-{new}-engine",
            f"DELETE pods/opt-{old}-p1-s0",
            f"DELETE services/opt-{old}-p1",
            f"POST services/opt-{new}-d0",
            f"POST pods/opt-{new}-d0-s0",
        ]
        pods = {p["metadata"]["name"]: p for p in await owned(api, "Pod", "opt")}
        assert set(pods) == kept_pods | {f"opt-{new}-d0-s0"}
        assert pods[f"opt-{new}-d0-s0"]["metadata"]["annotations"][naming.GPU_IDS_ANNOTATION] == "2,3"
        assert sorted((i["revision"], i["role"], i["index"]) for i in status["instances"]) == sorted(
            [(old, "prefill", 0), (old, "decode", 0), (old, "decode", 1), (new, "decode", 0)])
        events = [r.data for r in list(kmock)[seen:] if r.method == "POST" and r.resource is not None
                  and r.resource.plural == "events"]
        reasons = [e["reason"] for e in events if e["reason"] in ("Draining", "Drained", "Deleted")]
        assert reasons == ["Draining", "Drained", "Deleted"]
        assert f"prefill-1-{old}" in next(e for e in events if e["reason"] == "Draining")["message"]
    finally:
        await stop(runner)


async def test_a_plan_the_free_gpus_cannot_hold_is_refused_until_they_are_free(kmock):
    api = prepare(kmock, nodes=0)
    kmock.objects["v1/nodes", None, "gpu-node-a"] = make_node("gpu-node-a", gpus=10)
    kmock.objects["v1/namespaces", None, "research"] = {"metadata": {"name": "research"}}
    kmock.objects["v1/pods", "research", "training"] = other_team_pod()
    spec = fixed_spec(1, 1)
    spec["cluster"] = {"nodeNames": ["gpu-node-a"], "nodes": 1, "gpusPerNode": 10}
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", spec))
        first = await wait_for(lambda: _applied(api, "opt"), what="first plan applied")
        await api.patch("DistServeDeployment", NAMESPACE, "opt",
                        {"spec": {"placement": fixed_spec(2, 3)["placement"]}})  # 10 GPUs, 8 free
        await wait_for(lambda: _phase(api, "opt", "Degraded"), what="refused")
        seen = len(list(kmock))
        await wait_for(lambda: _monitored_since(kmock, seen, rounds=3), what="3 monitor rounds")
        status = await status_of(api, "opt")  # the monitor rounds keep the refusal
        assert status["phase"] == "Degraded"
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "NoRoom")
        assert "needs 2 GPUs on gpu-node-a (0 free)" in status["message"]
        assert f"plan {first['planId']} keeps serving" in status["message"]
        assert status["appliedPlanId"] == first["planId"]
        assert status["planId"] != first["planId"]
        assert len(await owned(api, "Pod", "opt")) == 2

        del kmock.objects["v1/pods", "research", "training"]  # the other team's job ends
        second = await wait_for(lambda: _applied(api, "opt", not_plan=first["planId"]),
                                what="the refused plan applied")
        assert second["planId"] == status["planId"]
        degraded = next(c for c in second["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "False"
        await wait_for(lambda: _settled(api), timeout_s=120, what="reshuffled")
        assert len(await owned(api, "Pod", "opt")) == 5
    finally:
        await stop(runner)


async def _monitored_since(emulator, since: int, rounds: int) -> bool:
    """Whether the Nodes were listed `rounds` times since a request (each monitor round
    lists them once)."""
    reads = [r for r in list(emulator)[since:] if r.resource is not None
             and r.resource.plural == "nodes" and str(getattr(r.method, "value", r.method)) == "GET"]
    return len(reads) >= rounds
