"""Which parallel configurations an instance may take on this cluster.

A configuration (tp, pp) is allowed when tp divides the attention heads and the KV
heads, the latency source times tp (a profiled model only at its profiled degrees,
`distserve.latency.choose_source`), pp divides the layers (NOTE: stages are always even; uneven stages are not
considered), tp fits in one node, and the weights leave room in memory for the KV of
the longest request the workload holds. Under low node affinity (Algorithm 2) an
instance's pp stages are split into `inter_op` node-level segments, each segment
holding pp / inter_op stages of tp GPUs on one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from distserve.catalog import ModelArch
from distserve.latency import SourceChoice, kv_capacity_tokens


class Config(NamedTuple):
    """One instance's parallelism (or, under Algorithm 2, one node-level segment's: tp and
    the pipeline stages on that node)."""

    tp: int  # tensor-parallel degree: GPUs per stage
    pp: int  # pipeline stages

    @property
    def num_gpus(self) -> int:
        """GPUs it takes."""
        return self.tp * self.pp


@dataclass(frozen=True)
class ClusterShape:
    """The GPUs the search may place on."""

    num_nodes: int
    gpus_per_node: int
    max_nodes_per_instance: int

    @property
    def num_gpus(self) -> int:
        """GPUs in the cluster."""
        return self.num_nodes * self.gpus_per_node


def tp_degrees(model: ModelArch, max_tp: int, latency: SourceChoice) -> list[int]:
    """Tensor-parallel degrees that split the heads and the KV heads evenly and that
    the latency source may time."""
    return [
        tp for tp in range(1, max_tp + 1)
        if model.num_heads % tp == 0 and model.num_kv_heads % tp == 0 and latency.allows(tp)
    ]


def pp_degrees(model: ModelArch, max_pp: int) -> list[int]:
    """Pipeline degrees that split the layers evenly."""
    return [pp for pp in range(1, max_pp + 1) if model.num_layers % pp == 0]


def fits(
    model: ModelArch, accelerator: str, config: Config, min_kv_tokens: int,
    profile_path: str | None = None,
) -> bool:
    """Whether weights fit with KV room for min_kv_tokens tokens (measured capacity from
    the profile at profile_path where it has the point, as the trials use)."""
    capacity = kv_capacity_tokens(model, accelerator, *config, profile_path=profile_path)
    return capacity >= min_kv_tokens


def instance_configs(
    model: ModelArch, accelerator: str, cluster: ClusterShape, min_kv_tokens: int,
    latency: SourceChoice, profile_path: str | None = None,
) -> list[Config]:
    """Configurations for Algorithm 1 (and the baselines): anywhere in the cluster."""
    max_gpus = cluster.gpus_per_node * min(cluster.max_nodes_per_instance, cluster.num_nodes)
    return [
        Config(tp, pp)
        for tp in tp_degrees(model, cluster.gpus_per_node, latency)
        for pp in pp_degrees(model, max_gpus // tp)
        if fits(model, accelerator, Config(tp, pp), min_kv_tokens, profile_path)
    ]


def segment_configs(
    model: ModelArch, accelerator: str, cluster: ClusterShape, inter_op: int, min_kv_tokens: int,
    latency: SourceChoice, profile_path: str | None = None,
) -> list[Config]:
    """Algorithm 2's get_intra_node_configs: (tp, stages per node) of a segment that
    leaves at least one GPU of the node for the other phase."""
    room = cluster.gpus_per_node - 1
    found = []
    for tp in tp_degrees(model, room, latency):
        for local_pp in range(1, room // tp + 1):
            pp = inter_op * local_pp
            if model.num_layers % pp == 0 and fits(
                model, accelerator, Config(tp, pp), min_kv_tokens, profile_path
            ):
                found.append(Config(tp, local_pp))
    return found
