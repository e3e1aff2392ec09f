"""Running a reshuffle: the planner's steps, one per monitor round, kept in the status.

`start` plans the steps from the live instances to a new plan's (`reshuffling`), against
the GPUs free now (`nodes.free_gpus`: allocatable minus what other pods hold), and
writes them to `status.reshuffle` = `{"revision", "steps": [{"action", "revision",
"role", "index", "name"}], "next", "drainingSince", "drainDeadline"}`. `advance` runs
the step at `next`, and finishes it when its condition holds:
- create: the instance's Service and pods exist and the router lists it (live); done
  once every pod is Ready. Consecutive creates start together: they need no room freed;
- drain: the router marks it draining (no new request; in-flight ones finish) and its
  pods are labelled; done once it is idle or at the drain deadline (`draining`);
- delete: its pods and Service go and the router forgets it; done at once.
An operator restart resumes at `next`; a drain keeps its deadline.
"""

from __future__ import annotations

import datetime
from typing import Any

import kopf

from distserve import spec as specs
from distserve.k8s import (
    applying,
    draining,
    fleet,
    health,
    naming,
    nodes,
    planning,
    reshuffling,
    workers,
)
from distserve.k8s import status as st
from distserve.k8s.client import ApiClient, ApiError


async def read_free_gpus(api: ApiClient, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                         plan_nodes: set[str]) -> dict[str, int]:
    """Node -> GPUs this deployment may use now, for every node a plan names. A node that
    is no Node object (the spec counted nodes without naming them), or a CPU spec, has
    `gpusPerNode`; when the operator may not list pods, other pods are not counted."""
    per_node = spec.cluster.gpus_per_node or 0
    found = await planning.read_nodes(api) or []
    if nodes.is_cpu_spec(spec):
        return {node: per_node for node in plan_nodes}
    try:
        pods = await api.list("Pod")
    except ApiError as exc:
        if exc.status not in (403, 404):
            raise
        pods = []

    def is_ours(pod: dict[str, Any]) -> bool:
        meta = pod["metadata"]
        return meta.get("namespace") == owner.namespace and \
            (meta.get("labels") or {}).get(naming.DEPLOYMENT_LABEL) == owner.name
    free = nodes.free_gpus(found, pods, is_ours)
    return {node: free.get(node, per_node) for node in plan_nodes}


def _step_record(step: reshuffling.Step) -> dict[str, Any]:
    """A step as the status keeps it."""
    i = step.instance
    return {"action": step.action, "revision": i.revision, "role": i.role, "index": i.index,
            "name": i.name}


async def start(api: ApiClient, owner: naming.Owner, planned: planning.Planned,
                status: dict[str, Any]) -> tuple[dict[str, Any], reshuffling.Reshuffle]:
    """Plan the reshuffle to `planned` (ReshuffleError when none fits); the status fields."""
    spec = planned.spec
    revision = naming.Revision(owner, planned.plan, spec)
    old = fleet.live_members(owner, spec, status)
    new = fleet.plan_members(revision)
    old_prints = [m.footprint(revision.engine_hash) for m in old]
    new_prints = [m.footprint(revision.engine_hash) for m in new]
    plan_nodes = {node for i in old_prints + new_prints for node, _ in i.stages}
    free = await read_free_gpus(api, owner, spec, plan_nodes)
    for instance in old_prints:  # the free count of a node is with our instances gone
        for node, gpus in instance.node_to_gpus.items():
            free[node] -= gpus
    result = reshuffling.plan_reshuffle(old_prints, new_prints, free)
    await applying.create_or_patch(api, workers.build_engine_config_map_spec(revision))
    kept = frozenset(i.name for i in result.kept)
    routed = await applying.read_router_config(api, owner)
    if routed is not None:  # the router names the plan it moves to (its metrics export it)
        is_redrained = kept and any(e.get("draining") and e["name"] in kept
                                    for e in routed.get("instances", []))
        change = {"serving": kept} if is_redrained else {}  # a replaced reshuffle's drain
        await applying.update_router(api, owner, spec, plan=planned.plan, **change)
    shuffle = {"revision": revision.id, "steps": [_step_record(s) for s in result.steps],
               "next": 0, "drainingSince": None, "drainDeadline": None} if result.steps else None
    fields = {"reshuffle": shuffle, **fleet.status_fields(old, status, {revision.id: planned.plan})}
    return fields, result


def _find(members: list[fleet.Member], step: dict[str, Any]) -> fleet.Member | None:
    """The live instance a step names."""
    return next((m for m in members if (m.revision_id, m.role, m.index)
                 == (step["revision"], step["role"], int(step["index"]))), None)


async def create(api: ApiClient, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                 known: set[str], plans: dict[str, Any], step: dict[str, Any],
                 live: list[fleet.Member]) -> list[fleet.Member]:
    """Make a create step's instance exist and be routed to; the live set with it."""
    found = _find(live, step)
    made = found or fleet.member(owner, spec, step["revision"], plans[step["revision"]],
                                 step["role"], int(step["index"]))
    if made.revision is None:
        return live  # the spec changed what pods run since: the next reshuffle replaces this one
    await applying.apply_objects(api, [workers.build_engine_config_map_spec(made.revision),
                                       *made.objects(known)])
    routed = {e.get("name") for e in await applying.read_router_instances(api, owner)}
    if made.name not in routed:
        await applying.update_router(api, owner, spec, plans[step["revision"]], add=[made.endpoint()])
    return live if found else [*live, made]


async def is_instance_ready(api: ApiClient, owner: naming.Owner, member: fleet.Member) -> bool:
    """Whether every pod of the instance exists and is Ready."""
    labels = applying.instance_labels(owner, member.revision_id, member.role, member.index)
    pods = await api.list("Pod", owner.namespace, labels)
    return len(pods) >= member.num_pods and all(health.is_pod_ready(p) for p in pods)


async def advance(api: ApiClient, body: Any, owner: naming.Owner, status: dict[str, Any],
                  spec: specs.DistServeDeploymentSpec, known: set[str], timing: Any,
                  only_creates: bool = False) -> dict[str, Any]:
    """One round of the reshuffle in `status`; the status fields that changed ({} if none)."""
    shuffle = status.get("reshuffle")
    if not shuffle:
        return {}
    steps, index = shuffle["steps"], int(shuffle["next"])
    plans = fleet.revision_plans(status)
    live = fleet.live_members(owner, spec, status)
    for step in steps[index:]:
        if step["action"] != "create":
            break
        live = await create(api, owner, spec, known, plans, step, live)
    shuffle = dict(shuffle)
    if index < len(steps) and not only_creates:
        is_done, live, shuffle = await _run_step(api, body, owner, spec, steps[index], live, shuffle, timing)
        index += is_done
    shuffle["next"] = index
    if index >= len(steps):
        kopf.info(body, reason="Reshuffled", message=f"revision {shuffle['revision']}: "
                  f"{len(steps)} steps done, {len(live)} instances serve")
        shuffle = None
    return {"reshuffle": shuffle, **fleet.status_fields(live, status, {})}


async def _run_step(api: ApiClient, body: Any, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                    step: dict[str, Any], live: list[fleet.Member], shuffle: dict[str, Any],
                    timing: Any) -> tuple[bool, list[fleet.Member], dict[str, Any]]:
    """(is done, live set, reshuffle state) after acting on one step."""
    member = _find(live, step)
    if step["action"] == "create":
        return member is not None and await is_instance_ready(api, owner, member), live, shuffle
    if member is None:  # gone already (an earlier round deleted it)
        return True, live, {**shuffle, "drainingSince": None, "drainDeadline": None}
    labels = applying.instance_labels(owner, member.revision_id, member.role, member.index)
    if step["action"] == "drain":
        is_done, shuffle = await _drain(api, body, owner, spec, member, labels, shuffle, timing)
        return is_done, live, shuffle
    count = await applying.delete_labelled(api, owner.namespace, labels, _instance_kinds(spec))
    await applying.update_router(api, owner, spec, removed=frozenset({member.name}))
    live = [m for m in live if m is not member]
    if not any(m.revision_id == member.revision_id for m in live) \
            and member.revision_id != shuffle["revision"]:
        revision_labels = {naming.DEPLOYMENT_LABEL: owner.name, naming.REVISION_LABEL: member.revision_id}
        count += await applying.delete_labelled(api, owner.namespace, revision_labels,
                                                applying.OWNED_KINDS)
    kopf.info(body, reason="Deleted", message=f"instance {member.name}: {count} objects deleted")
    return True, live, shuffle


def _instance_kinds(spec: specs.DistServeDeploymentSpec) -> tuple[str, ...]:
    """What one instance owns (PodGroups only exist, and are listed, with gang scheduling)."""
    return ("Pod", "Service") + (("PodGroup",) if spec.engine.gang_scheduling.enabled else ())


async def _drain(api: ApiClient, body: Any, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                 member: fleet.Member, labels: dict[str, str], shuffle: dict[str, Any],
                 timing: Any) -> tuple[bool, dict[str, Any]]:
    """Start a drain, or finish it once the instance is idle or at its deadline."""
    now = datetime.datetime.now(datetime.timezone.utc)
    if not shuffle.get("drainingSince"):
        since = st.to_iso(now)
        await applying.update_router(api, owner, spec, draining=frozenset({member.name}))
        await applying.label_draining(api, owner, labels, since)
        deadline = st.to_iso(now + datetime.timedelta(seconds=timing.drain_seconds))
        kopf.info(body, reason="Draining",
                  message=f"instance {member.name} draining, deleted at {deadline} at the latest")
        return False, {**shuffle, "drainingSince": since, "drainDeadline": deadline}
    started, deadline = st.parse_iso(shuffle["drainingSince"]), st.parse_iso(shuffle["drainDeadline"])
    elapsed_s = (now - started).total_seconds()
    entries = [e for e in await applying.read_router_instances(api, owner) if e["name"] == member.name]
    why = await draining.verdict(entries, elapsed_s, timing.drain_min_seconds,
                                 (deadline - started).total_seconds())
    if why is None:
        return False, shuffle
    reason = "idle" if why == "idle" else f"drain deadline {st.to_iso(deadline)}"
    kopf.info(body, reason="Drained", message=f"instance {member.name} drained ({reason}, "
              f"after {elapsed_s:.0f}s)")
    return True, {**shuffle, "drainingSince": None, "drainDeadline": None}
