"""The periodic monitor of one DistServeDeployment: what serves, what is wrong, what
must be re-created, drained or removed.

Each round (the kopf timer, under the resource's lock, on a fresh read of it):
1. re-create what the live instances (`fleet`) and the router run on and has gone
   missing, their NetworkPolicies included;
2. remove the objects of revisions no live instance comes from (a replaced reshuffle's
   leftovers: Services, ConfigMaps and router entries would otherwise stay forever);
3. apply a plan refused for want of free GPUs (`NoRoom`) once they are free;
   otherwise advance the reshuffle in progress by one step (`rollout`); a drain's deadline is
   kept in `status.reshuffle`, so an operator restart neither restarts nor forgets it;
4. judge readiness from the live instances' pods and the router, and the cluster from
   the Nodes: a node of a live instance that is gone, not Ready or cordoned (or a
   cluster with no Ready GPU node at all) is Degraded with reason `NodesNotReady` and
   an Event, never a crash.
"""

from __future__ import annotations

from typing import Any

import kopf

from distserve import spec as specs
from distserve.k8s import (
    applying,
    fleet,
    health,
    naming,
    network,
    nodes,
    planning,
    rollout,
    router,
    workers,
)
from distserve.k8s import status as st
from distserve.k8s.client import ApiClient
from distserve.k8s.reconciling import (
    KIND,
    NO_ROOM,
    PLANNING_REASONS,
    Timing,
    apply_plan,
    approval,
    write_status,
)

NODES_REASON = "NodesNotReady"


async def monitor(api: ApiClient, body: Any, timing: Timing) -> None:
    """One round: heal, remove dead revisions, advance the reshuffle, judge pods and nodes."""
    owner = naming.Owner.from_body(body)
    # NOTE: kopf's body may predate a status this operator just wrote (a new reshuffle):
    # acting on it would redo a step.
    body = await api.get(KIND, owner.namespace, owner.name) or body
    status = body.get("status") or {}
    if not status.get("revision"):
        return
    found_nodes = await planning.read_nodes(api)
    spec = shaped = None
    try:
        spec = planning.parse(body["spec"])
        shaped, known = await planning.shape_spec(api, spec, found_nodes)
    except planning.Unplannable:  # no usable node (judged below), or a spec gone bad
        shaped, known = None, frozenset()
    fields: dict[str, Any] = {}
    found = await applying.inventory(api, owner)
    if shaped is not None:
        spec = shaped
        if await retry_refused(api, body, owner, status, shaped, known):
            return  # the refused plan fits now and is applied: the next round advances it
        await heal(api, body, owner, status, spec, set(known), found)
        await remove_dead_revisions(api, body, owner, status, spec, found)
        fields = await rollout.advance(api, body, owner, status, spec, set(known), timing)
        if fields.get("instances") != status.get("instances"):
            found["Pod"] = {p["metadata"]["name"]: p for p in await api.list(
                "Pod", owner.namespace, {naming.DEPLOYMENT_LABEL: owner.name})}
    after = {**status, **fields}
    members = fleet.live_members(owner, spec, after) if spec is not None else []
    report = health.assess(live_pods(found, members), sum(m.num_pods for m in members),
                           found["Deployment"].get(naming.router_name(owner)))
    node_issues = node_problems(body, after, found_nodes, members)
    is_reshuffling = bool(after.get("reshuffle"))
    if not is_planning_failure(status):
        post_node_events(body, status, node_issues)
    await write_status(api, owner, {**fields, **monitor_phase(status, report, node_issues, is_reshuffling)},
                       monitor_conditions(status, report, node_issues))


async def retry_refused(api: ApiClient, body: Any, owner: naming.Owner, status: dict[str, Any],
                        spec: specs.DistServeDeploymentSpec, known: frozenset[str]) -> bool:
    """Apply the shown plan that was refused for want of free GPUs, once they are free
    (another workload left); until then the refusal stands, with no new Event."""
    degraded = st.condition(status, st.DEGRADED) or {}
    plan = st.stored_plan(status)
    is_refused = degraded.get("status") == "True" and degraded.get("reason") == NO_ROOM
    if not is_refused or plan is None or plan.plan_id == status.get("appliedPlanId") \
            or not (spec.auto_apply or approval(body) == plan.plan_id):
        return False
    return await apply_plan(api, body, owner, planning.Planned(plan, spec, known), is_retry=True)


def live_pods(found: dict[str, dict[str, Any]], members: list[fleet.Member]) -> list[dict[str, Any]]:
    """The pods of the live instances, from the inventory."""
    keys = {(m.revision_id, m.role, str(m.index)) for m in members}
    return [p for p in found["Pod"].values() if (p["metadata"].get("labels", {}).get(naming.REVISION_LABEL),
                                p["metadata"].get("labels", {}).get(naming.ROLE_LABEL),
                                p["metadata"].get("labels", {}).get(naming.INSTANCE_LABEL)) in keys]


def is_planning_failure(status: dict[str, Any]) -> bool:
    """Whether a planning failure owns the Degraded condition (only a new spec clears it)."""
    degraded = st.condition(status, st.DEGRADED)
    return bool(degraded and degraded.get("status") == "True"
                and degraded.get("reason") in PLANNING_REASONS)


def node_problems(body: Any, status: dict[str, Any], found: list[dict[str, Any]] | None,
                  members: list[fleet.Member]) -> list[str]:
    """What is wrong with the nodes the live instances run on (none when Nodes are unreadable)."""
    if found is None:
        return []
    try:
        is_cpu = nodes.is_cpu_spec(planning.parse(body["spec"]))
    except planning.Unplannable:
        return []
    plan_nodes = {s.node for m in members for s in m.plan.segments_of(m.role, m.index)}  # type: ignore[arg-type]
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
               spec: Any, known: set[str], found: dict[str, dict[str, Any]]) -> None:
    """Re-create what the live instances and the router run on and has gone missing, with
    an Event. The router's list, when it is gone too, is rebuilt from the live instances."""
    if body["metadata"].get("deletionTimestamp"):
        return
    members = fleet.live_members(owner, spec, status)
    objects = []
    for revision in {m.revision.id: m.revision for m in members if m.revision}.values():
        objects.append(workers.build_engine_config_map_spec(revision))
    for m in members:
        objects += m.objects(known)
    routed = applying.routed_in(found, owner)
    if not routed:
        shuffle = status.get("reshuffle") or {}
        steps = shuffle.get("steps") or []
        step = steps[shuffle.get("next", 0)] if shuffle.get("next", 0) < len(steps) else {}
        is_draining = step.get("action") == "drain" and shuffle.get("drainingSince")
        draining = frozenset({step["name"]}) if is_draining else frozenset()
        endpoints = [e for e in (m.endpoint() for m in members) if e]
        routed = applying.route_instances(applying.route_instances([], add=endpoints),
                                          draining=draining)
    config = router.build_router_config(owner, spec, routed, st.stored_plan(status))
    objects += [router.build_router_config_map_spec(owner, spec, config),
                router.build_router_deployment_spec(owner, spec, config),
                router.build_router_service_spec(owner, spec),
                *network.build_network_policies(owner, spec, network.settings())]
    created = await applying.create_missing(api, objects, found)
    if created:
        kopf.warn(body, reason="Recreated", message=f"re-created missing {', '.join(created)}")


async def remove_dead_revisions(api: ApiClient, body: Any, owner: naming.Owner,
                                status: dict[str, Any], spec: Any,
                                found: dict[str, dict[str, Any]]) -> None:
    """Delete the objects and router entries of revisions no live instance comes from
    (nor the applied one): what a replaced reshuffle or a lost pod left behind."""
    present = applying.revisions_present(found, owner)
    alive = {m.revision_id for m in fleet.live_members(owner, spec, status)}
    gone = present - alive - {status.get("revision")}
    if not gone:
        return
    count = await applying.delete_revisions(api, owner, spec, gone)
    kopf.info(body, reason="Removed",
              message=f"{count} objects of {sorted(gone)} deleted: no live instance comes from them")


def monitor_phase(status: dict[str, Any], report: health.Report, node_issues: list[str],
                  is_reshuffling: bool) -> dict[str, Any]:
    """Phase and message from the nodes and the pods (a planning failure keeps its own)."""
    if is_planning_failure(status):
        return {}
    problems = [*node_issues, *report.problems]
    if problems:
        return {"phase": st.DEGRADED_PHASE, "message": "; ".join(problems)}
    if report.is_ready and not is_reshuffling:
        return {"phase": st.READY_PHASE, "message": report.summary}
    return {"phase": st.ROLLING_OUT if is_reshuffling else st.APPLYING, "message": report.summary}


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


