"""Small factories for the Kubernetes tests: plans, specs, owners, nodes."""

from __future__ import annotations

import dataclasses
from typing import Any

from distserve import spec as specs
from distserve.k8s import naming
from distserve.plan import BaselineResult, LatencyStats, PhaseConfig, Plan, SegmentPlacement

NODES = ("gpu-node-a", "gpu-node-b")


def make_spec(**overrides: Any) -> specs.DistServeDeploymentSpec:
    """An OPT-13B spec on 2 x 8 A100; overrides are camelCase spec fields."""
    doc: dict[str, Any] = {
        "model": {"name": "facebook/opt-13b"},
        "slo": {"ttftSeconds": 0.25, "tpotSeconds": 0.1},
        "cluster": {"nodes": 2, "gpusPerNode": 8, "accelerator": "A100-80GB"},
    }
    doc.update(overrides)
    return specs.parse_spec(doc)


def _low_affinity_segments(prefill: PhaseConfig, decode: PhaseConfig, nodes: tuple[str, ...]):
    """Algorithm 2: instance i's stage s of both phases on node (i + s) % len(nodes)."""
    segments = []
    for role, phase in (("prefill", prefill), ("decode", decode)):
        for i in range(phase.instances):
            for s in range(phase.pp):
                node = nodes[(i + s) % len(nodes)]
                first = 0 if role == "prefill" else prefill.tp
                gpus = tuple(range(first, first + phase.tp))
                segments.append(SegmentPlacement(role, i, s, node, gpus))
    return segments


def _high_affinity_segments(prefill: PhaseConfig, decode: PhaseConfig, nodes: tuple[str, ...]):
    """Algorithm 1: prefill instances on the first node, decode on the second."""
    segments = []
    for index, (role, phase) in enumerate((("prefill", prefill), ("decode", decode))):
        node = nodes[index % len(nodes)]
        for i in range(phase.instances):
            for s in range(phase.pp):
                first = (i * phase.pp + s) * phase.tp
                segments.append(SegmentPlacement(role, i, s, node, tuple(range(first, first + phase.tp))))
    return segments


def make_plan(
    algorithm: str = "low-affinity",
    prefill: tuple[int, int, int] = (2, 1, 1),
    decode: tuple[int, int, int] = (1, 1, 2),
    nodes: tuple[str, ...] = NODES,
    goodput_rps: float = 3.0,
) -> Plan:
    """A plan with (tp, pp, instances) per phase placed by the given algorithm's rule."""
    p, d = PhaseConfig(*prefill), PhaseConfig(*decode)
    place = _high_affinity_segments if algorithm == "high-affinity" else _low_affinity_segments
    return Plan(
        algorithm=algorithm,  # type: ignore[arg-type]
        model="facebook/opt-13b",
        accelerator="A100-80GB",
        prefill=p,
        decode=d,
        segments=tuple(place(p, d, nodes)),
        goodput_rps=goodput_rps,
        attainment=0.93,
        latency=LatencyStats(0.1, 0.2, 0.24, 0.03, 0.05, 0.08),
        ttft_slo_s=0.25,
        tpot_slo_s=0.1,
        attainment_target=0.9,
        search_seconds=1.5,
        baselines={"colocated": BaselineResult("colocated", 2, 1, 1, 2, 1.0, 0.5)},
    )


def make_mixed_plan() -> Plan:
    """A mixed plan on one node: prefill one tp2 instance then one tp1 pp2, decode two tp1."""
    segments = (
        SegmentPlacement("prefill", 0, 0, NODES[0], (0, 1)),
        SegmentPlacement("prefill", 1, 0, NODES[0], (2,)),
        SegmentPlacement("prefill", 1, 1, NODES[0], (3,)),
        SegmentPlacement("decode", 0, 0, NODES[0], (4,)),
        SegmentPlacement("decode", 1, 0, NODES[0], (5,)),
    )
    return dataclasses.replace(make_plan("high-affinity", (2, 1, 1), (1, 1, 2)),
                               segments=segments, extra_prefill=(PhaseConfig(1, 2, 1),))


def make_owner(name: str = "opt") -> naming.Owner:
    """The owning resource."""
    return naming.Owner(name, "serving", "uid-1234")


def make_revision(plan: Plan | None = None, spec: specs.DistServeDeploymentSpec | None = None,
                  name: str = "opt") -> naming.Revision:
    """A plan applied with a spec."""
    return naming.Revision(make_owner(name), plan or make_plan(), spec or make_spec())


def make_node(name: str, gpus: int = 8, product: str = "NVIDIA-A100-SXM4-80GB",
              ready: bool = True) -> dict[str, Any]:
    """A Node object as the API returns it."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                             "nvidia.com/gpu.product": product}},
        "status": {
            "allocatable": {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }
