"""From a resource's spec to a plan: validate, read the cluster, search off the event loop.

The search takes seconds of CPU; it runs in a worker thread so the operator keeps
serving other resources, watch streams and health probes meanwhile. A spec the
schema accepted can still make no sense (a model that fits no GPU, SLOs no placement
meets, a cluster with no GPU node): those come back as `Unplannable` with a reason a
user can act on, never as a crash.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from distserve import spec as specs
from distserve.k8s import nodes
from distserve.k8s.client import ApiClient, ApiError
from distserve.plan import Plan


class Unplannable(ValueError):
    """No plan for this spec; `reason` is the condition's reason, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Planned:
    """A plan with the spec it was made for (cluster shape filled in)."""

    plan: Plan
    spec: specs.DistServeDeploymentSpec
    known_nodes: frozenset[str]  # the cluster's Node names, for hard node affinity


def parse(spec: dict[str, Any]) -> specs.DistServeDeploymentSpec:
    """The typed spec; Unplannable("InvalidSpec") naming the fields otherwise."""
    try:
        return specs.parse_spec(dict(spec))
    except specs.SpecError as exc:
        raise Unplannable("InvalidSpec", str(exc)) from None


async def read_nodes(api: ApiClient) -> list[dict[str, Any]] | None:
    """The Node objects, or None when the operator may not read them."""
    try:
        return await api.list("Node")
    except ApiError as exc:
        if exc.status in (403, 404):
            return None
        raise


async def shape_spec(
    api: ApiClient, spec: specs.DistServeDeploymentSpec,
    found: list[dict[str, Any]] | None = None,
) -> tuple[specs.DistServeDeploymentSpec, frozenset[str]]:
    """The spec with its cluster shape completed from the Nodes (`found`, else read now),
    and the Node names."""
    if found is None:
        found = await read_nodes(api) or []
    known = frozenset(n["metadata"]["name"] for n in found)
    if not nodes.needs_nodes(spec):
        return spec, known
    shape = nodes.cluster_shape(found, is_cpu=nodes.is_cpu_spec(spec))
    if not shape.node_names or shape.gpus_per_node < 1:
        what = "Ready node" if nodes.is_cpu_spec(spec) else f"Ready node offering {nodes.GPU_RESOURCE}"
        raise Unplannable(
            "NoNodes", f"no {what} found and spec.cluster does not give nodes and gpusPerNode"
        )
    return nodes.fill_cluster(spec, shape), known


def search(spec: specs.DistServeDeploymentSpec) -> Plan:
    """The placement search (blocking); Unplannable when nothing fits or meets the SLOs."""
    from distserve import search as searching  # the search pulls the simulator in

    cluster = spec.cluster
    try:
        return searching.plan_deployment(
            spec, node_names=cluster.node_names, gpus_per_node=cluster.gpus_per_node
        )
    except searching.NoFeasiblePlan as exc:
        raise Unplannable("NoFeasiblePlan", str(exc)) from None
    except (ValueError, KeyError) as exc:  # an unknown model or accelerator
        raise Unplannable("InvalidSpec", str(exc)) from None


async def make_plan(api: ApiClient, raw_spec: dict[str, Any]) -> Planned:
    """Validate, read the cluster, and search in a worker thread."""
    spec = parse(raw_spec)
    spec, known = await shape_spec(api, spec)
    plan = await asyncio.to_thread(search, spec)
    return Planned(plan, spec, known)
