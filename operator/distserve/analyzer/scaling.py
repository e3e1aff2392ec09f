"""Copies of a plan's shape, and what moving from one plan to another changes.

A plan's shape is its parallelism (tp, pp per phase) and its prefill:decode ratio; its
size is the number of copies of the smallest unit with that ratio. Replica-only
autoscaling changes the size; a replan may also change the ratio or the parallelism.
`change_kind` names which, and `started_gpus` counts the GPUs whose instances must
load weights (and serve nothing meanwhile) to get from one plan to the other.
`placed_beside` puts a new plan's instances on the nodes the current plan leaves free,
so that the reshuffle starts them beside the instances that serve instead of draining
those first; `dark_phases` says which phases the reshuffle (`k8s.reshuffling`, the
operator's own step planner) would leave with no instance serving while a replacement
loads its weights, and `reshuffle_loadings` how many loadings it runs one after another
(both from `reshuffle_steps`, the steps with when each may begin); `move_pieces`
what serves from one loading to the next while it runs.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Literal

from distserve.k8s.reshuffling import (
    ROLES,
    Instance,
    ReshuffleError,
    Step,
    plan_reshuffle,
    serving_counts,
)
from distserve.plan import PhaseConfig, Plan, SegmentPlacement
from distserve.search.candidates import Config
from distserve.search.placement import place_instances, place_shapes
from distserve.search.trials import Unit

ChangeKind = Literal["replicas", "ratio", "parallelism"]


def copy_unit(plan: Plan, link_bytes_per_s: float) -> Unit:
    """The smallest unit with the plan's parallelism and prefill:decode ratio."""
    common = math.gcd(plan.prefill.instances, plan.decode.instances) or 1
    return Unit(
        Config(plan.prefill.tp, plan.prefill.pp), Config(plan.decode.tp, plan.decode.pp),
        plan.prefill.instances // common, plan.decode.instances // common, link_bytes_per_s,
    )


def nodes_per_instance(plan: Plan) -> int:
    """Nodes the plan's first prefill instance spans (Algorithm 2's inter_op)."""
    return len({s.node for s in plan.segments_of("prefill", 0)}) or 1


def place_copies(
    plan: Plan, unit: Unit, copies: int, node_names: list[str], gpus_per_node: int
) -> Plan:
    """The plan with `copies` of unit placed anew (ClusterTooSmall when they do not fit):
    those copies only, a mixed plan's groups of other shapes left out."""
    return replace(plan, prefill=PhaseConfig(*unit.prefill, unit.n_prefill * copies),
                   decode=PhaseConfig(*unit.decode, unit.n_decode * copies),
                   segments=_copy_segments(plan, unit, copies, node_names, gpus_per_node),
                   baselines={}, extra_prefill=(), extra_decode=())


def copies_in_place(
    plan: Plan, unit: Unit, copies: int, node_names: list[str], gpus_per_node: int
) -> Plan | None:
    """The plan with `copies` of unit where the copies it runs stay where they serve: the
    first `copies` of them kept, or all of them and the rest placed on the GPUs they
    leave free, as a replica autoscaler adds and removes pods without moving the others
    (ClusterTooSmall when the rest do not fit there). None when the plan is not whole
    copies of unit (a mixed plan, another shape)."""
    counts = {"prefill": unit.n_prefill, "decode": unit.n_decode}
    if plan.is_mixed or not unit.n_prefill or not unit.n_decode:
        return None
    have = plan.prefill.instances // unit.n_prefill
    same_shape = ((plan.prefill.tp, plan.prefill.pp), (plan.decode.tp, plan.decode.pp)) == (
        tuple(unit.prefill), tuple(unit.decode))
    if not same_shape or any(getattr(plan, role).instances != have * n
                             for role, n in counts.items()):
        return None
    if copies <= have:
        segments = tuple(s for s in plan.segments if s.instance < copies * counts[s.role])
    else:
        first = {role: have * n for role, n in counts.items()}
        segments = plan.segments + _copy_segments(plan, unit, copies - have, node_names,
                                                  gpus_per_node, taken_gpus(plan), first)
    return replace(plan, prefill=PhaseConfig(*unit.prefill, unit.n_prefill * copies),
                   decode=PhaseConfig(*unit.decode, unit.n_decode * copies),
                   segments=segments, baselines={})


def _copy_segments(
    plan: Plan, unit: Unit, copies: int, node_names: list[str], gpus_per_node: int,
    taken: dict[str, set[int]] | None = None, first: dict[str, int] | None = None,
) -> tuple[SegmentPlacement, ...]:
    """Segments for `copies` of unit placed as the plan's algorithm places them, on the
    GPUs `taken` leaves free, instances numbered from `first` (`place_shapes`)."""
    if plan.algorithm == "low-affinity":
        return place_shapes(node_names, gpus_per_node,
                            [(unit, nodes_per_instance(plan), copies)], taken, first)
    return place_instances(node_names, gpus_per_node,
                           PhaseConfig(*unit.prefill, unit.n_prefill * copies),
                           PhaseConfig(*unit.decode, unit.n_decode * copies), taken, first)


def placed_beside(current: Plan, new: Plan, node_names: list[str], gpus_per_node: int) -> Plan:
    """`new` with its nodes renamed so that its instances sit where `current` leaves GPUs
    free: the node new fills most goes to the node current leaves freest, and so on (the
    nodes are alike, so its predicted figures do not change), and on each node its GPU
    ids are the ones current leaves free. Unchanged when the two share an instance in
    place (the reshuffle keeps those), or when renaming frees no more room for new's
    instances than new's own nodes have."""
    def keys(plan: Plan) -> set[tuple]:
        return {instance.key for instance in plan_instances(plan, "")}

    if keys(current) & keys(new):
        return new
    free = free_beside(current, node_names, gpus_per_node)
    taken_ids = taken_gpus(current)
    wanted: Counter = Counter()
    for seg in new.segments:
        wanted[seg.node] += len(seg.gpu_ids)
    order = {node: k for k, node in enumerate(node_names)}
    sources = sorted(wanted, key=lambda n: (-wanted[n], order.get(n, len(order))))
    targets = sorted(node_names, key=lambda n: (-free[n], order[n]))[: len(sources)]
    if len(targets) < len(sources):
        return new

    def room(mapping: dict[str, str]) -> int:
        return sum(min(wanted[n], free.get(mapping[n], gpus_per_node)) for n in sources)

    mapping = dict(zip(sources, targets, strict=True))
    if room(mapping) <= room({n: n for n in sources}):
        return new
    free_ids = {t: iter(sorted(set(range(gpus_per_node)) - taken_ids.get(t, set()))) for t in targets}
    segments = []
    for seg in new.segments:
        node = mapping[seg.node]
        ids = tuple(next(free_ids[node], None) for _ in seg.gpu_ids)
        segments.append(replace(seg, node=node, gpu_ids=seg.gpu_ids if None in ids else ids))
    return replace(new, segments=tuple(segments))


def plan_instances(plan: Plan, revision: str) -> list[Instance]:
    """The plan's instances as the reshuffle compares them (role, parallelism, GPUs per stage)."""
    found = []
    for role in ROLES:
        for index in range(plan.num_instances(role)):
            phase = plan.phase_of(role, index)
            stages = tuple((s.node, tuple(s.gpu_ids)) for s in plan.segments_of(role, index))
            found.append(Instance(f"{role}-{index}-{revision}", revision, role, index,
                                  phase.tp, phase.pp, stages, "engine"))
    return found


def taken_gpus(plan: Plan) -> dict[str, set[int]]:
    """The GPU ids the plan's instances take on each node."""
    taken: dict[str, set[int]] = {}
    for seg in plan.segments:
        taken.setdefault(seg.node, set()).update(seg.gpu_ids)
    return taken


def free_beside(plan: Plan, node_names: list[str], gpus_per_node: int) -> dict[str, int]:
    """GPUs each node has free with the plan's instances in place."""
    taken = taken_gpus(plan)
    return {node: gpus_per_node - len(taken.get(node, ())) for node in node_names}


def reshuffle_steps(current: Plan, new: Plan, node_names: list[str],
                    gpus_per_node: int) -> tuple[list[Instance], list[tuple[Step, int]]]:
    """The old plan's instances, and the operator's reshuffle steps (`plan_reshuffle` on the
    GPUs current leaves free) from current to new, each with the weight loadings that
    must end before it may begin: instances created on free GPUs load together; a drain
    waits until every instance created before it serves, so each round of
    drain-then-start adds one loading. A created instance serves one loading after its
    step begins. ReshuffleError when no step order reaches new."""
    old = plan_instances(current, "old")
    steps = plan_reshuffle(old, plan_instances(new, "new"),
                           free_beside(current, node_names, gpus_per_node)).steps
    scheduled, started, ready = [], 0, 0  # loadings before the next step, and the last one's end
    for step in steps:
        if step.action == "drain":
            started = max(started, ready)
        scheduled.append((step, started))
        if step.action == "create":
            ready = max(ready, started + 1)
    return old, scheduled


def move_pieces(old: list[Instance], scheduled: list[tuple[Step, int]]
                ) -> list[tuple[int, tuple[Instance, ...]]]:
    """What serves while a reshuffle runs (`reshuffle_steps`: the old plan's instances and
    the scheduled steps): (from which weight loading on, the instances serving then), in
    order; the old instances until drained, the new ones from when their loading ends;
    the last piece is the new plan."""
    up = {step.instance.name: started + 1 for step, started in scheduled if step.action == "create"}
    down = {step.instance.name: started for step, started in scheduled if step.action == "drain"}
    created = [step.instance for step, _ in scheduled if step.action == "create"]
    pieces: list[tuple[int, tuple[Instance, ...]]] = []
    for moment in sorted({0, *up.values(), *down.values()}):
        serving = tuple([i for i in old if down.get(i.name, math.inf) > moment]
                        + [i for i in created if up[i.name] <= moment])
        if not pieces or serving != pieces[-1][1]:
            pieces.append((moment, serving))
    return pieces


def dark_phases(current: Plan, new: Plan, node_names: list[str], gpus_per_node: int) -> tuple[str, ...]:
    """The phases the reshuffle from current to new leaves with no instance serving for a
    weight loading (it drains a phase's last instance to make room for its replacement);
    both phases when no step order reaches new at all."""
    try:
        old, scheduled = reshuffle_steps(current, new, node_names, gpus_per_node)
    except ReshuffleError:
        return ROLES
    steps = tuple(step for step, _ in scheduled)
    dark = {role for step, counts in zip(steps, serving_counts(old, steps), strict=True)
            if step.action == "drain" for role in ROLES if counts[role] == 0}
    return tuple(role for role in ROLES if role in dark)


def reshuffle_loadings(current: Plan, new: Plan, node_names: list[str], gpus_per_node: int) -> int:
    """How many weight loadings the reshuffle from current to new runs one after another
    (`reshuffle_steps`; 0 when nothing starts, 1 when everything new fits beside the
    old): the move takes this many times the reload time. With no step order at all, one
    loading per new instance."""
    try:
        _, scheduled = reshuffle_steps(current, new, node_names, gpus_per_node)
    except ReshuffleError:
        return new.num_instances("prefill") + new.num_instances("decode")
    return max((started + 1 for step, started in scheduled if step.action == "create"), default=0)


def change_kind(current: Plan, new: Plan) -> ChangeKind | None:
    """What moving from current to new changes; None when the shapes and counts are equal."""
    same_configs = all(
        (getattr(current, role).tp, getattr(current, role).pp)
        == (getattr(new, role).tp, getattr(new, role).pp)
        for role in ("prefill", "decode")
    )
    if not same_configs:
        return "parallelism"
    old_p, old_d = current.prefill.instances, current.decode.instances
    new_p, new_d = new.prefill.instances, new.decode.instances
    if (old_p, old_d) == (new_p, new_d):
        return None
    return "replicas" if old_p * new_d == new_p * old_d else "ratio"


def started_gpus(current: Plan, new: Plan) -> int:
    """GPUs of the instances new starts that current does not run (same phase, tp and
    pp count as kept): they load weights before serving."""
    total = 0
    for role in ("prefill", "decode"):
        old, fresh = getattr(current, role), getattr(new, role)
        kept = old.instances if (old.tp, old.pp) == (fresh.tp, fresh.pp) else 0
        total += max(0, fresh.instances - kept) * fresh.gpus_per_instance
    return total


def ratio_text(plan: Plan) -> str:
    """The plan's shape in a few words, e.g. `2 x prefill tp2pp4 : 1 x decode tp4pp2`."""
    p, d = plan.prefill, plan.decode
    return f"{p.instances} x prefill tp{p.tp}pp{p.pp} : {d.instances} x decode tp{d.tp}pp{d.pp}"
