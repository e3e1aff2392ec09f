"""The cluster's shape (nodes, GPUs per node, GPU type), read from the Node objects.

A user may state the shape in `spec.cluster`; whatever is left unset is read here.
Only Ready, schedulable nodes that offer GPUs count (every Ready, schedulable node when
the accelerator is the CPU). The GPU type comes from the label that NVIDIA's GPU
feature discovery puts on each node.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from distserve import spec as specs
from distserve.catalog.accelerators import get_accelerator

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# Substrings of the gpu.product label (e.g. NVIDIA-A100-SXM4-80GB) and the catalog name.
_PRODUCT_TO_ACCELERATOR = (
    ("H200", "H200-141GB"),
    ("H100", "H100-80GB"),
    ("A100", "A100-80GB"),
    ("L40S", "L40S"),
)


@dataclass(frozen=True)
class ClusterShape:
    """What the placement search may use."""

    node_names: tuple[str, ...]
    gpus_per_node: int
    accelerator: str | None  # catalog name; None when no node says


def accelerator_of_product(product: str) -> str | None:
    """The catalog accelerator of a gpu.product label, or None when unknown."""
    try:
        return get_accelerator(product).name
    except ValueError:
        pass
    upper = product.upper()
    return next((name for key, name in _PRODUCT_TO_ACCELERATOR if key in upper), None)


def node_gpus(node: dict[str, Any]) -> int:
    """GPUs a node offers to pods (allocatable, not capacity)."""
    allocatable = node.get("status", {}).get("allocatable", {}) or {}
    try:
        return int(allocatable.get(GPU_RESOURCE, 0))
    except (TypeError, ValueError):
        return 0


def pod_gpus(pod: dict[str, Any]) -> int:
    """GPUs a pod holds: its containers' requests (or limits, which extended resources
    must equal), or its largest init container's when that is more."""
    spec = pod.get("spec") or {}

    def of(container: dict[str, Any]) -> int:
        resources = container.get("resources") or {}
        value = (resources.get("requests") or {}).get(GPU_RESOURCE) \
            or (resources.get("limits") or {}).get(GPU_RESOURCE) or 0
        try:
            return int(value)
        except (TypeError, ValueError):
            return 0
    running = sum(of(c) for c in spec.get("containers") or [])
    return max([running, *(of(c) for c in spec.get("initContainers") or [])])


def free_gpus(nodes: list[dict[str, Any]], pods: list[dict[str, Any]],
              is_ours: Any) -> dict[str, int]:
    """Node -> GPUs the deployment may use: allocatable minus what every other pod bound
    to the node holds (pods that ended hold nothing). `is_ours(pod)` picks our own pods."""
    node_to_free = {n["metadata"]["name"]: node_gpus(n) for n in nodes}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if node not in node_to_free or phase in ("Succeeded", "Failed") or is_ours(pod):
            continue
        node_to_free[node] -= pod_gpus(pod)
    return {name: max(0, gpus) for name, gpus in node_to_free.items()}


def is_usable(node: dict[str, Any]) -> bool:
    """Ready and not cordoned. A node with no conditions reported counts as Ready."""
    if node.get("spec", {}).get("unschedulable"):
        return False
    conditions = node.get("status", {}).get("conditions") or []
    ready = [c for c in conditions if c.get("type") == "Ready"]
    return not ready or ready[0].get("status") == "True"


def cluster_shape(nodes: list[dict[str, Any]], *, is_cpu: bool) -> ClusterShape:
    """The shape of the usable nodes; GPUs per node is the most common count among them."""
    usable = [n for n in nodes if is_usable(n)]
    if not is_cpu:
        usable = [n for n in usable if node_gpus(n) > 0]
    names = tuple(sorted(n["metadata"]["name"] for n in usable))
    if is_cpu:
        return ClusterShape(names, 1, "CPU")
    counts = Counter(node_gpus(n) for n in usable)
    gpus = counts.most_common(1)[0][0] if counts else 0
    products = Counter(
        n["metadata"].get("labels", {}).get(GPU_PRODUCT_LABEL, "") for n in usable
    )
    product = products.most_common(1)[0][0] if products else ""
    return ClusterShape(names, gpus, accelerator_of_product(product) if product else None)


def node_problems(plan_nodes: set[str], nodes: list[dict[str, Any]], *, is_cpu: bool) -> list[str]:
    """Why the cluster cannot run a plan now: no usable node at all, or a node the plan
    placed on that is not Ready, cordoned or without GPUs. Plan nodes that are not Node
    names (the spec counted nodes without naming them) are judged by the first only."""
    problems = []
    if not cluster_shape(nodes, is_cpu=is_cpu).node_names:
        what = "Ready node" if is_cpu else f"Ready node offering {GPU_RESOURCE}"
        problems.append(f"no {what} in the cluster")
    name_to_node = {n["metadata"]["name"]: n for n in nodes}
    for name in sorted(plan_nodes & set(name_to_node)):
        node = name_to_node[name]
        if node.get("spec", {}).get("unschedulable"):
            problems.append(f"node {name} cordoned")
        elif not is_usable(node):
            problems.append(f"node {name} not Ready")
        elif not is_cpu and node_gpus(node) == 0:
            problems.append(f"node {name} offers no {GPU_RESOURCE}")
    return problems


def is_cpu_spec(spec: specs.DistServeDeploymentSpec) -> bool:
    """Whether the pods run on the CPU (no GPU requests)."""
    return spec.cluster.accelerator.upper() == "CPU" or spec.engine.device == "cpu"


def needs_nodes(spec: specs.DistServeDeploymentSpec) -> bool:
    """Whether the spec leaves part of the cluster shape to be read from the Nodes."""
    cluster = spec.cluster
    return cluster.nodes is None or cluster.gpus_per_node is None


def fill_cluster(
    spec: specs.DistServeDeploymentSpec, shape: ClusterShape
) -> specs.DistServeDeploymentSpec:
    """The spec with the unset parts of `spec.cluster` taken from the shape."""
    cluster = spec.cluster
    given = cluster.model_fields_set
    update: dict[str, Any] = {}
    if cluster.nodes is None:
        update["nodes"] = max(1, len(shape.node_names))
        if cluster.node_names is None and shape.node_names:
            update["node_names"] = list(shape.node_names)
    if cluster.gpus_per_node is None:
        update["gpus_per_node"] = max(1, shape.gpus_per_node)
    if "accelerator" not in given and shape.accelerator:
        update["accelerator"] = shape.accelerator
    return spec.model_copy(update={"cluster": cluster.model_copy(update=update)})
