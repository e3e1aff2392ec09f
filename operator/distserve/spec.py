"""The DistServeDeployment resource: spec and status as typed models.

This module is the single source of truth for what a user may write in
`distserve.yaml`. The CRD in `crds/` is generated from these models
(`scripts/gen_crds.py`), the command line reads the same file, and the operator
validates the same way. Field names are camelCase in YAML (Kubernetes convention) and
snake_case in Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from distserve.analyzer.settings import ReplanningSpec
from distserve.spec_access import NetworkPolicySpec, RouterSpec
from distserve.spec_base import SpecError, SpecModel
from distserve.spec_pods import GangScheduling, ModelSource, PodOptions, is_quantity, merge_options

ROLES = ("prefill", "decode", "router")  # the roles whose pods take options

API_GROUP = "distserve.io"
API_VERSION = "v1alpha1"
KIND = "DistServeDeployment"
PLURAL = "distservedeployments"
DEFAULT_ENGINE_IMAGE = "ghcr.io/distserve/engine:0.1.0"




class ModelSpec(SpecModel):
    """Which model to serve."""

    name: str = Field(
        min_length=1,
        description="Model to serve: a built-in catalog name or Hugging Face id "
        "(facebook/opt-66b, meta-llama/Llama-2-70b-hf, HuggingFaceTB/SmolLM2-135M-Instruct) "
        "or a path to a Hugging Face config.json.",
    )
    path: str | None = Field(
        default=None,
        description="Where the engine finds the weights: a local folder of safetensors or "
        "GGUF files on this machine (`distserve up`), and inside the pods when no source "
        "is set.",
    )
    source: ModelSource | None = Field(
        default=None,
        description="Where the engine pods find the weights: persistentVolumeClaim, hostPath, "
        "huggingFace (downloaded by an init container) or image. Unset: model.path, else "
        "/models/<name> in the image.",
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        default="auto",
        description="Weight and KV dtype; auto is bfloat16 on CUDA, and on the CPU bfloat16 where "
        "the checkpoint is half-precision or quantized and the CPU multiplies bfloat16 itself "
        "(AMX or AVX512-BF16), float32 otherwise.",
    )
    max_model_len: int | None = Field(
        default=None, ge=16, description="Longest prompt plus output accepted, in tokens."
    )


class SLOSpec(SpecModel):
    """The latency objectives and how many requests must meet them."""

    ttft_seconds: float = Field(gt=0, description="Time-to-first-token SLO in seconds.")
    tpot_seconds: float = Field(gt=0, description="Time-per-output-token SLO in seconds.")
    attainment: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Share of requests that must meet the SLOs (0.9 = 90%).",
    )
    rule: Literal["both", "per-phase"] = Field(
        default="both",
        description="both: a request counts when it meets TTFT and TPOT; per-phase: the "
        "attainment percentile of TTFT and of TPOT are checked separately.",
    )


class WorkloadSpec(SpecModel):
    """The traffic the placement is planned for."""

    dataset: Literal["chatbot", "code", "summarization"] = Field(
        default="chatbot",
        description="Length distribution: chatbot (ShareGPT), code (HumanEval) or "
        "summarization (LongBench-like). Ignored when tracePath is set.",
    )
    trace_path: str | None = Field(
        default=None,
        description="A JSON Lines trace, one request a line: "
        '{"arrival_s": float, "prompt_tokens": int, "output_tokens": int}.',
    )
    arrival: Literal["poisson", "gamma", "trace"] = Field(
        default="poisson",
        description="Arrival process: poisson, gamma (bursty, see cv) or trace (the trace's "
        "own inter-arrival pattern scaled to each rate).",
    )
    cv: float = Field(
        default=1.0, gt=0, description="Coefficient of variation of gamma inter-arrivals."
    )
    rate_rps: float | None = Field(
        default=None,
        gt=0,
        description="Expected traffic in requests per second; instances are replicated "
        "to serve it. Unset: one replica of the best configuration.",
    )

    @model_validator(mode="after")
    def _trace_needs_path(self) -> WorkloadSpec:
        if self.arrival == "trace" and not self.trace_path:
            raise ValueError("arrival 'trace' needs workload.tracePath")
        return self


class ClusterSpec(SpecModel):
    """The GPUs the placement may use."""

    nodes: int | None = Field(
        default=None, ge=1, description="Number of nodes; unset: read from the Node objects."
    )
    gpus_per_node: int | None = Field(
        default=None, ge=1, le=16, description="GPUs per node; unset: read from the Nodes."
    )
    accelerator: str = Field(
        default="A100-80GB",
        description="GPU type: A100-80GB, H100-80GB, H200-141GB, L40S or CPU.",
    )
    node_affinity: Literal["low", "high"] = Field(
        default="low",
        description="low: slow links between nodes, so KV stays inside a node "
        "(Algorithm 2); high: fast links (InfiniBand), instances anywhere (Algorithm 1).",
    )
    inter_node_bandwidth_gbps: float | None = Field(
        default=None, gt=0, description="Network bandwidth between nodes in Gbit/s."
    )
    node_names: list[str] | None = Field(
        default=None, description="Names of the nodes to place on, in order."
    )


class PlannerSpec(SpecModel):
    """How the placement search runs."""

    algorithm: Literal["auto", "high-affinity", "low-affinity"] = Field(
        default="auto",
        description="auto follows cluster.nodeAffinity; high-affinity is Algorithm 1, "
        "low-affinity Algorithm 2.",
    )
    latency_model: Literal["auto", "profile", "analytic"] = Field(
        default="auto",
        description="profile: measured tables; analytic: the roofline model; auto: the "
        "profile where it covers the model and GPU, the analytic model elsewhere.",
    )
    profile_path: str | None = Field(
        default=None, description="A latency profile file in the a100-opt-profile format."
    )
    max_nodes_per_instance: int | None = Field(
        default=None, ge=1, description="Most nodes one instance may span (default: all)."
    )
    max_gpus: int | None = Field(
        default=None, ge=1, description="Most GPUs the plan may take (default: the whole "
        "cluster); a rate that needs more gets the best plan within them."
    )
    num_requests: int = Field(
        default=400, ge=50, le=100000, description="Requests simulated per trial."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the sampled workloads.")
    max_prefill_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Lm: prefill batches are filled up to this many tokens (default: the "
        "length that saturates the GPU).",
    )
    max_decode_batch: int = Field(
        default=256, ge=1, description="Most sequences in one decode batch."
    )
    chunk_size: int = Field(
        default=512, ge=16, description="Chunk size of the chunked-prefill baseline."
    )
    workers: int | None = Field(
        default=None, ge=1, description="Processes for the search (default: all cores)."
    )


class PhasePlacement(SpecModel):
    """Parallelism and replica count of one phase."""

    tp: int = Field(default=1, ge=1, le=64, description="Tensor-parallel degree.")
    pp: int = Field(default=1, ge=1, le=64, description="Pipeline-parallel degree.")
    instances: int = Field(default=1, ge=1, le=1024, description="Number of instances.")


class PlacementSpec(SpecModel):
    """A fixed placement that skips the search."""

    prefill: PhasePlacement = Field(description="Prefill instances.")
    decode: PhasePlacement = Field(description="Decode instances.")


class EngineSpec(PodOptions):
    """How the engine pods run; the pod options here are the default of every role."""

    image: str = Field(default=DEFAULT_ENGINE_IMAGE, description="Engine container image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of the engine pods."
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        default="auto", description="Where the engine runs; auto: CUDA when present."
    )
    block_size: int = Field(default=16, ge=1, le=256, description="KV cache block size.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port of the OpenAI API.")
    router_replicas: int = Field(default=1, ge=1, le=32, description="Router pods.")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Type of the Service in front of the router."
    )
    shm_size: str | None = Field(
        default=None, description="Size of each engine pod's /dev/shm (a memory-backed "
        "emptyDir), e.g. 4Gi; default: the KV transfer arena plus 1Gi per GPU.")
    prefill: PodOptions | None = Field(default=None, description="Prefill pods: over the defaults.")
    decode: PodOptions | None = Field(default=None, description="Decode pods: over the defaults.")
    router: PodOptions | None = Field(default=None, description="Router pods: over the defaults.")
    gang_scheduling: GangScheduling = Field(
        default_factory=GangScheduling, description="All-or-nothing scheduling of an "
        "instance's pods.")

    @field_validator("shm_size")
    @classmethod
    def _shm_size(cls, value: str | None) -> str | None:
        if value is not None and not is_quantity(value):
            raise ValueError(f"expected a size such as 4Gi, got {value!r}")
        return value

    @model_validator(mode="after")
    def _roles_mount_known_volumes(self) -> EngineSpec:
        for role in ROLES:
            merge_options(self, getattr(self, role))
        return self

    def options_for(self, role: str) -> PodOptions:
        """The pod options of a role: its own over the defaults on `engine`."""
        return merge_options(self, getattr(self, role))


class DistServeDeploymentSpec(SpecModel):
    """What a user asks for: a model served within two SLOs on a cluster."""

    model: ModelSpec = Field(description="The model to serve.")
    slo: SLOSpec = Field(description="Latency objectives.")
    workload: WorkloadSpec = Field(
        default_factory=WorkloadSpec, description="Traffic to plan for."
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="GPUs to use.")
    planner: PlannerSpec = Field(
        default_factory=PlannerSpec, description="Placement search options."
    )
    placement: PlacementSpec | None = Field(
        default=None, description="A fixed placement; when set the search is skipped."
    )
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine pod options.")
    router: RouterSpec = Field(default_factory=RouterSpec,
                               description="The router's API keys and admission.")
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="Who may reach the pods.")
    auto_apply: bool = Field(
        default=True,
        description="Apply a new plan at once; false: wait for the annotation "
        "distserve.io/approved-plan to name the plan's id.",
    )
    replanning: ReplanningSpec | None = Field(
        default=None,
        description="Replan from the traffic Prometheus observes (a replan waits for "
        "approval too when autoApply is false). Unset: the plan changes with the spec only.",
    )


class ObjectMeta(SpecModel):
    """The part of Kubernetes metadata that the spec file carries."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class DistServeDeployment(SpecModel):
    """The whole manifest, as `kubectl apply -f` and `distserve plan -f` read it."""

    api_version: Literal["distserve.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["DistServeDeployment"]
    metadata: ObjectMeta
    spec: DistServeDeploymentSpec


def _format_error(err: dict[str, Any], prefix: str) -> str:
    """One line per problem: the dotted camelCase path, what was wrong, the value."""
    loc = ".".join(str(part) for part in (prefix, *err["loc"]) if part != "")
    value = err.get("input")
    shown = "" if isinstance(value, dict) or value is None else f" (got {value!r})"
    return f"{loc}: {err['msg']}{shown}"


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """Turn pydantic's report into lines that name each field and the expected value."""
    return "\n".join(_format_error(e, prefix) for e in exc.errors(include_url=False))


def parse_spec(spec: dict[str, Any]) -> DistServeDeploymentSpec:
    """Validate the `spec` part of a resource (as the operator receives it)."""
    try:
        return DistServeDeploymentSpec.model_validate(spec)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, "spec")) from None


def parse_manifest(doc: dict[str, Any]) -> DistServeDeployment:
    """Validate a whole DistServeDeployment manifest."""
    if not isinstance(doc, dict):
        raise SpecError(f"manifest: expected a mapping, got {type(doc).__name__}")
    try:
        return DistServeDeployment.model_validate(doc)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc)) from None


def load_manifest(path: str | Path) -> DistServeDeployment:
    """Read the DistServeDeployment from a YAML file (the first document of that kind)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such file")
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == KIND:
            try:
                manifest = parse_manifest(doc)
            except SpecError as exc:
                raise SpecError(f"{path}:\n{exc}") from None
            _resolve_local_paths(manifest.spec, path.parent)
            return manifest
    raise SpecError(f"{path}: no document of kind {KIND}")


def _resolve_local_paths(spec: DistServeDeploymentSpec, folder: Path) -> None:
    """Read the files a spec names (trace, profile, weights) from the spec file's folder
    when their paths are relative, so a spec means the same from any working directory."""
    for part, name in (
        (spec.workload, "trace_path"),
        (spec.planner, "profile_path"),
        (spec.model, "path"),
    ):
        value = getattr(part, name)
        if value and not Path(value).is_absolute():
            setattr(part, name, str((folder / value).resolve()))
