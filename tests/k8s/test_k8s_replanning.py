"""The replanning timer against kmock: Prometheus down is a condition and no decision,
never a crash; a replan is recorded (status, Event, counter) and reshuffled to."""

from __future__ import annotations

import pytest
from kmock_cluster import (
    NAMESPACE,
    OPERATOR_ARGS,
    VersionedEmulator,
    condition,
    make_resource,
    play_kubelet,
    prepare,
    status_of,
    wait_for,
)
from kopf.testing import KopfRunner
from prometheus_client import REGISTRY
from test_k8s_full_cluster import _settled, fixed_spec
from test_k8s_operator import _applied, stop

from distserve import spec as specs
from distserve.analyzer import decide as deciding
from distserve.analyzer.observation import Observation
from distserve.k8s import planning, replanning

pytestmark = [pytest.mark.k8s, pytest.mark.kmock(cls=VersionedEmulator)]


def replanning_spec(url: str) -> dict:
    """A fixed 1:1 placement with replanning every second."""
    spec = fixed_spec(1, 1)
    spec["cluster"] = {"nodeNames": ["gpu-node-a"], "nodes": 1, "gpusPerNode": 8}
    spec["replanning"] = {"enabled": True, "prometheusUrl": url, "intervalSeconds": 1}
    return spec


def make_observation() -> Observation:
    return Observation(end_s=1.9e9, window_s=900, num_requests=1200, arrival_rate_rps=1.33,
                       arrival_cv=1.0, prompt=None, output=None, attainment=0.7)


async def _observing(api, reason):
    status = await status_of(api, "opt")
    found = condition(status, replanning.OBSERVING)
    return status if found.get("reason") == reason else None


async def test_prometheus_down_is_a_condition_and_no_decision(kmock):
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", replanning_spec("http://127.0.0.1:9")))
        await wait_for(lambda: _applied(api, "opt"), what="plan applied")
        await wait_for(lambda: _settled(api), what="Ready")  # no decision mid-reshuffle
        phases = {p: REGISTRY.get_sample_value("distserve_deployment_phase", {
            "namespace": NAMESPACE, "deployment": "opt", "phase": p}) for p in ("Ready", "Planning")}
        assert phases == {"Ready": 1.0, "Planning": 0.0}  # what the Degraded alert reads
        status = await wait_for(lambda: _observing(api, "PrometheusUnavailable"), what="condition")
        assert condition(status, replanning.OBSERVING)["status"] == "False"
        assert "no decision" in condition(status, replanning.OBSERVING)["message"]
        assert "replanning" not in status
    finally:
        await stop(runner)
    assert REGISTRY.get_sample_value("distserve_replan_decisions_total", {
        "namespace": NAMESPACE, "deployment": "opt",
        "action": "no-decision", "reason": "prometheus-unavailable"}) >= 1


async def test_a_replan_is_recorded_and_reshuffled_to(kmock, monkeypatch):
    shaped = specs.parse_spec({**replanning_spec("http://prometheus:9090"),
                               "placement": fixed_spec(1, 3)["placement"]})
    new_plan = planning.search(shaped)
    calls = []

    async def observe(client, labels, window_s, end_s):
        calls.append(labels)
        return make_observation()

    def decide(observation, plan, settings, state, evaluator):
        numbers = deciding.DecisionNumbers(1200, 1.33, 0.7, current_gpus=plan.num_gpus,
                                           new_gpus=new_plan.num_gpus)
        is_first = not state.history
        action = "replan" if is_first else "keep"
        entry = deciding.HistoryEntry(observation.end_s, action, "ratio", "observed miss")
        state = deciding.DecisionState(history=(*state.history, entry))
        return deciding.Decision(action, "observed attainment 70.0% < 90.0%" if is_first
                                 else "no shift", numbers, state, "ratio" if is_first else None,
                                 new_plan if is_first else None)

    class AnsweringPrometheus:
        def __init__(self, url: str) -> None:
            self.url = url

        async def aquery(self, promql: str, time_s: float) -> list:
            return []

    monkeypatch.setattr(replanning, "PrometheusClient", AnsweringPrometheus)
    monkeypatch.setattr(replanning.observing, "observe", observe)
    monkeypatch.setattr(replanning.deciding, "decide", decide)
    before = REGISTRY.get_sample_value("distserve_replan_decisions_total",
                                       {"namespace": NAMESPACE, "deployment": "opt",
                                        "action": "replan", "reason": "ratio"}) or 0
    api = prepare(kmock)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        await api.create(make_resource("opt", replanning_spec("http://prometheus:9090")))
        first = await wait_for(lambda: _applied(api, "opt"), what="plan applied")
        await wait_for(lambda: _settled(api), what="Ready")

        async def replanned():
            await play_kubelet(api, "opt")
            status = await status_of(api, "opt")
            return status if status.get("appliedPlanId") == new_plan.plan_id else None
        status = await wait_for(replanned, what="replan applied")
        assert first["planId"] != new_plan.plan_id and status["decodeInstances"] == 3
        assert calls[0] == {"deployment": "opt"}

        async def kept_once():
            # the kubelet goes on: a reshuffle step created after the last round above
            # would otherwise never serve, and no decision is made while a reshuffle runs
            await play_kubelet(api, "opt")
            found = await status_of(api, "opt")
            history = (found.get("replanning") or {}).get("history") or []
            return found if len(history) >= 2 else None
        status = await wait_for(kept_once, what="a later decision")
        history = status["replanning"]["history"]
        assert [h["action"] for h in history[:2]] == ["replan", "keep"]
        assert history[0]["reason"].startswith("observed attainment 70.0%")
        assert status["replanning"]["lastObservation"]["numRequests"] == 1200
        assert condition(status, replanning.OBSERVING)["status"] == "True"
        events = [r.data for r in list(kmock) if r.method == "POST" and r.resource is not None
                  and r.resource.plural == "events" and (r.data or {}).get("reason") == "Replanned"]
        assert len(events) == 1 and "ratio" in events[0]["message"]
        assert len(status["replanning"]["state"]["history"]) >= 2
    finally:
        await stop(runner)
    # a restarted operator takes the decision state from the status: its first decision
    # is not "the first" again (the fake decide replans only on an empty history)
    runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
    try:
        seen = len(status["replanning"]["history"])

        async def decided_after_restart():
            found = await status_of(api, "opt")
            history = (found.get("replanning") or {}).get("history") or []
            return found if len(history) > seen else None
        status = await wait_for(decided_after_restart, what="a decision after the restart")
        assert status["replanning"]["history"][seen]["action"] == "keep"
        assert status["appliedPlanId"] == new_plan.plan_id
    finally:
        await stop(runner)
    after = REGISTRY.get_sample_value("distserve_replan_decisions_total",
                                      {"namespace": NAMESPACE, "deployment": "opt",
                                        "action": "replan", "reason": "ratio"})
    assert after == before + 1

