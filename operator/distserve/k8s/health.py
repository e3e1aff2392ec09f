"""Whether a revision serves: its pods' readiness and the failures worth a Degraded.

Pure: pod and Deployment dicts in, a `Report` out. A pod counts as failing when the
scheduler cannot place it (no node with the planned GPUs), when its container cannot
start (image pull, crash loop) or when it has ended; a pod merely starting is not a
problem, just not Ready yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distserve.k8s import weights

# Container waiting reasons that will not fix themselves.
_STUCK_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError",
})


@dataclass(frozen=True)
class Report:
    """What the monitor tells the status."""

    is_ready: bool
    problems: tuple[str, ...]  # one line per failing pod
    summary: str  # e.g. "3/4 worker pods Ready, router 1/1 Ready"


def is_pod_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_problem(pod: dict[str, Any]) -> str | None:
    """Why a pod will not become Ready by itself, or None."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return f"pod {name} {status['phase'].lower()}: {status.get('message', '')}".rstrip(": ")
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable":
            return f"pod {name} unschedulable: {c.get('message', '')}"
    for cs in status.get("initContainerStatuses") or []:  # e.g. a weights download failing
        reason = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
        if reason in _STUCK_REASONS:
            return f"pod {name} init container {cs.get('name')} {reason}"
    for cs in status.get("containerStatuses") or []:
        reason = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
        if reason in _STUCK_REASONS:
            return f"pod {name} {reason}"
    return None


def router_ready(deployment: dict[str, Any] | None) -> tuple[int, int]:
    """(ready, wanted) replicas of the router Deployment."""
    if not deployment:
        return 0, 1
    wanted = int((deployment.get("spec") or {}).get("replicas", 1))
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    return ready, wanted


def assess(pods: list[dict[str, Any]], expected: int, router: dict[str, Any] | None) -> Report:
    """Ready when every expected worker pod and at least one router replica are Ready."""
    ready = sum(1 for p in pods if is_pod_ready(p))
    problems = [p for p in (pod_problem(pod) for pod in pods) if p]
    if len(pods) < expected:
        problems.append(f"{expected - len(pods)} of {expected} worker pods missing")
    router_up, router_wanted = router_ready(router)
    summary = f"{ready}/{expected} worker pods Ready, router {router_up}/{router_wanted} Ready"
    loading = weights.loading_summary(pods)  # e.g. "2 loading weights": minutes, not a fault
    if loading:
        summary += f" ({loading})"
    is_ready = expected > 0 and ready >= expected and router_up >= 1
    return Report(is_ready, tuple(problems), summary)
