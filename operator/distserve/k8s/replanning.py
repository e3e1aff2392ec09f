"""The replanning loop under the operator: observe a window in Prometheus, decide, and
hand a replan to the same reshuffle a spec edit gets.

Each round of the kopf timer, when `spec.replanning.enabled` and `intervalSeconds` have
passed since the last observation: `analyzer.observe` reads the window (asynchronous,
with the client's timeouts), `analyzer.decide` runs the search and simulator in a
worker thread (as planning does), and the outcome goes to
- `status.replanning`: the last observation in figures, the last decision with its
  reason and numbers, and the last HISTORY_LENGTH decisions;
- the counter `distserve_replan_decisions_total{action, reason}` (`reason` is a short
  category, the full text is in the status and the Event);
- an Event for every replan or recommendation;
- the condition `Observing`: False with reason `PrometheusUnavailable` while
  Prometheus cannot be read (no decision then, and no crash).
A replan is shown as the plan (`status.plan`) and applied as a reshuffle, or waits for
the approval annotation when `autoApply` is false; `advisory` only recommends. The
decision state (reference window, hold, cooldown, latency correction) is written to
`status.replanning.state` with every decision, so a restarted operator goes on with
the hold and cooldown it had instead of starting them afresh.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from typing import Any

import kopf

from distserve.analyzer import decide as deciding
from distserve.analyzer import observe as observing
from distserve.analyzer.observation import Observation
from distserve.analyzer.prometheus import PrometheusClient, PrometheusError
from distserve.k8s import metrics, naming, planning, reconciling
from distserve.k8s import status as st
from distserve.k8s.client import ApiClient

HISTORY_LENGTH = 10
OBSERVING = "Observing"


def reason_label(decision: deciding.Decision) -> str:
    """A short, bounded category of the decision's reason (the metric's label)."""
    if decision.action in ("replan", "recommend"):
        return decision.kind or "plan"
    text = decision.reason
    for needle, label in (("too few requests", "too-few-requests"), ("histogram", "no-histogram"),
                          ("cooldown", "cooldown"), ("hold", "hold"), ("no shift", "no-change")):
        if needle in text:
            return label
    return "other"


def observation_summary(observation: Observation) -> dict[str, Any]:
    """The window's figures as the status shows them."""
    def rounded(value: float | None, digits: int = 4) -> float | None:
        return None if value is None else round(value, digits)
    return {
        "endTime": st.to_iso(_utc(observation.end_s)), "windowSeconds": observation.window_s,
        "numRequests": observation.num_requests,
        "arrivalRateRps": rounded(observation.arrival_rate_rps),
        "arrivalCv": rounded(observation.arrival_cv),
        "promptMeanTokens": rounded(observation.prompt.mean_tokens, 1) if observation.prompt else None,
        "outputMeanTokens": rounded(observation.output.mean_tokens, 1) if observation.output else None,
        "attainment": rounded(observation.attainment), "planId": observation.plan_id,
    }


def _utc(seconds: float) -> datetime.datetime:
    """A unix time as an aware UTC datetime."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)


def decision_summary(decision: deciding.Decision, end_s: float) -> dict[str, Any]:
    """The decision as the status shows it."""
    numbers = {k: v for k, v in dataclasses.asdict(decision.numbers).items() if v is not None}
    return {"time": st.to_iso(_utc(end_s)), "action": decision.action, "kind": decision.kind,
            "reason": decision.reason, "planId": decision.plan.plan_id if decision.plan else None,
            "numbers": numbers}


def is_due(memo: Any, interval_s: float, now_s: float) -> bool:
    """Whether `interval_s` has passed since the last observation of this resource."""
    return now_s - memo.get("replan_observed_s", float("-inf")) >= interval_s


async def replan_round(api: ApiClient, body: Any, memo: Any, lock: asyncio.Lock) -> None:
    """One round: observe, decide, record, and apply a replan when allowed."""
    owner = naming.Owner.from_body(body)
    body = await api.get(reconciling.KIND, owner.namespace, owner.name) or body
    try:
        spec = planning.parse(body["spec"])
    except planning.Unplannable:
        return
    settings = spec.replanning
    status = body.get("status") or {}
    plan = st.stored_plan(status)
    if settings is None or not settings.enabled or plan is None \
            or status.get("appliedPlanId") != plan.plan_id or status.get("reshuffle"):
        return  # nothing applied, or a reshuffle still running: nothing to judge yet
    now_s = time.time()
    if not is_due(memo, settings.interval_seconds, now_s):
        return
    memo["replan_observed_s"] = now_s
    if not settings.prometheus_url:
        await reconciling.write_status(api, owner, {}, [(OBSERVING, False, "NoPrometheus",
                                                         "spec.replanning.prometheusUrl is unset")])
        return
    try:
        client = PrometheusClient(settings.prometheus_url)
        # NOTE: one query first: a Prometheus that is down fails here, before the window's
        # queries run side by side.
        await client.aquery("vector(1)", now_s)
        observation = await observing.observe(client, {"deployment": owner.name},
                                              window_s=settings.window_seconds, end_s=now_s)
    except (PrometheusError, OSError, ValueError) as exc:
        metrics.count_decision(owner, "no-decision", "prometheus-unavailable")
        await reconciling.write_status(api, owner, {}, [(OBSERVING, False, "PrometheusUnavailable",
                                                         f"no decision: {exc}")])
        return
    try:
        decision = await decide(api, spec, plan, settings, observation, memo, status)
    except (ValueError, ArithmeticError) as exc:  # the search could not judge this window
        metrics.count_decision(owner, "no-decision", "evaluator-failed")
        await reconciling.write_status(api, owner, {}, [(OBSERVING, False, "EvaluatorFailed",
                                                         f"no decision: {type(exc).__name__}: {exc}")])
        return
    async with lock:
        await record(api, body, owner, status, observation, decision)
        if decision.action == "replan" and decision.plan is not None:
            await apply_replan(api, body, owner, decision)


async def decide(api: ApiClient, spec: Any, plan: Any, settings: Any, observation: Observation,
                 memo: Any, status: dict[str, Any]) -> deciding.Decision:
    """The pure decision, its search and simulations in a worker thread; the state comes
    from this operator's memory, else (after a restart) from the status."""
    from distserve.analyzer.replan import SearchEvaluator  # pulls the search in

    shaped, _ = await planning.shape_spec(api, spec)
    evaluator = SearchEvaluator(shaped, node_names=shaped.cluster.node_names,
                                gpus_per_node=shaped.cluster.gpus_per_node,
                                max_gpus=settings.max_gpus)
    state = memo.get("replan_state") or deciding.DecisionState.from_dict(
        (status.get("replanning") or {}).get("state"))
    decision = await asyncio.to_thread(deciding.decide, observation, plan, settings, state, evaluator)
    memo["replan_state"] = decision.state
    return decision


async def record(api: ApiClient, body: Any, owner: naming.Owner, status: dict[str, Any],
                 observation: Observation, decision: deciding.Decision) -> None:
    """Status, metric and Event of one decision."""
    metrics.count_decision(owner, decision.action, reason_label(decision))
    summary = decision_summary(decision, observation.end_s)
    history = [*((status.get("replanning") or {}).get("history") or []),
               {k: summary[k] for k in ("time", "action", "kind", "reason")}][-HISTORY_LENGTH:]
    fields = {"replanning": {"lastObservation": observation_summary(observation),
                             "lastDecision": summary, "history": history,
                             "state": decision.state.to_dict()}}
    if decision.action in ("replan", "recommend"):
        reason = "Replanned" if decision.action == "replan" else "ReplanRecommended"
        kopf.info(body, reason=reason, message=f"{decision.kind}: {decision.reason}")
    await reconciling.write_status(api, owner, fields, [(OBSERVING, True, "Observed",
        f"{observation.num_requests} requests in the last {observation.window_s:.0f} s")])


async def apply_replan(api: ApiClient, body: Any, owner: naming.Owner, decision: deciding.Decision) -> None:
    """Show the new plan and reshuffle to it (or wait for approval, as a spec edit would)."""
    plan = decision.plan
    spec, known = await planning.shape_spec(api, planning.parse(body["spec"]))
    message = f"replanned to {plan.plan_id}: {decision.reason}"
    await reconciling.write_status(api, owner, {**st.build_plan_status(plan), "message": message},
                                   [(st.PLANNED, True, "Replanned", message)])
    if spec.auto_apply or reconciling.approval(body) == plan.plan_id:
        await reconciling.apply_plan(api, body, owner, planning.Planned(plan, spec, known))
        return
    wait = (f"plan {plan.plan_id} awaits approval: kubectl annotate distservedeployment "
            f"{owner.name} {naming.APPROVAL_ANNOTATION}={plan.plan_id}")
    kopf.info(body, reason="AwaitingApproval", message=wait)
    await reconciling.write_status(api, owner, {"phase": st.AWAITING_APPROVAL, "message": wait})
