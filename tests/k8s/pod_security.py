"""The Pod Security Standards, "baseline" and "restricted" levels, as a checker of pod specs.

Written from the Kubernetes documentation (concepts/security/pod-security-standards),
the controls that a pod spec the operator builds could break: host namespaces,
privileged containers, capabilities, hostPath volumes, host ports, volume types,
privilege escalation, running as non-root, seccomp. `restricted_violations` returns
one line per broken control; an empty list means the pod is admitted under
`pod-security.kubernetes.io/enforce: restricted`.
"""

from __future__ import annotations

from typing import Any

# restricted: only these volume types.
ALLOWED_VOLUME_TYPES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
})
ALLOWED_SECCOMP = frozenset({"RuntimeDefault", "Localhost"})


def _containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec.get("containers", []),
            *pod_spec.get("ephemeralContainers", [])]


def _baseline(pod_spec: dict[str, Any]) -> list[str]:
    problems = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(field):
            problems.append(f"{field} is true")
    for volume in pod_spec.get("volumes", []):
        if "hostPath" in volume:
            problems.append(f"hostPath volume {volume['name']}")
    for c in _containers(pod_spec):
        context = c.get("securityContext") or {}
        if context.get("privileged"):
            problems.append(f"container {c['name']} is privileged")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                problems.append(f"container {c['name']} uses hostPort {port['hostPort']}")
        if (context.get("procMount") or "Default") != "Default":
            problems.append(f"container {c['name']} procMount {context['procMount']}")
    return problems


def _seccomp_type(context: dict[str, Any] | None) -> str | None:
    return ((context or {}).get("seccompProfile") or {}).get("type")


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Every "baseline" and "restricted" control the pod spec breaks."""
    problems = _baseline(pod_spec)
    pod_context = pod_spec.get("securityContext") or {}
    for volume in pod_spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']} of type {', '.join(sorted(kinds))}")
    if pod_context.get("runAsUser") == 0:
        problems.append("pod runAsUser 0")
    for c in _containers(pod_spec):
        name, context = c["name"], c.get("securityContext") or {}
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"container {name}: allowPrivilegeEscalation is not false")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"container {name}: capabilities do not drop ALL")
        added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            problems.append(f"container {name}: adds capabilities {', '.join(sorted(added))}")
        run_as_non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
        if run_as_non_root is not True:
            problems.append(f"container {name}: runAsNonRoot is not true")
        if context.get("runAsUser") == 0:
            problems.append(f"container {name}: runAsUser 0")
        seccomp = _seccomp_type(context) or _seccomp_type(pod_context)
        if seccomp not in ALLOWED_SECCOMP:
            problems.append(f"container {name}: seccomp profile {seccomp} (want RuntimeDefault)")
    return problems
