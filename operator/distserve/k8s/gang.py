"""Gang scheduling: an instance spread over several pods is placed whole or not at all.

An instance with pp > 1 runs one pod per pipeline stage, and its stages wait for each
other at the rendezvous: half of them scheduled holds GPUs and serves nothing. With
`spec.engine.gangScheduling.enabled`, each such instance gets a PodGroup of the
scheduler-plugins coscheduling plugin (`scheduling.x-k8s.io/v1alpha1`, minMember = its
pods), its pods carry the label `scheduling.x-k8s.io/pod-group`, and every worker pod
names the scheduler that runs the plugin (one scheduler for all GPU pods, so two
schedulers never race for the same GPUs). Instances of one pod need no group.
"""

from __future__ import annotations

from typing import Any

from distserve.k8s import naming

POD_GROUP_API = "scheduling.x-k8s.io/v1alpha1"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"


def is_enabled(revision: naming.Revision) -> bool:
    """Whether the spec asks for gang scheduling."""
    return revision.spec.engine.gang_scheduling.enabled


def pod_group_name(revision: naming.Revision, role: str, index: int) -> str | None:
    """The PodGroup of an instance, or None when it needs none (one pod, or disabled)."""
    phase = revision.plan.phase_of(role, index)  # type: ignore[arg-type]
    if not is_enabled(revision) or phase.pp < 2:
        return None
    return naming.instance_service_name(revision, role, index)


def build_pod_groups(revision: naming.Revision) -> list[dict[str, Any]]:
    """One PodGroup per instance of several pods."""
    gang = revision.spec.engine.gang_scheduling
    groups = []
    for role in ("prefill", "decode"):
        for index in range(revision.plan.num_instances(role)):
            phase = revision.plan.phase_of(role, index)
            name = pod_group_name(revision, role, index)
            if name is None:
                continue
            labels = naming.worker_labels(revision, role, index, None)
            groups.append({
                "apiVersion": POD_GROUP_API,
                "kind": "PodGroup",
                "metadata": naming.object_meta(revision.owner, name, labels),
                "spec": {"minMember": phase.pp,
                         "scheduleTimeoutSeconds": gang.schedule_timeout_seconds},
            })
    return groups


def pod_fields(revision: naming.Revision, role: str, index: int) -> tuple[dict[str, str], dict[str, Any]]:
    """(labels, pod spec fields) that put a worker pod under the gang scheduler."""
    if not is_enabled(revision):
        return {}, {}
    name = pod_group_name(revision, role, index)
    labels = {POD_GROUP_LABEL: name} if name else {}
    return labels, {"schedulerName": revision.spec.engine.gang_scheduling.scheduler_name}
