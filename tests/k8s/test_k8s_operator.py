"""The operator run for real (kopf) against the kmock Kubernetes API emulator.

OPT-13B on one node of 8 A100 (read from the Node objects): a search takes a few
seconds, and two SLOs give two different plans.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from kmock_cluster import (
    NAMESPACE,
    OPERATOR_ARGS,
    VersionedEmulator,
    condition,
    make_resource,
    owned,
    play_kubelet,
    prepare,
    status_of,
    wait_for,
)
from kopf.testing import KopfRunner

from distserve.k8s import naming

pytestmark = [pytest.mark.k8s, pytest.mark.kmock(cls=VersionedEmulator)]


def opt13b_spec(ttft_s: float, tpot_s: float, **extra) -> dict:
    """OPT-13B with the given SLOs; the cluster shape is left to the Nodes."""
    return {
        "model": {"name": "facebook/opt-13b"},
        "slo": {"ttftSeconds": ttft_s, "tpotSeconds": tpot_s},
        "planner": {"workers": 1, "numRequests": 100},
        **extra,
    }


async def stop(runner: KopfRunner) -> None:
    """Leave the runner without blocking the loop kmock serves on."""
    await asyncio.to_thread(runner.__exit__, None, None, None)


async def test_apply_change_slo_and_delete(kmock):
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", opt13b_spec(0.15, 0.1)))
        status = await wait_for(lambda: _applied(api, "opt"), what="first plan applied")
        first_plan = status["planId"]
        assert status["prefill"]["tp"] >= 1 and status["decodeInstances"] >= 1
        assert status["predictedGoodputRps"] > 0 and status["colocatedGoodputRps"] >= 0
        assert set(status["latency"]) >= {"ttftP90Seconds", "tpotP90Seconds"}
        assert status["searchSeconds"] > 0
        assert list(status["nodeAssignment"]) == ["gpu-node-a"]
        assert condition(status, "Planned")["status"] == "True"
        pods = await owned(api, "Pod", "opt")
        assert len(pods) == len(status["plan"]["segments"])
        for pod in pods:
            spec = pod["spec"]
            terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["gpu-node-a"]
            gpus = spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
            assert gpus == status["plan"][pod["metadata"]["labels"][naming.ROLE_LABEL]]["tp"]
            assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-opt"
        assert [s["metadata"]["name"] for s in await owned(api, "Service", "opt", **{
            naming.ROLE_LABEL: "router"})] == ["opt"]
        router = await api.get("ConfigMap", NAMESPACE, "opt-router")  # its metrics name the plan
        assert json.loads(router["data"]["serve.json"])["plan"]["id"] == first_plan
        policies = {p["metadata"]["name"]: p for p in await owned(api, "NetworkPolicy", "opt")}
        assert sorted(policies) == ["opt-instances", "opt-router"]
        assert policies["opt-router"]["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
        creates = [r.resource.plural for r in list(kmock) if r.method == "POST" and r.resource is not None
                   and r.resource.plural in ("networkpolicies", "pods")]
        assert creates[:2] == ["networkpolicies", "networkpolicies"]  # no pod is ever unguarded

        await play_kubelet(api, "opt")
        status = await wait_for(lambda: _phase(api, "opt", "Ready"), what="Ready")
        assert condition(status, "Ready")["status"] == "True"

        await api.patch("DistServeDeployment", NAMESPACE, "opt",
                        {"spec": {"slo": {"ttftSeconds": 0.25, "tpotSeconds": 0.05}}})
        status = await wait_for(lambda: _applied(api, "opt", not_plan=first_plan),
                                what="second plan applied")
        revisions = {p["metadata"]["labels"][naming.REVISION_LABEL]
                     for p in await owned(api, "Pod", "opt")}
        assert len(revisions) == 2  # the new instances run next to the old ones
        await play_kubelet(api, "opt")
        await wait_for(lambda: _only_revision(api, "opt", status["revision"]), what="old drained")
        await wait_for(lambda: _served(api, "opt"), what="Ready after rollout")
        router = await api.get("ConfigMap", NAMESPACE, "opt-router")
        routed = json.loads(router["data"]["router.json"])["instances"]
        assert {e["revision"] for e in routed} == {status["revision"]}
        settings = json.loads(router["data"]["serve.json"])
        assert all(status["revision"] in peer["name"]
                   for peer in settings["peers"]["prefill"] + settings["peers"]["decode"])
        assert settings["plan"]["id"] == status["planId"]

        await api.delete("DistServeDeployment", NAMESPACE, "opt")
        await wait_for(lambda: _all_gone(api, "opt"), timeout_s=120, what="objects deleted")
    finally:
        await stop(runner)


async def test_restart_changes_nothing_that_is_right(kmock):
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", opt13b_spec(0.15, 0.1)))
        await wait_for(lambda: _applied(api, "opt"), what="plan applied")
        await play_kubelet(api, "opt")
        await wait_for(lambda: _phase(api, "opt", "Ready"), what="Ready")
    finally:
        await stop(runner)
    seen = len(list(kmock))
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await asyncio.sleep(4)
    finally:
        await stop(runner)
    writes = [r for r in list(kmock)[seen:] if r.method in ("POST", "PATCH", "DELETE", "PUT")
              and r.resource is not None and r.resource.plural in (
                  "pods", "services", "configmaps", "deployments", "networkpolicies")]
    assert writes == []
    assert (await status_of(api, "opt"))["phase"] == "Ready"


async def test_unmeetable_slo_is_degraded_with_an_event_and_no_pods(kmock):
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("tight", opt13b_spec(0.01, 0.001)))
        status = await wait_for(lambda: _phase(api, "tight", "Degraded"), what="Degraded")
        assert condition(status, "Degraded")["reason"] == "NoFeasiblePlan"
        assert "TTFT" in condition(status, "Degraded")["message"]
        events = await wait_for(lambda: _events_posted(kmock, "NoFeasiblePlan"), what="event")
        assert events[0]["involvedObject"]["name"] == "tight"
        assert "TTFT" in events[0]["message"]
        assert await owned(api, "Pod", "tight") == []
    finally:
        await stop(runner)


async def test_plan_waits_for_approval_when_auto_apply_is_off(kmock):
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("review", opt13b_spec(0.15, 0.1, autoApply=False)))
        status = await wait_for(lambda: _phase(api, "review", "AwaitingApproval"), what="plan")
        assert await owned(api, "Pod", "review") == []
        await api.patch("DistServeDeployment", NAMESPACE, "review", {"metadata": {
            "annotations": {naming.APPROVAL_ANNOTATION: status["planId"]}}})
        await wait_for(lambda: _applied(api, "review"), what="approved plan applied")
        assert len(await owned(api, "Pod", "review")) == len(status["plan"]["segments"])
    finally:
        await stop(runner)


async def _applied(api, name, not_plan=None):
    status = await status_of(api, name)
    plan_id = status.get("appliedPlanId")
    return status if plan_id and plan_id == status.get("planId") and plan_id != not_plan else None


async def _served(api, name):
    """The status once Ready, playing the kubelet meanwhile (new instances come up)."""
    await play_kubelet(api, name)
    return await _phase(api, name, "Ready")


async def _phase(api, name, phase):
    status = await status_of(api, name)
    return status if status.get("phase") == phase else None


async def _only_revision(api, name, revision):
    """Whether only `revision`'s pods are left; plays the kubelet first (the reshuffle
    waits for each new instance to be Ready before it drains the next old one)."""
    await play_kubelet(api, name)
    pods = await owned(api, "Pod", name)
    return pods and {p["metadata"]["labels"][naming.REVISION_LABEL] for p in pods} == {revision}


async def _all_gone(api, name):
    for kind in ("Pod", "Service", "ConfigMap", "Deployment", "NetworkPolicy"):
        if await owned(api, kind, name):
            return False
    return await api.get("DistServeDeployment", NAMESPACE, name) is None


async def _events_posted(emulator, reason):
    """Events as posted (kmock stores one only: it ignores generateName)."""
    return [r.data for r in list(emulator) if r.method == "POST" and r.resource is not None
            and r.resource.plural == "events" and (r.data or {}).get("reason") == reason]
