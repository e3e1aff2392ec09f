"""Reconciling one DistServeDeployment: plan, apply, clean up.

A new plan (a spec edit, an approval, a replan) is applied as an incremental reshuffle
(`reshuffling` plans it, `rollout` runs it): the instances the new plan shares with the
running ones stay; the others are replaced one at a time, new ones first where GPUs are
free, else an old one is drained (the router sends it nothing new, in-flight requests
finish), deleted, and its replacement started on the GPUs it freed. A cluster the plan
fills needs no spare GPUs. The creates that need no room start here; every other step,
healing and node checks are the periodic monitor's (`monitoring`).

`status.observedGeneration` moves to a spec's generation once the plan for it is done
(shown, or refused with a reason), together with the plan's id: a client that waits
for it never reads the previous plan as the answer to its change.

Status is written with a fresh read of the resource under a per-resource lock, so
the change handlers and the periodic monitor never overwrite each other's
conditions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import kopf

from distserve import spec as specs
from distserve.k8s import applying, metrics, naming, network, planning, reshuffling, rollout
from distserve.k8s import status as st
from distserve.k8s.client import ApiClient

KIND = specs.KIND
# A plan refused because the free GPUs cannot hold it: the old plan serves, and the
# monitor applies the refused one once other workloads free the GPUs it needs.
NO_ROOM = "NoRoom"
# Reasons of a Degraded condition that only a new spec (or, for NO_ROOM, freed GPUs) can
# clear: the monitor keeps them.
PLANNING_REASONS = ("InvalidSpec", "NoFeasiblePlan", "NoNodes", NO_ROOM)


def _env_seconds(name: str, default: float) -> float:
    """A duration from the operator's environment (the chart sets these)."""
    return float(os.environ.get(name, default))


@dataclass(frozen=True)
class Timing:
    """How often the monitor looks, and how long old instances may drain before deletion."""

    monitor_interval_s: float = field(
        default_factory=lambda: _env_seconds("DISTSERVE_MONITOR_INTERVAL_S", 10.0))
    # The drain timeout: old instances go then even if not idle.
    drain_seconds: float = field(
        default_factory=lambda: _env_seconds("DISTSERVE_DRAIN_SECONDS", 300.0))
    # Before this, idleness means nothing: the router may not have seen the drain yet
    # (kubelet refreshes ConfigMap volumes about once a minute).
    drain_min_seconds: float = field(
        default_factory=lambda: _env_seconds("DISTSERVE_DRAIN_MIN_SECONDS", 90.0))
    # How often the replanning timer wakes to see whether spec.replanning.intervalSeconds
    # has passed (the interval itself is the spec's, per resource).
    replan_tick_s: float = field(
        default_factory=lambda: _env_seconds("DISTSERVE_REPLAN_TICK_S", 15.0))


async def write_status(
    api: ApiClient, owner: naming.Owner, fields: dict[str, Any],
    conditions: list[tuple[str, bool, str, str]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """Merge fields and conditions into the current status; returns the new status."""
    current = await api.get(KIND, owner.namespace, owner.name)
    if current is None:
        return {}
    status = current.get("status") or {}
    merged = status.get("conditions")
    for kind, is_true, reason, message in conditions:
        merged = st.set_condition(merged, kind, is_true, reason, message)
    patch = st.store_plans_once(status, {**fields, "conditions": merged} if conditions else dict(fields))
    if patch.get("phase"):
        metrics.set_phase(owner, patch["phase"])
    if not patch or st_matches(status, patch):
        return status
    await api.patch(KIND, owner.namespace, owner.name, {"status": patch}, subresource="status")
    return {**status, **patch}


def st_matches(status: dict[str, Any], patch: dict[str, Any]) -> bool:
    """Whether the status already says what the patch would (None: key absent)."""
    return all(
        (v is None and k not in status) or (v is not None and applying.is_subset(v, status.get(k)))
        for k, v in patch.items()
    )


async def plan_resource(api: ApiClient, body: Any) -> None:
    """On a new or changed spec: plan, show the plan, apply it if allowed."""
    owner = naming.Owner.from_body(body)
    generation = body["metadata"].get("generation")
    await write_status(api, owner, {"phase": st.PLANNING, "message": "searching for a placement"})
    try:
        planned = await planning.make_plan(api, body["spec"])
    except planning.Unplannable as exc:
        await degrade(api, body, owner, exc.reason, str(exc))
        return
    plan = planned.plan
    message = (f"plan {plan.plan_id}: prefill {plan.prefill.instances}x(tp{plan.prefill.tp},"
               f"pp{plan.prefill.pp}), decode {plan.decode.instances}x(tp{plan.decode.tp},"
               f"pp{plan.decode.pp}), {plan.goodput_rps:.2f} req/s predicted")
    kopf.info(body, reason="Planned", message=f"{message} (search {plan.search_seconds:.1f}s)")
    served = st.rate_condition(plan)
    if not served[1]:
        kopf.warn(body, reason="RateNotServed", message=served[3])
    await write_status(api, owner, {**st.build_plan_status(plan), "message": message,
                                    "observedGeneration": generation},
                       [(st.PLANNED, True, "Planned", message), served])
    if planned.spec.auto_apply or approval(body) == plan.plan_id:
        await apply_plan(api, body, owner, planned)
        return
    wait = (f"plan {plan.plan_id} awaits approval: kubectl annotate distservedeployment "
            f"{owner.name} {naming.APPROVAL_ANNOTATION}={plan.plan_id}")
    kopf.info(body, reason="AwaitingApproval", message=wait)
    await write_status(api, owner, {"phase": st.AWAITING_APPROVAL, "message": wait})


def approval(body: Any) -> str | None:
    """The plan id the user approved through the annotation, if any."""
    return (body["metadata"].get("annotations") or {}).get(naming.APPROVAL_ANNOTATION)


async def degrade(api: ApiClient, body: Any, owner: naming.Owner, reason: str, message: str) -> None:
    """A spec that cannot be planned: Degraded, an Event, and whatever runs keeps running."""
    kopf.warn(body, reason=reason, message=message)
    running = (body.get("status") or {}).get("appliedPlanId")
    suffix = f"; plan {running} keeps serving" if running else "; nothing was created"
    await write_status(api, owner, {"phase": st.DEGRADED_PHASE, "message": message + suffix,
                                    "observedGeneration": body["metadata"].get("generation")},
                       [(st.PLANNED, False, reason, message),
                        (st.DEGRADED, True, reason, message + suffix)])


async def apply_plan(api: ApiClient, body: Any, owner: naming.Owner, planned: planning.Planned,
                     *, is_retry: bool = False) -> bool:
    """Plan the reshuffle from what runs to the plan and start it; the monitor finishes it.
    False when the free GPUs cannot hold it: refused (NoRoom), or, on a retry of a refused
    plan, left refused without a new Event."""
    revision = naming.Revision(owner, planned.plan, planned.spec)
    await apply_access(api, body, owner, planned.spec)  # before any pod: none runs unguarded
    current = await api.get(KIND, owner.namespace, owner.name) or body
    status = current.get("status") or {}
    shuffle = status.get("reshuffle") or {}
    if status.get("revision") == revision.id and (shuffle.get("revision") in (None, revision.id)) \
            and status.get("instances") is not None:
        # this revision is applied or on its way: the monitor heals and advances it; what
        # the router runs with beyond the revision (its API key) may have changed
        await applying.refresh_router(api, owner, planned.spec)
        return True
    try:
        fields, result = await rollout.start(api, owner, planned, status)
    except reshuffling.ReshuffleError as exc:
        if not is_retry:
            await degrade(api, body, owner, NO_ROOM, f"plan {planned.plan.plan_id} not applied: "
                          f"{exc}; it is applied once the GPUs it needs are free")
        return False
    steps = ", ".join(f"{s.action} {s.instance.name}" for s in result.steps) or "none"
    message = (f"plan {planned.plan.plan_id} revision {revision.id}: {len(result.kept)} instances "
               f"kept, steps: {steps}")
    kopf.info(body, reason="Applied", message=message)
    fields.update(phase=st.ROLLING_OUT if result.steps else st.APPLYING, message=message,
                  appliedPlanId=planned.plan.plan_id, revision=revision.id,
                  expectedPods=len(planned.plan.segments), drainingSince=None, drainDeadline=None)
    # the creates that need no room freed start now, not at the next monitor round
    fields.update(await rollout.advance(api, body, owner, {**status, **fields}, planned.spec,
                                        set(planned.known_nodes), None, only_creates=True))
    await write_status(api, owner, fields, [(st.APPLIED, True, "Applied", message),
        (st.DEGRADED, False, "Applied", "the plan is applied")])
    return True


async def apply_access(api: ApiClient, body: Any, owner: naming.Owner,
                       spec: specs.DistServeDeploymentSpec) -> None:
    """The deployment's NetworkPolicies as the spec asks; an Event when it asks for them
    and the operator's chart has them off."""
    await applying.apply_network_policies(api, owner, spec)
    if spec.network_policy.enabled and not network.settings().is_managed:
        kopf.warn(body, reason="NetworkPolicyOff", message="spec.networkPolicy.enabled, but the "
                  "operator's chart has networkPolicy.enabled false: no NetworkPolicy is created "
                  "and the instances' endpoints are open to every pod in the cluster")


async def approve(api: ApiClient, body: Any) -> None:
    """Apply the shown plan once the annotation names it (and it is not applied yet)."""
    status = body.get("status") or {}
    plan = st.stored_plan(status)
    if plan is None or approval(body) != plan.plan_id or status.get("appliedPlanId") == plan.plan_id:
        return
    owner = naming.Owner.from_body(body)
    try:
        spec, known = await planning.shape_spec(api, planning.parse(body["spec"]))
    except planning.Unplannable as exc:
        await degrade(api, body, owner, exc.reason, f"plan {plan.plan_id} approved, not applied: {exc}")
        return
    kopf.info(body, reason="Approved", message=f"plan {plan.plan_id} approved")
    await apply_plan(api, body, owner, planning.Planned(plan, spec, known))


async def resume(api: ApiClient, body: Any) -> None:
    """After an operator restart: re-apply the applied plan (a no-op when all is right)."""
    status = body.get("status") or {}
    plan = st.stored_plan(status)
    if plan is None:
        await plan_resource(api, body)
        return
    if status.get("appliedPlanId") != plan.plan_id or status.get("instances") is not None:
        return  # awaiting approval, planning failed, or applied: the monitor heals and advances
    try:
        spec, known = await planning.shape_spec(api, planning.parse(body["spec"]))
    except planning.Unplannable:
        return  # no usable node now: the monitor reports it, what exists is left as it is
    await apply_plan(api, body, naming.Owner.from_body(body), planning.Planned(plan, spec, known))


async def delete_resource(api: ApiClient, body: Any) -> int:
    """Delete everything the resource owns (the garbage collector would, eventually)."""
    owner = naming.Owner.from_body(body)
    return await applying.delete_labelled(api, owner.namespace, {naming.DEPLOYMENT_LABEL: owner.name})
