"""The spec's parts about pods: where the weights come from, and what each role's pods get.

`ModelSource` says where the engine pods find the weights: a PersistentVolumeClaim, a
node's folder (hostPath), a Hugging Face download into a cache volume by an init
container, or a folder baked into the image. Exactly one is set, as with a Kubernetes
volume source.

`PodOptions` are the fields a platform team sets on pods (resources, scheduling,
identity, metadata, extra volumes and environment, security context, startup time).
`spec.engine` carries them as the default of every role; `spec.engine.prefill`,
`.decode` and `.router` override them per role (`merge_options`): a scalar replaces the
default, a mapping is merged key by key, a list is appended to the default's.

Kubernetes types a user copies from other manifests (volumes, volume mounts, env,
security contexts) pass through as mappings; the fields they need are checked here and
the API server checks the rest.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from distserve.spec_base import SpecModel

# A resource quantity: 2, 500m, 1.5, 4Gi, 1e3.
_QUANTITY = re.compile(r"^[+]?(\d+\.?\d*|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?$")
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
RESERVED_PREFIX = "distserve.io/"  # the operator's own labels and annotations
# Volumes the operator itself puts in every pod; a user volume may not take these names.
RESERVED_VOLUMES = frozenset({"config", "router-config", "dshm", "tmp", "cache", "weights"})
RESERVED_MOUNT_PATHS = frozenset({"/etc/distserve", "/etc/distserve/router", "/dev/shm", "/tmp",
                                  "/var/cache/distserve"})
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")

Quantity = int | float | str


def is_quantity(value: Quantity) -> bool:
    """Whether a value is a Kubernetes resource quantity."""
    return not isinstance(value, bool) and bool(_QUANTITY.match(str(value)))


def _check_quantities(values: dict[str, Quantity] | None, field: str) -> dict[str, Quantity] | None:
    for name, value in (values or {}).items():
        if not is_quantity(value):
            raise ValueError(f"{field}.{name}: expected a quantity such as 2, 500m or 16Gi, "
                             f"got {value!r}")
    return values


class Resources(SpecModel):
    """CPU, memory and other resources of a container; GPUs come from the plan."""

    requests: dict[str, Quantity] | None = Field(
        default=None, description="Requests, e.g. {cpu: 8, memory: 64Gi}.")
    limits: dict[str, Quantity] | None = Field(
        default=None, description="Limits, e.g. {memory: 128Gi}.")

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, value: dict[str, Quantity] | None, info: Any) -> dict[str, Quantity] | None:
        if value and GPU_RESOURCE in value:
            raise ValueError(f"{info.field_name}: {GPU_RESOURCE} comes from the plan (tp GPUs "
                             "per pod); leave it out")
        return _check_quantities(value, info.field_name)


class Toleration(SpecModel):
    """A Kubernetes toleration."""

    key: str | None = Field(default=None, description="Taint key; empty with Exists: all.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; empty: all.")
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated.")


class LocalObjectReference(SpecModel):
    """A reference to an object in the same namespace, by name."""

    name: str = Field(min_length=1, pattern=_DNS_SUBDOMAIN, description="Object name.")


def _check_named(items: list[dict[str, Any]] | None, field: str, required: tuple[str, ...]
                 ) -> list[dict[str, Any]] | None:
    """Every item has the required keys."""
    for index, item in enumerate(items or []):
        missing = [k for k in required if not item.get(k)]
        if missing:
            raise ValueError(f"{field}[{index}]: missing {', '.join(missing)}")
    return items


def _check_metadata(values: dict[str, str] | None, field: str) -> dict[str, str] | None:
    for key in values or {}:
        if key.startswith(RESERVED_PREFIX):
            raise ValueError(f"{field}.{key}: keys under {RESERVED_PREFIX} belong to the operator")
    return values


class PodOptions(SpecModel):
    """What a platform team sets on the pods of a role (or of every role, on `engine`)."""

    resources: Resources | None = Field(
        default=None, description="Container requests and limits (cpu, memory, ...); unset "
        "ones get defaults so pods are never BestEffort. GPUs come from the plan.")
    node_selector: dict[str, str] | None = Field(default=None, description="Node selector.")
    tolerations: list[Toleration] | None = Field(default=None, description="Tolerations.")
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None, description="Secrets to pull the engine image with.")
    priority_class_name: str | None = Field(default=None, description="PriorityClass of the pods.")
    service_account_name: str | None = Field(
        default=None, description="ServiceAccount the pods run as (default: the namespace's).")
    annotations: dict[str, str] | None = Field(default=None, description="Pod annotations.")
    labels: dict[str, str] | None = Field(default=None, description="Pod labels.")
    volumes: list[dict[str, Any]] | None = Field(
        default=None, description="Extra pod volumes (Kubernetes Volume objects).")
    volume_mounts: list[dict[str, Any]] | None = Field(
        default=None, description="Extra mounts of the main container (name, mountPath, ...).")
    env: list[dict[str, Any]] | None = Field(
        default=None, description="Extra environment variables (Kubernetes EnvVar objects).")
    security_context: dict[str, Any] | None = Field(
        default=None, description="Pod securityContext fields merged over the restricted "
        "default (runAsNonRoot, runAsUser 10001, seccomp RuntimeDefault).")
    container_security_context: dict[str, Any] | None = Field(
        default=None, description="Container securityContext fields merged over the "
        "restricted default (no privilege escalation, all capabilities dropped, read-only "
        "root filesystem).")
    startup_timeout_seconds: int | None = Field(
        default=None, ge=30, le=86400, description="How long the container may take to start "
        "serving (weights loading) before it is restarted; default 1800 for engines, 300 for "
        "the router.")

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        _check_named(value, "volumes", ("name",))
        for volume in value or []:
            if volume["name"] in RESERVED_VOLUMES:
                raise ValueError(f"volumes: the name {volume['name']!r} is the operator's; "
                                 f"avoid {', '.join(sorted(RESERVED_VOLUMES))}")
        return value

    @field_validator("volume_mounts")
    @classmethod
    def _mounts(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        _check_named(value, "volumeMounts", ("name", "mountPath"))
        for mount in value or []:
            if str(mount["mountPath"]).rstrip("/") in RESERVED_MOUNT_PATHS:
                raise ValueError(f"volumeMounts: {mount['mountPath']} is mounted by the operator")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return _check_named(value, "env", ("name",))

    @field_validator("labels", "annotations")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None, info: Any) -> dict[str, str] | None:
        return _check_metadata(value, info.field_name)


POD_OPTION_FIELDS = tuple(PodOptions.model_fields)


def merge_options(default: PodOptions, role: PodOptions | None) -> PodOptions:
    """The role's options over the default: scalars replace, mappings merge, lists append."""
    merged: dict[str, Any] = {}
    for name in POD_OPTION_FIELDS:
        base, over = getattr(default, name), getattr(role, name) if role else None
        if over is None:
            merged[name] = base
        elif base is None:
            merged[name] = over
        elif isinstance(base, list):
            merged[name] = [*base, *over]
        elif isinstance(base, Resources):
            merged[name] = Resources(
                requests={**(base.requests or {}), **(over.requests or {})} or None,
                limits={**(base.limits or {}), **(over.limits or {})} or None)
        elif isinstance(base, dict):
            merged[name] = {**base, **over}
        else:
            merged[name] = over
    options = PodOptions.model_construct(**merged)
    mounted = {v["name"] for v in options.volumes or []}
    for mount in options.volume_mounts or []:
        if mount["name"] not in mounted and mount["name"] not in RESERVED_VOLUMES:
            raise ValueError(f"volumeMounts: {mount['name']!r} names no volume of the pod")
    return options


class PersistentVolumeClaimSource(SpecModel):
    """Weights on a PersistentVolumeClaim, mounted read-only."""

    claim_name: str = Field(min_length=1, pattern=_DNS_SUBDOMAIN, description="The claim.")
    sub_path: str | None = Field(
        default=None, description="Folder (or .gguf file) inside the volume, e.g. opt-13b.")

    @field_validator("sub_path")
    @classmethod
    def _relative(cls, value: str | None) -> str | None:
        if value and (value.startswith("/") or ".." in value.split("/")):
            raise ValueError("subPath: expected a path inside the volume, without a leading / "
                             f"or .., got {value!r}")
        return value


class HostPathSource(SpecModel):
    """Weights in a folder of every node, mounted read-only (fails Pod Security restricted)."""

    path: str = Field(pattern=r"^/", description="Absolute folder on the node.")


class SecretKeyRef(SpecModel):
    """One key of a Secret."""

    name: str = Field(min_length=1, pattern=_DNS_SUBDOMAIN, description="The Secret.")
    key: str = Field(default="token", min_length=1, description="Key holding the value.")


class ModelCache(SpecModel):
    """Where a download lands: a shared claim, else an emptyDir per pod."""

    claim_name: str | None = Field(
        default=None, pattern=_DNS_SUBDOMAIN, description="A PersistentVolumeClaim shared by "
        "the pods (ReadWriteMany across nodes): one download serves every pod and restart.")
    size_limit: str | None = Field(
        default=None, description="Size limit of the per-pod emptyDir (no claim), e.g. 64Gi.")

    @field_validator("size_limit")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        _check_quantities({"sizeLimit": value} if value else None, "cache")
        return value


class HuggingFaceSource(SpecModel):
    """Weights downloaded from the Hugging Face Hub by an init container."""

    repo: str | None = Field(default=None, description="Repository id; default: model.name.")
    revision: str = Field(default="main", min_length=1, description="Branch, tag or commit.")
    token_secret: SecretKeyRef | None = Field(
        default=None, description="Secret key holding an access token (gated models).")
    allow_patterns: list[str] = Field(
        default=list(DEFAULT_ALLOW_PATTERNS), min_length=1,
        description="Files to download (glob patterns); the default takes safetensors "
        "weights, configs and tokenizer files.")
    cache: ModelCache = Field(default_factory=ModelCache, description="Where files land.")


class ImageSource(SpecModel):
    """Weights baked into the engine image."""

    path: str = Field(pattern=r"^/", description="Absolute folder (or .gguf file) in the image.")


class ModelSource(SpecModel):
    """Where the engine pods find the weights; exactly one field is set."""

    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(
        default=None, description="Weights on a PersistentVolumeClaim.")
    host_path: HostPathSource | None = Field(
        default=None, description="Weights in a folder of every node (hostPath).")
    hugging_face: HuggingFaceSource | None = Field(
        default=None, description="Download from the Hugging Face Hub before the engine starts.")
    image: ImageSource | None = Field(default=None, description="Weights inside the image.")

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        chosen = [name for name in type(self).model_fields if getattr(self, name) is not None]
        if len(chosen) != 1:
            raise ValueError("expected exactly one of persistentVolumeClaim, hostPath, "
                             f"huggingFace, image; got {len(chosen)}")
        return self

    @property
    def kind(self) -> str:
        """The field that is set."""
        return next(n for n in type(self).model_fields if getattr(self, n) is not None)


class GangScheduling(SpecModel):
    """All-or-nothing scheduling of an instance's pods (scheduler-plugins coscheduling)."""

    enabled: bool = Field(default=False, description="Give each instance of several pods a "
                          "PodGroup (scheduling.x-k8s.io) and use the scheduler below.")
    scheduler_name: str = Field(
        default="scheduler-plugins-scheduler", min_length=1,
        description="The scheduler that runs the coscheduling plugin.")
    schedule_timeout_seconds: int = Field(
        default=600, ge=1, description="How long a group may wait for all its pods to fit.")
