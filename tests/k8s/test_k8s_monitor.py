"""The monitor against kmock: a cluster whose GPU nodes go away, observedGeneration,
the drain deadline over an operator restart, and old revisions left without pods."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from k8s_factories import make_node
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
)
from kopf.testing import KopfRunner
from test_k8s_operator import _applied, _only_revision, _phase, opt13b_spec, stop
from test_k8s_rollout import _wait

from distserve.k8s import draining, handlers, naming, nodes, reconciling
from distserve.k8s import status as st

pytestmark = [pytest.mark.k8s]


def _events(emulator, reason: str) -> list[dict]:
    return [r.data for r in list(emulator) if r.method == "POST" and r.resource is not None
            and r.resource.plural == "events" and (r.data or {}).get("reason") == reason]


def _status_patches(emulator) -> list[dict]:
    """Every status the operator patched, in order."""
    return [r.data["status"] for r in list(emulator)
            if r.method == "PATCH" and r.resource is not None
            and r.resource.plural == "distservedeployments" and "status" in (r.data or {})]


def _set_node_ready(emulator, name: str, is_ready: bool) -> None:
    emulator.objects["v1/nodes", None, name] = make_node(name, ready=is_ready)


def test_node_problems_name_the_plan_nodes_and_an_empty_cluster():
    cordoned = make_node("c")
    cordoned["spec"] = {"unschedulable": True}
    found = [make_node("a"), make_node("b", ready=False), cordoned, make_node("cpu", 0)]
    assert nodes.node_problems({"a", "b", "c", "cpu", "node-7"}, found, is_cpu=False) == [
        "node b not Ready", "node c cordoned", "node cpu offers no nvidia.com/gpu"]
    assert nodes.node_problems({"node-0"}, [make_node("b", ready=False)], is_cpu=False) == [
        "no Ready node offering nvidia.com/gpu in the cluster"]
    assert nodes.node_problems({"cpu"}, [make_node("cpu", 0)], is_cpu=True) == []


@pytest.mark.kmock(cls=VersionedEmulator)
async def test_no_ready_gpu_node_is_degraded_with_one_event_and_recovers(kmock):
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", opt13b_spec(0.15, 0.1)))
        await _wait(lambda: _applied(api, "opt"))
        await play_kubelet(api, "opt")
        await _wait(lambda: _phase(api, "opt", "Ready"))

        _set_node_ready(kmock, "gpu-node-a", False)
        status = await _wait(lambda: _phase(api, "opt", "Degraded"))
        assert condition(status, "Degraded")["reason"] == "NodesNotReady"
        assert "no Ready node offering nvidia.com/gpu" in status["message"]
        assert "node gpu-node-a not Ready" in status["message"]
        assert condition(status, "Ready")["status"] == "False"
        await asyncio.sleep(2)  # several monitor rounds: still Degraded, one Event only
        assert (await status_of(api, "opt"))["phase"] == "Degraded"
        events = _events(kmock, "NodesNotReady")
        assert len(events) == 1 and "gpu-node-a" in events[0]["message"]

        _set_node_ready(kmock, "gpu-node-a", True)
        status = await _wait(lambda: _phase(api, "opt", "Ready"))
        assert condition(status, "Degraded")["status"] == "False"
        await _wait(lambda: _async(_events(kmock, "NodesReady")))
    finally:
        await stop(runner)


@pytest.mark.kmock(cls=VersionedEmulator)
async def test_observed_generation_moves_with_the_plan_of_that_generation(kmock):
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", opt13b_spec(0.15, 0.1)))
        first = await _wait(lambda: _applied(api, "opt"))
        assert first["observedGeneration"] == 1
        await api.patch("DistServeDeployment", NAMESPACE, "opt", {
            "metadata": {"generation": 2},  # what the API server does on a spec change
            "spec": {"slo": {"ttftSeconds": 0.25, "tpotSeconds": 0.05}}})
        second = await _wait(lambda: _applied(api, "opt", not_plan=first["planId"]))
        assert second["observedGeneration"] == 2
        patches = _status_patches(kmock)
        planning = [p for p in patches if p.get("phase") == "Planning"]
        assert len(planning) == 2 and all("observedGeneration" not in p for p in planning)
        with_generation = [p for p in patches if "observedGeneration" in p]
        assert [(p["observedGeneration"], p["planId"]) for p in with_generation] == [
            (1, first["planId"]), (2, second["planId"])]
    finally:
        await stop(runner)


@pytest.mark.kmock(cls=VersionedEmulator)
async def test_drain_deadline_survives_an_operator_restart(kmock, monkeypatch):
    async def busy(url: str) -> dict:
        return {"num_running": 1}  # the old instances never go idle: only the deadline ends them

    monkeypatch.setattr(draining, "probe_load", busy)
    monkeypatch.setattr(handlers, "TIMING", reconciling.Timing(
        monitor_interval_s=0.5, drain_seconds=15, drain_min_seconds=0))
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", opt13b_spec(0.15, 0.1)))
        first = await _wait(lambda: _applied(api, "opt"))
        await play_kubelet(api, "opt")
        await api.patch("DistServeDeployment", NAMESPACE, "opt",
                        {"spec": {"slo": {"ttftSeconds": 0.25, "tpotSeconds": 0.05}}})
        second = await _wait(lambda: _applied(api, "opt", not_plan=first["planId"]))
        await play_kubelet(api, "opt")
        draining_status = await _wait(lambda: _draining(api))
    finally:
        await stop(runner)
    since, deadline = draining_status["drainingSince"], draining_status["drainDeadline"]
    assert (st.parse_iso(deadline) - st.parse_iso(since)).total_seconds() == 15
    await asyncio.sleep(1.5)  # a restarted timer would start at a later second
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await asyncio.sleep(2)
        status = (await status_of(api, "opt"))["reshuffle"]
        assert (status["drainingSince"], status["drainDeadline"]) == (since, deadline)
        assert len({p["metadata"]["labels"][naming.REVISION_LABEL]
                    for p in await owned(api, "Pod", "opt")}) == 2
        drained = await _wait(lambda: _async(_events(kmock, "Drained")), timeout_s=40)
        assert datetime.datetime.now(datetime.timezone.utc) >= st.parse_iso(deadline)
        assert f"drain deadline {deadline}" in drained[0]["message"]
        await _wait(lambda: _only_revision(api, "opt", second["revision"]), timeout_s=120)
        status = await _wait(lambda: _no_drain(api), timeout_s=60)
        assert "reshuffle" not in status
    finally:
        await stop(runner)


@pytest.mark.kmock(cls=VersionedEmulator)
async def test_objects_of_a_revision_no_live_instance_comes_from_are_removed(kmock):
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", opt13b_spec(0.15, 0.1)))
        first = await _wait(lambda: _applied(api, "opt"))
        # what a replaced reshuffle leaves: a Service of a revision nothing runs any more
        gone = {naming.DEPLOYMENT_LABEL: "opt", naming.REVISION_LABEL: "deadbeef"}
        await api.create({"apiVersion": "v1", "kind": "Service", "metadata": {
            "name": "opt-deadbeef-p0", "namespace": NAMESPACE, "labels": gone}, "spec": {}})

        async def old_gone():
            return not await owned(api, "Service", "opt", **{naming.REVISION_LABEL: "deadbeef"})
        await _wait(old_gone)
        removed = await _wait(lambda: _async(_events(kmock, "Removed")))
        assert "deadbeef" in removed[0]["message"]
        assert await owned(api, "Service", "opt", **{naming.REVISION_LABEL: first["revision"]})
    finally:
        await stop(runner)


async def _async(value):
    return value


async def _draining(api):
    shuffle = (await status_of(api, "opt")).get("reshuffle") or {}
    return shuffle if shuffle.get("drainingSince") else None


async def _no_drain(api):
    await play_kubelet(api, "opt")
    status = await status_of(api, "opt")
    return status if not status.get("reshuffle") else None
