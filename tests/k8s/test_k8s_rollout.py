"""A plan switch against kmock: new pods and router ConfigMap updates, no router roll,
an old instance deleted only once it is idle (the others wait their turn); and a
deleted pod, router config or NetworkPolicy comes back."""

from __future__ import annotations

import asyncio
import json

import pytest
from kmock_cluster import (
    NAMESPACE,
    OPERATOR_ARGS,
    VersionedEmulator,
    make_resource,
    owned,
    play_kubelet,
    prepare,
)
from kopf.testing import KopfRunner
from test_k8s_operator import _applied, _only_revision, _phase, _served, opt13b_spec, stop

from distserve.k8s import draining, handlers, naming, reconciling

pytestmark = [pytest.mark.k8s, pytest.mark.kmock(cls=VersionedEmulator)]


def _router_writes(emulator) -> list:
    """Writes to the router Deployment other than its status (which kubelet's side sets)."""
    return [r for r in list(emulator) if r.method in ("PATCH", "PUT", "DELETE") and r.resource is not None
            and r.resource.plural == "deployments" and getattr(r, "subresource", None) != "status"]


async def _router_instances(api) -> list[dict]:
    found = await api.get("ConfigMap", NAMESPACE, "opt-router")
    return json.loads(found["data"]["router.json"])["instances"]


async def _revisions(api) -> set[str]:
    return {p["metadata"]["labels"][naming.REVISION_LABEL] for p in await owned(api, "Pod", "opt")}


async def test_slo_change_drains_one_old_instance_at_a_time_without_rolling_the_router(kmock, monkeypatch):
    is_busy = {"old": True}

    async def probe(url: str) -> dict:
        return {"num_running": int(is_busy["old"])}

    monkeypatch.setattr(draining, "probe_load", probe)
    monkeypatch.setattr(handlers, "TIMING", reconciling.Timing(
        monitor_interval_s=0.5, drain_seconds=300, drain_min_seconds=0))
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", opt13b_spec(0.15, 0.1)))
        first = await _wait(lambda: _applied(api, "opt"))
        await play_kubelet(api, "opt")
        await _wait(lambda: _phase(api, "opt", "Ready"))
        writes_before = len(_router_writes(kmock))

        await api.patch("DistServeDeployment", NAMESPACE, "opt",
                        {"spec": {"slo": {"ttftSeconds": 0.25, "tpotSeconds": 0.05}}})
        second = await _wait(lambda: _applied(api, "opt", not_plan=first["planId"]))
        await play_kubelet(api, "opt")

        async def one_old_draining():
            await play_kubelet(api, "opt")
            return [e for e in await _router_instances(api) if e["draining"]]
        draining_now = await _wait(one_old_draining, what=lambda: _debug(first, second))
        await asyncio.sleep(2)  # several monitor rounds: the drained instance is still busy
        assert [e["revision"] for e in draining_now] == [first["revision"]]
        assert len(await _revisions(api)) == 2 and first["revision"] != second["revision"]
        settings = json.loads((await api.get("ConfigMap", NAMESPACE, "opt-router"))["data"]["serve.json"])
        peers = {p["name"] for role in ("prefill", "decode") for p in settings["peers"][role]}
        assert draining_now[0]["name"] not in peers  # no new request goes to it
        pods = await owned(api, "Pod", "opt", **{naming.DRAINING_LABEL: "true"})
        assert [p["metadata"]["labels"][naming.INSTANCE_LABEL] for p in pods] == \
            [str(draining_now[0]["instance"])]

        is_busy["old"] = False
        await _wait(lambda: _only_revision(api, "opt", second["revision"]), timeout_s=120)
        await _wait(lambda: _served(api, "opt"), timeout_s=60)
        assert {e["revision"] for e in await _router_instances(api)} == {second["revision"]}
        assert _router_writes(kmock)[writes_before:] == []  # the router pods were not rolled
    finally:
        await stop(runner)


async def test_deleted_worker_pod_is_recreated_with_an_event(kmock):
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", opt13b_spec(0.15, 0.1)))
        await _wait(lambda: _applied(api, "opt"))
        # Once the rollout is done (its create steps re-apply their own objects), what goes
        # missing is the monitor's to heal, with an Event.
        await play_kubelet(api, "opt")
        await _wait(lambda: _phase(api, "opt", "Ready"))
        pods = await owned(api, "Pod", "opt")
        gone = pods[0]["metadata"]["name"]
        await api.delete("Pod", NAMESPACE, gone)
        await api.delete("ConfigMap", NAMESPACE, "opt-router")
        await api.delete("NetworkPolicy", NAMESPACE, "opt-instances")

        async def back():
            names = {p["metadata"]["name"] for p in await owned(api, "Pod", "opt")}
            return gone in names and await api.get("ConfigMap", NAMESPACE, "opt-router") \
                and await api.get("NetworkPolicy", NAMESPACE, "opt-instances")
        await _wait(back)

        async def recreated_events():  # posted after the objects, so waited for too
            messages = " ".join(r.data["message"] for r in list(kmock) if r.method == "POST"
                                and r.resource is not None and r.resource.plural == "events"
                                and (r.data or {}).get("reason") == "Recreated")
            return messages if "NetworkPolicy opt-instances" in messages else None
        messages = await _wait(recreated_events)
        assert gone in messages
        assert len(await owned(api, "Pod", "opt")) == len(pods)
    finally:
        await stop(runner)


async def _wait(check, timeout_s: float = 30.0, what=None):
    for _ in range(int(timeout_s / 0.2)):
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.2)
    found = await what() if what else found
    raise AssertionError(f"timed out waiting for {check.__name__}: {found}")


async def _debug(*things):
    return things
