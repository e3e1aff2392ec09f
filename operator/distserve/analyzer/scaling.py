"""Copies of a plan's shape, and what moving from one plan to another changes.

A plan's shape is its parallelism (tp, pp per phase) and its prefill:decode ratio; its
size is the number of copies of the smallest unit with that ratio. Replica-only
autoscaling changes the size; a replan may also change the ratio or the parallelism.
`change_kind` names which, and `started_gpus` counts the GPUs whose instances must
load weights (and serve nothing meanwhile) to get from one plan to the other.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

from distserve.plan import PhaseConfig, Plan
from distserve.search.candidates import Config
from distserve.search.placement import place_instances, place_units
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
    """The plan with `copies` of unit placed anew (ClusterTooSmall when they do not fit)."""
    prefill = PhaseConfig(*unit.prefill, unit.n_prefill * copies)
    decode = PhaseConfig(*unit.decode, unit.n_decode * copies)
    if plan.algorithm == "low-affinity":
        segments = place_units(node_names, gpus_per_node, unit, nodes_per_instance(plan), copies)
    else:
        segments = place_instances(node_names, gpus_per_node, prefill, decode)
    return replace(plan, prefill=prefill, decode=decode, segments=segments, baselines={})


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
