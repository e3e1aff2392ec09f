"""Which GPUs of which node each instance segment takes.

Under low node affinity (Algorithm 2) a unit's instances are cut into node-level
segments, and all segments of the same stage (prefill and decode) go on one node, so
KV moves over that node's link. Otherwise an instance stays on one node when it fits
there, and its stages spread over nodes only when it does not. Nodes are filled in
order (first fit), which leaves whole nodes free for later replicas. Copies of a
second unit shape go into the GPUs the first shape's copies left free (a mixed plan);
their instances are numbered after the first shape's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from distserve.plan import PhaseConfig, SegmentPlacement
from distserve.search.trials import Config, Unit


class ClusterTooSmall(ValueError):
    """The placement needs more GPUs (or a larger node) than the cluster has."""


class _Nodes:
    """Free GPU indices per node (all but those `taken`, node name -> GPU ids)."""

    def __init__(self, node_names: list[str], gpus_per_node: int,
                 taken: Mapping[str, Iterable[int]] | None = None) -> None:
        self.names = node_names
        self.gpus_per_node = gpus_per_node
        self.free = []
        for name in node_names:
            held = set((taken or {}).get(name, ()))
            self.free.append([g for g in range(gpus_per_node) if g not in held])

    def node_with(self, count: int, avoid: set[int] = frozenset()) -> int:
        """The first node with count free GPUs, preferring nodes not in avoid."""
        for pass_avoid in (True, False):
            for i, free in enumerate(self.free):
                if len(free) >= count and not (pass_avoid and i in avoid):
                    return i
        raise ClusterTooSmall(
            f"no node has {count} free GPUs (cluster: {len(self.names)} nodes x "
            f"{self.gpus_per_node} GPUs, {sum(map(len, self.free))} left free)"
        )

    def take(self, node: int, count: int) -> tuple[int, ...]:
        taken, self.free[node] = self.free[node][:count], self.free[node][count:]
        return tuple(taken)

    def can_hold(self, count: int, num_nodes: int) -> bool:
        """Whether num_nodes distinct nodes have count free GPUs each."""
        return sum(len(free) >= count for free in self.free) >= num_nodes


# (unit, inter_op, copies): copies of one Algorithm 2 unit shape of inter_op node stages
Shape = tuple[Unit, int, int]


def gpus_per_node_of(unit: Unit, inter_op: int) -> int:
    """GPUs one copy of the unit takes on each of its inter_op nodes."""
    return unit.num_gpus // inter_op


def place_units(
    node_names: list[str], gpus_per_node: int, unit: Unit, inter_op: int, num_units: int
) -> tuple[SegmentPlacement, ...]:
    """Segments for num_units replicas of an Algorithm 2 unit of inter_op node stages."""
    return place_shapes(node_names, gpus_per_node, [(unit, inter_op, num_units)])


def place_shapes(
    node_names: list[str], gpus_per_node: int, shapes: Sequence[Shape],
    taken: Mapping[str, Iterable[int]] | None = None, first: Mapping[str, int] | None = None,
) -> tuple[SegmentPlacement, ...]:
    """Segments for copies of one or more unit shapes, placed in order, first fit; with
    `taken`, on the GPUs those leave free, and their instances numbered from `first`
    (role -> index) where others already hold the indices before."""
    nodes = _Nodes(node_names, gpus_per_node, taken)
    role_to_first = {"prefill": 0, "decode": 0, **(first or {})}
    segments: list[SegmentPlacement] = []
    for unit, inter_op, copies in shapes:
        for _ in range(copies):
            segments += _place_copy(nodes, unit, inter_op, role_to_first)
    return tuple(segments)


def copies_that_fit(
    node_names: list[str], gpus_per_node: int, placed: Sequence[Shape], unit: Unit,
    inter_op: int, limit: int,
) -> int:
    """How many copies of unit (at most limit) fit beside the shapes already placed."""
    nodes = _Nodes(node_names, gpus_per_node)
    role_to_first = {"prefill": 0, "decode": 0}
    for placed_unit, placed_inter_op, copies in placed:
        for _ in range(copies):
            _place_copy(nodes, placed_unit, placed_inter_op, role_to_first)
    per_node = gpus_per_node_of(unit, inter_op)
    count = 0
    while count < limit and nodes.can_hold(per_node, inter_op):
        _place_copy(nodes, unit, inter_op, role_to_first)
        count += 1
    return count


def _place_copy(
    nodes: _Nodes, unit: Unit, inter_op: int, role_to_first: dict[str, int]
) -> list[SegmentPlacement]:
    """One copy's segments: its stage s on its s-th node, all on distinct nodes; its
    instances numbered from role_to_first (advanced past them)."""
    (tp_p, pp_p), (tp_d, pp_d) = unit.prefill, unit.decode
    local_p, local_d = pp_p // inter_op, pp_d // inter_op
    per_node = gpus_per_node_of(unit, inter_op)
    segments = []
    used: set[int] = set()
    for s in range(inter_op):
        node = nodes.node_with(per_node, used)
        used.add(node)
        for role, n, tp, local in (
            ("prefill", unit.n_prefill, tp_p, local_p), ("decode", unit.n_decode, tp_d, local_d)
        ):
            for i in range(n):
                for j in range(local):
                    segments.append(SegmentPlacement(
                        role, role_to_first[role] + i, s * local + j, nodes.names[node],
                        nodes.take(node, tp),
                    ))
    role_to_first["prefill"] += unit.n_prefill
    role_to_first["decode"] += unit.n_decode
    return segments


def place_instances(
    node_names: list[str], gpus_per_node: int, prefill: PhaseConfig, decode: PhaseConfig,
    taken: Mapping[str, Iterable[int]] | None = None, first: Mapping[str, int] | None = None,
) -> tuple[SegmentPlacement, ...]:
    """Segments for instances placed anywhere (Algorithm 1, a fixed placement); with
    `taken` and `first`, as `place_shapes` takes them."""
    nodes = _Nodes(node_names, gpus_per_node, taken)
    first = first or {}
    segments = []
    for role, phase in (("prefill", prefill), ("decode", decode)):
        if phase.tp > gpus_per_node:
            raise ClusterTooSmall(f"{role} tp={phase.tp} exceeds the {gpus_per_node} GPUs of a node")
        for i in range(first.get(role, 0), first.get(role, 0) + phase.instances):
            whole = phase.gpus_per_instance <= gpus_per_node
            node = nodes.node_with(phase.gpus_per_instance) if whole else None
            for stage in range(phase.pp):
                where = node if whole else nodes.node_with(phase.tp)
                segments.append(SegmentPlacement(
                    role, i, stage, node_names[where], nodes.take(where, phase.tp)
                ))
    return tuple(segments)


def pair_links(
    segments: tuple[SegmentPlacement, ...], intra_bytes_per_s: float, inter_bytes_per_s: float
) -> list[list[float]]:
    """[prefill][decode] link bandwidth: the node's link when every stage of the prefill
    instance shares a node with the decode instance's matching stage, else the network."""
    def nodes_of(role: str) -> dict[int, list[str]]:
        found: dict[int, dict[int, str]] = {}
        for s in segments:
            if s.role == role:
                found.setdefault(s.instance, {})[s.stage] = s.node
        return {i: [stages[k] for k in sorted(stages)] for i, stages in sorted(found.items())}

    prefill, decode = nodes_of("prefill"), nodes_of("decode")
    links = []
    for p_nodes in prefill.values():
        row = []
        for d_nodes in decode.values():
            same = _aligned(p_nodes, d_nodes)
            row.append(intra_bytes_per_s if same else inter_bytes_per_s)
        links.append(row)
    return links


def _aligned(p_nodes: list[str], d_nodes: list[str]) -> bool:
    """Whether each layer's prefill and decode stages sit on the same node."""
    if len(set(p_nodes)) == 1 and set(p_nodes) == set(d_nodes):
        return True
    n = max(len(p_nodes), len(d_nodes))
    if n % len(p_nodes) or n % len(d_nodes):
        return False
    return all(p_nodes[k * len(p_nodes) // n] == d_nodes[k * len(d_nodes) // n] for k in range(n))


def place_fixed(
    node_names: list[str], gpus_per_node: int, prefill: PhaseConfig, decode: PhaseConfig,
    is_low_affinity: bool,
) -> tuple[SegmentPlacement, ...]:
    """Segments for a placement given by the user. Under low node affinity all its
    instances are laid out as one Algorithm 2 unit (matching stages share a node) with
    the fewest node-level segments that fit; otherwise, or when no such layout fits,
    instances go anywhere."""
    if is_low_affinity:
        common = math.gcd(prefill.pp, decode.pp)
        for k in (k for k in range(1, min(common, len(node_names)) + 1) if common % k == 0):
            unit = Unit(Config(prefill.tp, prefill.pp), Config(decode.tp, decode.pp),
                        prefill.instances, decode.instances, 0.0)
            per_node = (prefill.num_gpus + decode.num_gpus) // k
            if per_node <= gpus_per_node:
                return place_units(node_names, gpus_per_node, unit, k, 1)
    return place_instances(node_names, gpus_per_node, prefill, decode)
