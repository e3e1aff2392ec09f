"""The periodic monitor of one DistServeDeployment: what serves, what is wrong, what
must be re-created, drained or removed.

Each round (the kopf timer, under the resource's lock, on a fresh read of it):
1. re-create what the applied revision and the router run on and has gone missing;
2. remove the objects of old revisions that have no pod left (nothing to drain:
   their Services, ConfigMaps and router entries would otherwise stay forever);
3. judge readiness from the pods and the router, and the cluster from the Nodes: a
   plan whose nodes are gone, not Ready or cordoned (or a cluster with no Ready GPU
   node at all) is Degraded with reason `NodesNotReady` and an Event, never a crash;
4. drain old revisions once the new one serves, delete them once idle or at the
   drain deadline. The deadline is kept in `status.drainDeadline` (next to
   `status.drainingSince`), so an operator restart neither restarts nor forgets it.
"""

from __future__ import annotations

import datetime
from typing import Any

import kopf

from distserve.k8s import applying, draining, health, naming, nodes, planning
from distserve.k8s import status as st
from distserve.k8s.client import ApiClient
from distserve.k8s.reconciling import KIND, PLANNING_REASONS, Timing, write_status

NODES_REASON = "NodesNotReady"


async def monitor(api: ApiClient, body: Any, timing: Timing) -> None:
    """One round: heal, remove pod-less revisions, judge pods and nodes, advance the rollout."""
    owner = naming.Owner.from_body(body)
    # NOTE: kopf's body may predate a status this operator just wrote (a new revision):
    # judging old and new from it would drain the new revision.
    body = await api.get(KIND, owner.namespace, owner.name) or body
    status = body.get("status") or {}
    revision_id = status.get("revision")
    if not revision_id:
        return
    found_nodes = await planning.read_nodes(api)
    await heal(api, body, owner, status, found_nodes)
    running = await applying.revisions_running(api, owner)
    await remove_podless_revisions(api, body, owner, revision_id, set(running))
    report = health.assess(running.get(revision_id, []), status.get("expectedPods", 0),
                           await api.get("Deployment", owner.namespace, naming.router_name(owner)))
    node_issues = node_problems(body, status, found_nodes)
    old_ids = {rid for rid in running if rid != revision_id}
    is_serving = report.is_ready and not node_issues
    fields = await advance_rollout(api, body, owner, old_ids, is_serving, timing)
    if not old_ids and status.get("drainingSince"):
        fields = {**fields, "drainingSince": None, "drainDeadline": None}
    if not is_planning_failure(status):
        post_node_events(body, status, node_issues)
    await write_status(api, owner, {**fields, **monitor_phase(status, report, node_issues, old_ids)},
                       monitor_conditions(status, report, node_issues))


def is_planning_failure(status: dict[str, Any]) -> bool:
    """Whether a planning failure owns the Degraded condition (only a new spec clears it)."""
    degraded = st.condition(status, st.DEGRADED)
    return bool(degraded and degraded.get("status") == "True"
                and degraded.get("reason") in PLANNING_REASONS)


def node_problems(body: Any, status: dict[str, Any], found: list[dict[str, Any]] | None) -> list[str]:
    """What is wrong with the nodes the applied plan runs on (none when Nodes are unreadable)."""
    if found is None:
        return []
    try:
        is_cpu = nodes.is_cpu_spec(planning.parse(body["spec"]))
    except planning.Unplannable:
        return []
    plan = st.stored_plan(status)
    is_applied = plan is not None and status.get("appliedPlanId") == plan.plan_id
    plan_nodes = {s.node for s in plan.segments} if is_applied else set()
    return nodes.node_problems(plan_nodes, found, is_cpu=is_cpu)


def post_node_events(body: Any, status: dict[str, Any], node_issues: list[str]) -> None:
    """An Event when the nodes fail and when they recover (not every round)."""
    degraded = st.condition(status, st.DEGRADED) or {}
    was_down = degraded.get("status") == "True" and degraded.get("reason") == NODES_REASON
    if node_issues and not was_down:
        kopf.warn(body, reason=NODES_REASON, message="; ".join(node_issues))
    elif was_down and not node_issues:
        kopf.info(body, reason="NodesReady", message="the plan's nodes are Ready again")


async def heal(api: ApiClient, body: Any, owner: naming.Owner, status: dict[str, Any],
               found_nodes: list[dict[str, Any]] | None) -> None:
    """Re-create what the applied plan runs on and has gone missing, with an Event."""
    plan = st.stored_plan(status)
    if body["metadata"].get("deletionTimestamp") or plan is None \
            or status.get("appliedPlanId") != plan.plan_id:
        return
    try:
        spec, known = await planning.shape_spec(api, planning.parse(body["spec"]), found_nodes)
    except planning.Unplannable:
        return  # no usable node (reported as NodesNotReady) or a spec gone bad: nothing to do
    revision = naming.Revision(owner, plan, spec)
    if revision.id != status.get("revision"):
        return  # the spec changed since: the change handler applies the new plan
    created = await applying.recreate_missing(api, revision, set(known))
    if created:
        kopf.warn(body, reason="Recreated", message=f"re-created missing {', '.join(created)}")


async def remove_podless_revisions(api: ApiClient, body: Any, owner: naming.Owner,
                                   revision_id: str, with_pods: set[str]) -> None:
    """Delete the objects and router entries of old revisions that have no pod left."""
    present = await applying.revisions_present(api, owner)
    gone = present - with_pods - {revision_id}
    if not gone:
        return
    try:
        spec = planning.parse(body["spec"])
    except planning.Unplannable:
        return
    count = await applying.delete_revisions(api, owner, spec, gone)
    kopf.info(body, reason="Removed",
              message=f"{count} objects of {sorted(gone)} deleted: no pod of them was left")


def monitor_phase(status: dict[str, Any], report: health.Report, node_issues: list[str],
                  old_ids: set[str]) -> dict[str, Any]:
    """Phase and message from the nodes and the pods (a planning failure keeps its own)."""
    if is_planning_failure(status):
        return {}
    problems = [*node_issues, *report.problems]
    if problems:
        return {"phase": st.DEGRADED_PHASE, "message": "; ".join(problems)}
    if report.is_ready and not old_ids:
        return {"phase": st.READY_PHASE, "message": report.summary}
    return {"phase": st.ROLLING_OUT if old_ids else st.APPLYING, "message": report.summary}


def monitor_conditions(status: dict[str, Any], report: health.Report, node_issues: list[str]
                       ) -> list[tuple[str, bool, str, str]]:
    """Ready always; Degraded unless a planning failure owns it."""
    if node_issues:
        ready = (st.READY, False, NODES_REASON, "; ".join(node_issues))
    else:
        ready = (st.READY, report.is_ready, "AllReady" if report.is_ready else "NotReady",
                 report.summary)
    conditions = [ready]
    if not is_planning_failure(status):
        problems = [*node_issues, *report.problems]
        reason = NODES_REASON if node_issues else "PodsFailing" if problems else "Healthy"
        conditions.append((st.DEGRADED, bool(problems), reason,
                           "; ".join(problems) or "no failing pod"))
    return conditions


def drain_window(status: dict[str, Any], timing: Timing) -> tuple[datetime.datetime, datetime.datetime]:
    """(start, deadline) of the drain in progress; a status from before deadlines were
    kept gets the operator's current drain timeout."""
    started = st.parse_iso(status["drainingSince"])
    deadline = status.get("drainDeadline")
    if deadline:
        return started, st.parse_iso(deadline)
    return started, started + datetime.timedelta(seconds=timing.drain_seconds)


async def advance_rollout(api: ApiClient, body: Any, owner: naming.Owner, old_ids: set[str],
                          is_ready: bool, timing: Timing) -> dict[str, Any]:
    """Drain old revisions once the new one is Ready; delete them once idle (or at the deadline)."""
    status = body.get("status") or {}
    if not old_ids or not is_ready:
        return {}
    spec = planning.parse(body["spec"])
    now = datetime.datetime.now(datetime.timezone.utc)
    if not status.get("drainingSince"):
        since = st.to_iso(now)
        count = await applying.mark_draining(api, owner, spec, old_ids, since)
        deadline = st.to_iso(now + datetime.timedelta(seconds=timing.drain_seconds))
        kopf.info(body, reason="Draining",
                  message=f"{count} pods of {sorted(old_ids)} draining, deleted at {deadline} at the latest")
        return {"drainingSince": since, "drainDeadline": deadline}
    started, deadline = drain_window(status, timing)
    elapsed_s = (now - started).total_seconds()
    timeout_s = (deadline - started).total_seconds()
    old = [e for e in await applying.read_router_instances(api, owner) if e.get("revision") in old_ids]
    why = await draining.verdict(old, elapsed_s, timing.drain_min_seconds, timeout_s)
    if why is None:
        return {}
    count = await applying.delete_revisions(api, owner, spec, old_ids)
    reason = "idle" if why == "idle" else f"drain deadline {st.to_iso(deadline)}"
    kopf.info(body, reason="Drained",
              message=f"{count} objects of {sorted(old_ids)} deleted ({reason}, after {elapsed_s:.0f}s)")
    return {"drainingSince": None, "drainDeadline": None}
