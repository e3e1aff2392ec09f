"""What every pod the operator builds gets, whatever its role: hardening, probes, options.

- Security: the Pod Security "restricted" profile by default (non-root user 10001, the
  engine image's; no privilege escalation; every capability dropped; seccomp
  RuntimeDefault; a read-only root filesystem). What the engine writes goes to emptyDirs:
  `/tmp`, `/var/cache/distserve` (HOME and the caches of Hugging Face, Triton, torch) and
  `/dev/shm`. No service-account token is mounted: the engine never calls the API.
- Resources: CPU and memory requests by default, so a pod is never BestEffort; a user's
  request or limit of a resource replaces its default.
- Probes: the engine listens only once its weights are loaded, so the startup probe
  allows `startupTimeoutSeconds` for that (default 30 min for engines); `/livez` fails
  when the engine thread is dead or stuck, so kubelet restarts a hung engine; `/health`
  (readiness) fails while the instance cannot take work.
- The role's `PodOptions` (spec.engine and spec.engine.<role>) applied last.

Pure functions of the spec; `workers` and `router` call them.
"""

from __future__ import annotations

import math
from typing import Any

from distserve import spec as specs
from distserve.spec_pods import PodOptions

RUN_AS_ID = 10001  # the engine image's user (engine/Dockerfile)
SCRATCH_DIR = "/var/cache/distserve"
SHM_DIR = "/dev/shm"
GIB = 1 << 30
MIB = 1 << 20
# NOTE: a prefill instance keeps KV for shared-memory pulls in an arena of
# min(KV cache, 1 GiB) (the engine's MAX_ARENA_BYTES); NCCL and torch's worker ranks
# need their own /dev/shm buffers, about 1 GiB per GPU (less per CPU rank).
KV_ARENA_BYTES = GIB
SHM_BYTES_PER_GPU = GIB
SHM_BYTES_PER_CPU_RANK = 256 * MIB
HOST_MEMORY_BYTES_PER_RANK = 4 * GIB  # weights pass through host memory while loading
CPU_PER_GPU = 2
ENGINE_STARTUP_TIMEOUT_S = 1800  # large checkpoints load for many minutes
ROUTER_STARTUP_TIMEOUT_S = 300  # the router loads only a tokenizer
PROBE_PERIOD_S = 10
LIVENESS_FAILURES = 3
ROUTER_REQUESTS = {"cpu": "1", "memory": "2Gi"}


def shm_size_bytes(num_ranks: int, is_gpu: bool) -> int:
    """Size of an engine pod's /dev/shm: the KV arena plus buffers per rank."""
    per_rank = SHM_BYTES_PER_GPU if is_gpu else SHM_BYTES_PER_CPU_RANK
    return KV_ARENA_BYTES + per_rank * max(1, num_ranks)


def shm_size(spec: specs.DistServeDeploymentSpec, num_ranks: int, is_gpu: bool) -> str:
    """The /dev/shm sizeLimit: spec.engine.shmSize, else `shm_size_bytes` in MiB."""
    return spec.engine.shm_size or f"{shm_size_bytes(num_ranks, is_gpu) // MIB}Mi"


def engine_requests(spec: specs.DistServeDeploymentSpec, num_ranks: int, is_gpu: bool) -> dict[str, str]:
    """Default CPU and memory requests of an engine pod of `num_ranks` GPUs (or CPU ranks)."""
    ranks = max(1, num_ranks)
    cpu = CPU_PER_GPU * ranks if is_gpu else ranks
    memory = shm_size_bytes(num_ranks, is_gpu) + HOST_MEMORY_BYTES_PER_RANK * ranks
    return {"cpu": str(cpu), "memory": f"{memory // MIB}Mi"}


def build_resources(options: PodOptions, defaults: dict[str, str], extended: dict[str, int] | None = None
                    ) -> dict[str, Any]:
    """Requests and limits: the user's, defaults for what they left out, then `extended`
    (GPUs; an extended resource's request must equal its limit)."""
    user = options.resources
    requests = {k: _quantity(v) for k, v in ((user.requests if user else None) or {}).items()}
    limits = {k: _quantity(v) for k, v in ((user.limits if user else None) or {}).items()}
    for name, value in defaults.items():
        if name not in requests and name not in limits:  # a lone limit sets the request
            requests[name] = value
    for name, count in (extended or {}).items():
        requests[name] = limits[name] = count
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _quantity(value: int | float | str) -> int | str:
    """A quantity as the API takes it (an int stays an int; a float becomes a string)."""
    return value if isinstance(value, int) else str(value)


def pod_security_context(options: PodOptions) -> dict[str, Any]:
    """The restricted pod security context, with the user's fields over it."""
    default = {"runAsNonRoot": True, "runAsUser": RUN_AS_ID, "runAsGroup": RUN_AS_ID,
               "fsGroup": RUN_AS_ID, "seccompProfile": {"type": "RuntimeDefault"}}
    return {**default, **(options.security_context or {})}


def container_security_context(options: PodOptions) -> dict[str, Any]:
    """The restricted container security context, with the user's fields over it."""
    default = {"allowPrivilegeEscalation": False, "privileged": False,
               "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
               "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    return {**default, **(options.container_security_context or {})}


def scratch_volumes(shm_limit: str | None) -> list[dict[str, Any]]:
    """The writable emptyDirs under a read-only root; `/dev/shm` when `shm_limit` is given."""
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    if shm_limit:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_limit}})
    return volumes


def scratch_mounts(has_shm: bool) -> list[dict[str, Any]]:
    """Where the scratch volumes are mounted."""
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": SCRATCH_DIR}]
    if has_shm:
        mounts.append({"name": "dshm", "mountPath": SHM_DIR})
    return mounts


def scratch_env() -> list[dict[str, Any]]:
    """Point HOME and every cache the engine's libraries write at the scratch volume."""
    return [
        {"name": "HOME", "value": SCRATCH_DIR},
        {"name": "XDG_CACHE_HOME", "value": f"{SCRATCH_DIR}/.cache"},
        {"name": "HF_HOME", "value": f"{SCRATCH_DIR}/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": f"{SCRATCH_DIR}/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{SCRATCH_DIR}/inductor"},
        {"name": "MPLCONFIGDIR", "value": f"{SCRATCH_DIR}/matplotlib"},
    ]


def build_probes(options: PodOptions, default_startup_s: int) -> dict[str, Any]:
    """Startup (weights loading), liveness (a hung engine) and readiness probes."""
    startup_s = options.startup_timeout_seconds or default_startup_s
    return {
        "startupProbe": {"httpGet": {"path": "/livez", "port": "http"},
                         "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(startup_s / PROBE_PERIOD_S)},
        "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"},
                          "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5,
                          "failureThreshold": LIVENESS_FAILURES},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                           "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
    }


def harden_container(container: dict[str, Any], options: PodOptions, has_shm: bool) -> dict[str, Any]:
    """The container with the security context, scratch mounts and env, and the user's
    extra mounts and env (the user's env comes last so it may override)."""
    return {
        **container,
        "securityContext": container_security_context(options),
        "env": [*container.get("env", []), *scratch_env(), *(options.env or [])],
        "volumeMounts": [*container.get("volumeMounts", []), *scratch_mounts(has_shm),
                         *(options.volume_mounts or [])],
    }


def apply_pod_options(pod_spec: dict[str, Any], options: PodOptions,
                      tolerations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Pod-level fields from the options; `tolerations` are the operator's own, appended."""
    out = {**pod_spec, "securityContext": pod_security_context(options),
           "automountServiceAccountToken": False, "enableServiceLinks": False}
    out["volumes"] = [*pod_spec.get("volumes", []), *(options.volumes or [])]
    if options.node_selector:
        out["nodeSelector"] = dict(options.node_selector)
    merged = [t.model_dump(by_alias=True, exclude_none=True) for t in options.tolerations or []]
    merged += tolerations or []
    if merged:
        out["tolerations"] = merged
    if options.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": s.name} for s in options.image_pull_secrets]
    if options.priority_class_name:
        out["priorityClassName"] = options.priority_class_name
    if options.service_account_name:
        out["serviceAccountName"] = options.service_account_name
    return out


def pod_metadata(options: PodOptions, labels: dict[str, str], annotations: dict[str, str] | None
                 ) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations): the user's, with the operator's on top (they select pods)."""
    return ({**(options.labels or {}), **labels},
            {**(options.annotations or {}), **(annotations or {})})
