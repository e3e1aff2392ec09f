"""The plan: what the placement search decided, as data that crosses planes.

A plan says how many prefill and decode instances to run, with which tensor and
pipeline parallelism, and which GPUs of which node each instance segment (one
pipeline stage of one instance) takes. A phase's instances come in groups of one
shape each: `prefill` and `decode` are the first groups; a mixed plan (copies of a
second unit shape filling the GPUs the first leaves free) has further groups in
`extra_prefill` and `extra_decode`, their instances numbered after the groups before
them. A plan sized for a rate the cluster (or the GPU budget) cannot serve is the
best that fits, and says by how much it falls short. The search produces it, `distserve plan`
prints it, the operator turns it into pods and writes it to the resource's status,
and the local launcher turns it into Ray actors. It travels as a JSON document
(`to_dict` / `from_dict`), never as an object.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class PhaseConfig:
    """Parallelism and replica count of one phase."""

    tp: int  # tensor-parallel degree: GPUs sharing each layer
    pp: int  # pipeline-parallel degree: stages of layers
    instances: int  # replicas of this configuration

    @property
    def gpus_per_instance(self) -> int:
        """GPUs one instance takes."""
        return self.tp * self.pp

    @property
    def num_gpus(self) -> int:
        """GPUs all instances of this phase take."""
        return self.gpus_per_instance * self.instances


def is_low_affinity(algorithm: str, node_affinity: str) -> bool:
    """Whether a plan keeps each stage's segments on one node and decode on its prefill's
    node (Algorithm 2; a fixed plan follows the spec's `cluster.nodeAffinity`)."""
    if algorithm == "fixed":
        return node_affinity == "low"
    return algorithm == "low-affinity"


@dataclass(frozen=True)
class SegmentPlacement:
    """One pipeline stage of one instance, pinned to GPUs of one node."""

    role: Role
    # the instance's index within its role (named `instance` in the plan's JSON and the
    # status, which the search writes and the operator reads back)
    instance: int
    stage: int  # pipeline stage, 0-based
    node: str  # Kubernetes node name (or a synthetic name like node-0)
    gpu_ids: tuple[int, ...]  # the node's GPU indices this segment takes (tp of them)


@dataclass(frozen=True)
class LatencyStats:
    """Predicted latency percentiles at the plan's goodput rate, in seconds."""

    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    tpot_p99_s: float


@dataclass(frozen=True)
class BaselineResult:
    """The best plan of a baseline engine on the same GPUs."""

    name: str  # "colocated" (vLLM-style) or "chunked_prefill" (Sarathi / DeepSpeed-MII)
    tp: int
    pp: int
    instances: int
    num_gpus: int
    goodput_rps: float
    per_gpu_goodput_rps: float
    chunk_size: int | None = None  # tokens per prefill chunk, chunked prefill only


@dataclass(frozen=True)
class Plan:
    """A chosen placement with its predicted performance."""

    algorithm: Literal["high-affinity", "low-affinity", "fixed"]
    model: str
    accelerator: str
    prefill: PhaseConfig
    decode: PhaseConfig
    segments: tuple[SegmentPlacement, ...]
    goodput_rps: float  # highest rate whose SLO attainment reaches the target
    attainment: float  # attainment measured at goodput_rps
    latency: LatencyStats | None
    ttft_slo_s: float
    tpot_slo_s: float
    attainment_target: float
    search_seconds: float = 0.0
    rate_rps: float | None = None  # the traffic the replica counts were sized for
    latency_source: str = ""  # which latency model timed the search, and why
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    # a mixed plan's further groups of other shapes (empty: one shape per phase)
    extra_prefill: tuple[PhaseConfig, ...] = ()
    extra_decode: tuple[PhaseConfig, ...] = ()
    # what bounds the plan's size where it matters: the cluster or the GPU budget that kept
    # it below rate_rps (or that a capacity plan fills); "" otherwise
    limited_by: str = ""

    def groups(self, role: Role) -> tuple[PhaseConfig, ...]:
        """The groups of one phase, in the order their instances are numbered."""
        if role == "prefill":
            return (self.prefill, *self.extra_prefill)
        return (self.decode, *self.extra_decode)

    def num_instances(self, role: Role) -> int:
        """Instances of one phase, all groups together."""
        return sum(group.instances for group in self.groups(role))

    def phase_of(self, role: Role, index: int) -> PhaseConfig:
        """The group (tp, pp and its size) that the role's `index`-th instance belongs to."""
        first = 0
        for group in self.groups(role):
            if index < first + group.instances:
                return group
            first += group.instances
        raise IndexError(f"{role} instance {index}: the plan has {first}")

    @property
    def is_mixed(self) -> bool:
        """Whether a phase has instances of more than one shape."""
        return bool(self.extra_prefill or self.extra_decode)

    @property
    def num_gpus(self) -> int:
        """GPUs the whole plan takes."""
        return sum(g.num_gpus for role in ROLES for g in self.groups(role))

    @property
    def shortfall_rps(self) -> float:
        """How much of rate_rps the plan cannot serve within the SLOs (0.0: none)."""
        if not self.rate_rps:
            return 0.0
        return max(0.0, self.rate_rps - self.goodput_rps)

    @property
    def per_gpu_goodput_rps(self) -> float:
        """Goodput divided by the GPUs it takes: the quantity the search maximises."""
        return self.goodput_rps / self.num_gpus if self.num_gpus else 0.0

    @property
    def plan_id(self) -> str:
        """A short stable id of the placement (not of the predictions), for approvals."""
        shape = {
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
            "segments": [asdict(s) for s in self.segments],
        }
        if self.is_mixed:  # plans of one shape per phase keep their ids
            shape["extra_prefill"] = [asdict(g) for g in self.extra_prefill]
            shape["extra_decode"] = [asdict(g) for g in self.extra_decode]
        digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()
        return digest[:10]

    def segments_of(self, role: Role, index: int) -> list[SegmentPlacement]:
        """The segments of the role's `index`-th instance, by stage."""
        found = [s for s in self.segments if s.role == role and s.instance == index]
        return sorted(found, key=lambda s: s.stage)

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-able document (the `--json` output and the CR status)."""
        doc = asdict(self)
        doc["segments"] = [
            {**asdict(s), "gpu_ids": list(s.gpu_ids)} for s in self.segments
        ]
        doc["extra_prefill"] = [asdict(g) for g in self.extra_prefill]
        doc["extra_decode"] = [asdict(g) for g in self.extra_decode]
        doc.update(
            id=self.plan_id,
            num_gpus=self.num_gpus,
            per_gpu_goodput_rps=self.per_gpu_goodput_rps,
            shortfall_rps=self.shortfall_rps,
        )
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Plan:
        """Rebuild a plan from `to_dict`'s document (derived keys are ignored)."""
        latency = doc.get("latency")
        return cls(
            algorithm=doc["algorithm"],
            model=doc["model"],
            accelerator=doc["accelerator"],
            prefill=PhaseConfig(**doc["prefill"]),
            decode=PhaseConfig(**doc["decode"]),
            segments=tuple(
                SegmentPlacement(**{**s, "gpu_ids": tuple(s["gpu_ids"])})
                for s in doc.get("segments", [])
            ),
            goodput_rps=float(doc["goodput_rps"]),
            attainment=float(doc["attainment"]),
            latency=LatencyStats(**latency) if latency else None,
            ttft_slo_s=float(doc["ttft_slo_s"]),
            tpot_slo_s=float(doc["tpot_slo_s"]),
            attainment_target=float(doc["attainment_target"]),
            search_seconds=float(doc.get("search_seconds", 0.0)),
            rate_rps=doc.get("rate_rps"),
            latency_source=doc.get("latency_source", ""),
            baselines={
                name: BaselineResult(**b) for name, b in doc.get("baselines", {}).items()
            },
            extra_prefill=tuple(PhaseConfig(**g) for g in doc.get("extra_prefill", ())),
            extra_decode=tuple(PhaseConfig(**g) for g in doc.get("extra_decode", ())),
            limited_by=doc.get("limited_by", ""),
        )
