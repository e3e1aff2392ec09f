"""Reconciling one DistServeDeployment: plan, apply, watch the rollout, clean up.

The sequence for a new plan (blue/green, no request lost):
1. the new revision's config, Services and pods are created next to the old ones and
   the router is told about them;
2. once all its pods and the router are Ready, the old revisions are marked draining
   (pod label + router config, which the running router re-reads): the router sends
   them nothing new, and the router pods are not rolled;
3. once the old instances are idle (in-flight requests finished), or at the drain
   timeout, the old objects are deleted (`draining`).

The monitor also re-creates what the applied plan runs on and has gone missing (a
deleted pod, Service or ConfigMap), with an Event.

Status is written with a fresh read of the resource under a per-resource lock, so
the change handlers and the periodic monitor never overwrite each other's
conditions.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import kopf

from distserve import spec as specs
from distserve.k8s import applying, draining, health, naming, planning
from distserve.k8s import status as st
from distserve.k8s.client import ApiClient

KIND = specs.KIND
# Reasons of a Degraded condition that only a new spec can clear (the monitor keeps them).
PLANNING_REASONS = ("InvalidSpec", "NoFeasiblePlan", "NoNodes")


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
    patch = {**fields, "conditions": merged} if conditions else dict(fields)
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
    await write_status(api, owner, {"phase": st.PLANNING, "message": "searching for a placement",
                                    "observedGeneration": generation})
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
    await write_status(api, owner, {**st.build_plan_status(plan), "message": message},
                       [(st.PLANNED, True, "Planned", message)])
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
    await write_status(api, owner, {"phase": st.DEGRADED_PHASE, "message": message + suffix},
                       [(st.PLANNED, False, reason, message),
                        (st.DEGRADED, True, reason, message + suffix)])


async def apply_plan(api: ApiClient, body: Any, owner: naming.Owner, planned: planning.Planned) -> None:
    """Start the plan's revision next to what runs; the monitor finishes the rollout."""
    revision = naming.Revision(owner, planned.plan, planned.spec)
    counts = await applying.apply_revision(api, revision, set(planned.known_nodes))
    running = await applying.revisions_running(api, owner)
    is_rollout = any(rid != revision.id for rid in running)
    message = (f"plan {planned.plan.plan_id} revision {revision.id}: {counts['created']} objects "
               f"created, {counts['patched']} patched, {counts['unchanged']} unchanged")
    kopf.info(body, reason="Applied", message=message)
    await write_status(api, owner, {
        "phase": st.ROLLING_OUT if is_rollout else st.APPLYING, "message": message,
        "appliedPlanId": planned.plan.plan_id, "revision": revision.id,
        "expectedPods": len(planned.plan.segments), "drainingSince": None,
    }, [(st.APPLIED, True, "Applied", message),
        (st.DEGRADED, False, "Applied", "the plan is applied")])


async def approve(api: ApiClient, body: Any) -> None:
    """Apply the shown plan once the annotation names it (and it is not applied yet)."""
    status = body.get("status") or {}
    plan = st.stored_plan(status)
    if plan is None or approval(body) != plan.plan_id or status.get("appliedPlanId") == plan.plan_id:
        return
    spec, known = await planning.shape_spec(api, planning.parse(body["spec"]))
    owner = naming.Owner.from_body(body)
    kopf.info(body, reason="Approved", message=f"plan {plan.plan_id} approved")
    await apply_plan(api, body, owner, planning.Planned(plan, spec, known))


async def resume(api: ApiClient, body: Any) -> None:
    """After an operator restart: re-apply the applied plan (a no-op when all is right)."""
    status = body.get("status") or {}
    plan = st.stored_plan(status)
    if plan is None:
        await plan_resource(api, body)
        return
    if status.get("appliedPlanId") != plan.plan_id:
        return  # still awaiting approval, or planning failed: nothing to restore
    spec, known = await planning.shape_spec(api, planning.parse(body["spec"]))
    await apply_plan(api, body, naming.Owner.from_body(body), planning.Planned(plan, spec, known))


async def monitor(api: ApiClient, body: Any, timing: Timing) -> None:
    """Periodically: readiness, Degraded on failing pods, missing objects re-created,
    draining and removing old revisions."""
    owner = naming.Owner.from_body(body)
    # NOTE: kopf's body may predate a status this operator just wrote (a new revision):
    # judging old and new from it would drain the new revision.
    body = await api.get(KIND, owner.namespace, owner.name) or body
    status = body.get("status") or {}
    revision_id = status.get("revision")
    if not revision_id:
        return
    await heal(api, body, owner, status)
    running = await applying.revisions_running(api, owner)
    report = health.assess(running.get(revision_id, []), status.get("expectedPods", 0),
                           await api.get("Deployment", owner.namespace, naming.router_name(owner)))
    old_ids = {rid for rid in running if rid != revision_id}
    fields = await advance_rollout(api, body, owner, old_ids, report.is_ready, timing)
    await write_status(api, owner, {**fields, **monitor_phase(status, report, old_ids)},
                       monitor_conditions(status, report))


async def heal(api: ApiClient, body: Any, owner: naming.Owner, status: dict[str, Any]) -> None:
    """Re-create what the applied plan runs on and has gone missing, with an Event."""
    plan = st.stored_plan(status)
    if body["metadata"].get("deletionTimestamp") or plan is None \
            or status.get("appliedPlanId") != plan.plan_id:
        return
    spec, known = await planning.shape_spec(api, planning.parse(body["spec"]))
    revision = naming.Revision(owner, plan, spec)
    if revision.id != status.get("revision"):
        return  # the spec changed since: the change handler applies the new plan
    created = await applying.recreate_missing(api, revision, set(known))
    if created:
        kopf.warn(body, reason="Recreated", message=f"re-created missing {', '.join(created)}")


def monitor_phase(status: dict[str, Any], report: health.Report, old_ids: set[str]) -> dict[str, Any]:
    """Phase and message from the pods' health (a planning failure keeps its own)."""
    degraded = st.condition(status, st.DEGRADED)
    if degraded and degraded.get("status") == "True" and degraded.get("reason") in PLANNING_REASONS:
        return {}
    if report.problems:
        return {"phase": st.DEGRADED_PHASE, "message": "; ".join(report.problems)}
    if report.is_ready and not old_ids:
        return {"phase": st.READY_PHASE, "message": report.summary}
    return {"phase": st.ROLLING_OUT if old_ids else st.APPLYING, "message": report.summary}


def monitor_conditions(status: dict[str, Any], report: health.Report) -> list[tuple[str, bool, str, str]]:
    """Ready always; Degraded unless a planning failure owns it."""
    conditions = [(st.READY, report.is_ready, "AllReady" if report.is_ready else "NotReady",
                   report.summary)]
    degraded = st.condition(status, st.DEGRADED)
    if not (degraded and degraded.get("status") == "True"
            and degraded.get("reason") in PLANNING_REASONS):
        conditions.append((st.DEGRADED, bool(report.problems),
                           "PodsFailing" if report.problems else "Healthy",
                           "; ".join(report.problems) or "no failing pod"))
    return conditions


async def advance_rollout(api: ApiClient, body: Any, owner: naming.Owner, old_ids: set[str],
                          is_ready: bool, timing: Timing) -> dict[str, Any]:
    """Drain old revisions once the new one is Ready; delete them once idle (or at the timeout)."""
    status = body.get("status") or {}
    if not old_ids or not is_ready:
        return {}
    spec = planning.parse(body["spec"])
    since = status.get("drainingSince")
    if not since:
        now = st.now_iso()
        count = await applying.mark_draining(api, owner, spec, old_ids, now)
        kopf.info(body, reason="Draining", message=f"{count} pods of {sorted(old_ids)} draining")
        return {"drainingSince": now}
    started = datetime.datetime.strptime(since, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    elapsed = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    old = [e for e in await applying.read_router_instances(api, owner) if e.get("revision") in old_ids]
    why = await draining.verdict(old, elapsed, timing.drain_min_seconds, timing.drain_seconds)
    if why is None:
        return {}
    count = await applying.delete_revisions(api, owner, spec, old_ids)
    reason = "idle" if why == "idle" else f"drain timeout {timing.drain_seconds:.0f}s"
    kopf.info(body, reason="Drained",
              message=f"{count} objects of {sorted(old_ids)} deleted ({reason}, after {elapsed:.0f}s)")
    return {"drainingSince": None}


async def delete_resource(api: ApiClient, body: Any) -> int:
    """Delete everything the resource owns (the garbage collector would, eventually)."""
    owner = naming.Owner.from_body(body)
    return await applying.delete_labelled(api, owner.namespace, {naming.DEPLOYMENT_LABEL: owner.name})
