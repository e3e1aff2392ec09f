"""Cluster shape from Nodes, status and conditions, health, router lists, idempotent patches."""

from __future__ import annotations

from k8s_factories import make_node, make_plan, make_revision, make_spec

from distserve.k8s import applying, fleet, health, nodes, workers
from distserve.k8s import status as st


def test_cluster_shape_counts_ready_gpu_nodes_and_reads_the_gpu_type():
    cordoned = make_node("c", 8)
    cordoned["spec"] = {"unschedulable": True}
    found = [make_node("b", 8), make_node("a", 8), make_node("cpu-only", 0),
             make_node("down", 8, ready=False), cordoned, make_node("odd", 4)]
    shape = nodes.cluster_shape(found, is_cpu=False)
    assert shape.node_names == ("a", "b", "odd")
    assert shape.gpus_per_node == 8
    assert shape.accelerator == "A100-80GB"
    h100 = nodes.cluster_shape([make_node("h", 8, "NVIDIA-H100-80GB-HBM3")], is_cpu=False)
    assert h100.accelerator == "H100-80GB"


def test_fill_cluster_keeps_what_the_user_gave():
    spec = make_spec(cluster={"accelerator": "H100-80GB"})
    shape = nodes.ClusterShape(("a", "b", "c", "d"), 8, "A100-80GB")
    filled = nodes.fill_cluster(spec, shape)
    assert filled.cluster.nodes == 4
    assert filled.cluster.gpus_per_node == 8
    assert filled.cluster.node_names == ["a", "b", "c", "d"]
    assert filled.cluster.accelerator == "H100-80GB"
    default = nodes.fill_cluster(make_spec(cluster={}), shape)
    assert default.cluster.accelerator == "A100-80GB"
    assert not nodes.needs_nodes(make_spec())


def test_plan_status_has_the_printer_columns_and_figures():
    plan = make_plan()
    status = st.build_plan_status(plan)
    assert status["planId"] == plan.plan_id
    assert (status["prefillInstances"], status["decodeInstances"]) == (1, 2)
    assert status["prefill"] == {"tp": 2, "pp": 1, "instances": 1}
    assert status["predictedGoodputRps"] == 3.0
    assert status["colocatedGoodputRps"] == 1.0
    assert status["latency"]["ttftP90Seconds"] == 0.2
    assert status["nodeAssignment"]["gpu-node-a"] == ["decode-0/s0 gpus 2", "prefill-0/s0 gpus 0,1"]
    assert st.stored_plan(status) == plan


def test_condition_transition_time_moves_only_when_status_flips():
    conditions = st.set_condition(None, st.READY, False, "NotReady", "0/3", now="t0")
    conditions = st.set_condition(conditions, st.READY, False, "NotReady", "1/3", now="t1")
    assert conditions[0]["lastTransitionTime"] == "t0"
    assert conditions[0]["message"] == "1/3"
    conditions = st.set_condition(conditions, st.PLANNED, True, "Planned", "ok", now="t2")
    conditions = st.set_condition(conditions, st.READY, True, "AllReady", "3/3", now="t3")
    assert [c["type"] for c in conditions] == ["Planned", "Ready"]
    assert conditions[1]["lastTransitionTime"] == "t3"


def _pod(name, ready=False, **status):
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": {"name": name}, "status": {"conditions": conditions, **status}}


def test_health_ready_needs_every_pod_and_a_router():
    router_up = {"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}
    pods = [_pod("a", True), _pod("b", True)]
    assert health.assess(pods, 2, router_up).is_ready
    assert not health.assess(pods, 2, None).is_ready
    assert not health.assess(pods[:1], 2, router_up).is_ready
    report = health.assess(pods[:1], 2, router_up)
    assert report.problems == ("1 of 2 worker pods missing",)


def test_health_names_stuck_pods():
    unschedulable = _pod("u", conditions=[{"type": "PodScheduled", "status": "False",
                                           "reason": "Unschedulable",
                                           "message": "0/4 nodes have 8 nvidia.com/gpu"}])
    crashing = _pod("c", containerStatuses=[{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}])
    starting = _pod("s", containerStatuses=[{"state": {"waiting": {"reason": "ContainerCreating"}}}])
    report = health.assess([unschedulable, crashing, starting], 3, None)
    assert report.problems == ("pod u unschedulable: 0/4 nodes have 8 nvidia.com/gpu",
                               "pod c CrashLoopBackOff")


def test_route_instances_adds_drains_and_removes_instances_and_revisions():
    old = make_revision()
    new = make_revision(plan=make_plan(decode=(1, 1, 3)))
    routed = applying.route_instances([], add=workers.instance_endpoints(old))
    routed = applying.route_instances(routed, add=workers.instance_endpoints(new))
    assert [(e["revision"], e["draining"]) for e in routed].count((old.id, False)) == 3
    assert len(routed) == 3 + 4
    one = f"decode-1-{old.id}"
    drained = applying.route_instances(routed, draining=frozenset({one}))
    assert [e["name"] for e in drained if e["draining"]] == [one]
    assert applying.route_instances(drained, serving=frozenset({one})) == routed
    removed = applying.route_instances(drained, removed=frozenset({one}))
    assert one not in {e["name"] for e in removed} and len(removed) == 6
    gone = applying.route_instances(removed, removed_revisions=frozenset({old.id}))
    assert {e["revision"] for e in gone} == {new.id}


def test_patches_of_pods_touch_only_metadata_and_quantities_compare_as_text():
    pod = workers.build_worker_pod_spec(make_revision(), make_plan().segments[0], set())
    assert set(applying.patch_of(pod)) == {"metadata"}
    desired = {"spec": {"resources": {"limits": {"nvidia.com/gpu": 2}}, "ports": [{"port": 80}]}}
    current = {"spec": {"resources": {"limits": {"nvidia.com/gpu": "2"}}, "ports": [{"port": 80,
               "protocol": "TCP"}], "clusterIP": "10.0.0.1"}}
    assert applying.is_subset(desired, current)
    assert not applying.is_subset({"spec": {"ports": [{"port": 81}]}}, current)


def merge_patch(doc: dict, patch: dict) -> dict:
    """A JSON merge patch (RFC 7386), as the API server applies a status patch."""
    out = dict(doc)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = value
    return out


def documents_in(status: dict) -> list[str]:
    """The ids of every plan document the status holds, with repeats."""
    found = [status["plan"]["id"]] if status.get("plan") else []
    found += [doc["id"] for doc in (status.get("priorPlans") or {}).values()]
    found += [ref["id"] for ref in (status.get("revisionPlans") or {}).values() if isinstance(ref, dict)]
    return found


def test_the_status_stores_each_plan_once_through_a_replan_and_its_drain():
    old, new = make_plan(), make_plan(prefill=(1, 1, 2))
    old_rev, new_rev = make_revision(old), make_revision(new)
    members = fleet.plan_members(old_rev)
    status = merge_patch({}, st.store_plans_once({}, st.build_plan_status(old)))
    status = merge_patch(status, st.store_plans_once(status, fleet.status_fields(members, status, {})))
    assert documents_in(status) == [old.plan_id]
    assert status["revisionPlans"] == {old_rev.id: old.plan_id}
    # a replan is shown while the old plan's instances serve: the old document moves aside
    status = merge_patch(status, st.store_plans_once(status, st.build_plan_status(new)))
    assert sorted(documents_in(status)) == sorted([new.plan_id, old.plan_id])
    assert fleet.revision_plans(status) == {old_rev.id: old}
    # the reshuffle runs both revisions' instances, then only the new ones
    both = members + fleet.plan_members(new_rev)
    status = merge_patch(status, st.store_plans_once(status, fleet.status_fields(both, status, {})))
    assert sorted(documents_in(status)) == sorted([new.plan_id, old.plan_id])
    assert fleet.revision_plans(status) == {old_rev.id: old, new_rev.id: new}
    status = merge_patch(status, st.store_plans_once(
        status, fleet.status_fields(fleet.plan_members(new_rev), status, {})))
    assert documents_in(status) == [new.plan_id]
    assert "priorPlans" not in status or not status["priorPlans"]
    assert fleet.revision_plans(status) == {new_rev.id: new}


def test_a_status_whose_revision_plans_hold_documents_is_still_read():
    plan = make_plan()
    revision = make_revision(plan)
    assert fleet.revision_plans({"revisionPlans": {revision.id: plan.to_dict()}}) == {revision.id: plan}
