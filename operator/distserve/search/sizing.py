"""From the placement algorithm's units to a Plan: how many instances, on which GPUs.

Algorithm 2's units are packed onto the nodes as copies of one or two shapes
(`packing`, `replicas`); Algorithm 1's two configurations are sized in instance counts
and placed anywhere. Either way the plan stays within the cluster and the GPU budget
(`planner.maxGpus`): a rate they cannot serve gets the best plan that fits, which
names what limited it (`Plan.limited_by`) and so how much it falls short
(`Plan.shortfall_rps`). With no rate, Algorithm 2 plans the one unit of best goodput
per GPU; asked for the cluster's capacity, the mix that serves the most.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from distserve.plan import LatencyStats, PhaseConfig, Plan
from distserve.search.algorithms import UnitChoice, algorithm1, algorithm2
from distserve.search.packing import Room
from distserve.search.placement import ClusterTooSmall, place_instances, place_units
from distserve.search.replicas import replicate
from distserve.search.trials import (
    Instances,
    SearchContext,
    Unit,
    latency_stats,
    run_unit,
    unit_goodput,
)


class NoFeasiblePlan(ValueError):
    """No placement fits in memory, or no rate meets the SLOs, or the cluster is too small."""

    def __init__(self, reason: str, best_attainment: float = 0.0) -> None:
        super().__init__(f"{reason} (best attainment found: {best_attainment:.1%})")
        self.reason = reason
        self.best_attainment = best_attainment


@dataclass(frozen=True)
class Sizing:
    """What the plan is sized for and within."""

    rate_rps: float | None  # the target rate; None: one unit, or the capacity
    is_capacity: bool  # the most the cluster (within the budget) serves
    room: Room  # the nodes and the GPU budget

    @property
    def limit(self) -> str:
        """What bounds the plan's size, in words."""
        nodes, per_node = len(self.room.node_names), self.room.gpus_per_node
        if self.room.max_gpus < nodes * per_node:
            return f"planner.maxGpus ({self.room.max_gpus} of {nodes * per_node} GPUs)"
        return f"the cluster ({nodes} nodes x {per_node} GPUs)"


def low_affinity_plan(pmap, ctx: SearchContext, model, cluster, min_kv, sizing: Sizing,
                      progress: Callable[[str], None]) -> Plan:
    """Algorithm 2's units, packed for the rate (or the capacity), as a plan."""
    is_packing = bool(sizing.rate_rps) or sizing.is_capacity or \
        sizing.room.max_gpus < cluster.num_gpus
    choices = algorithm2(pmap, ctx, model, cluster, min_kv, progress, is_packing=is_packing)
    if choices is None:
        raise NoFeasiblePlan(
            f"{model.name} fits no pair of prefill and decode segments inside one node "
            f"of {cluster.gpus_per_node} {ctx.accelerator} (try nodeAffinity: high)"
        )
    check_goodput(choices[0], ctx)
    if not (sizing.rate_rps or sizing.is_capacity):
        choice = next((c for c in choices if c.unit.num_gpus <= sizing.room.max_gpus), None)
        if choice is None:
            raise _too_large(choices[0].unit, sizing)
        segments = place_units(sizing.room.node_names, sizing.room.gpus_per_node,
                               choice.unit, choice.inter_op, 1)
        unit = choice.unit
        return _plan("low-affinity", pmap, ctx, ((PhaseConfig(*unit.prefill, unit.n_prefill),),
                     (PhaseConfig(*unit.decode, unit.n_decode),)), unit, segments,
                     choice.goodput.rate_rps, sizing)
    copies = replicate(pmap, ctx, choices, None if sizing.is_capacity else sizing.rate_rps,
                       sizing.room, progress)
    if copies is None:
        raise _too_large(min((c.unit for c in choices), key=lambda u: u.num_gpus), sizing)
    return _plan("low-affinity", pmap, ctx, (copies.groups("prefill"), copies.groups("decode")),
                 copies.whole, copies.segments, copies.goodput.rate_rps, sizing,
                 (copies.latency, copies.goodput.attainment) if copies.latency else None)


def high_affinity_plan(pmap, ctx: SearchContext, configs, cluster, sizing: Sizing,
                       progress: Callable[[str], None]) -> Plan:
    """Algorithm 1's configurations, sized for the rate (or the capacity) and placed."""
    room = sizing.room
    choice = algorithm1(pmap, ctx, configs, cluster, sizing.rate_rps, progress,
                        room.max_gpus, sizing.is_capacity)
    check_goodput(choice, ctx)
    unit = choice.unit
    while True:
        prefill = PhaseConfig(*unit.prefill, unit.n_prefill)
        decode = PhaseConfig(*unit.decode, unit.n_decode)
        try:
            segments = place_instances(room.node_names, room.gpus_per_node, prefill, decode)
            break
        except ClusterTooSmall as err:
            if unit.n_prefill + unit.n_decode <= 2:
                raise NoFeasiblePlan(f"the plan does not fit the cluster: {err}",
                                     choice.goodput.attainment) from None
            # NOTE: GPUs strewn over nodes hold fewer instances than their count says
            fewer_prefill = unit.n_prefill > 1 and (unit.n_prefill >= unit.n_decode or unit.n_decode == 1)
            unit = Unit(unit.prefill, unit.decode, unit.n_prefill - fewer_prefill,
                        unit.n_decode - (not fewer_prefill), unit.link_bytes_per_s)
    goodput_rps = choice.goodput.rate_rps
    if unit != choice.unit:
        (goodput,) = pmap(unit_goodput, [(ctx, unit)])
        goodput_rps = goodput.rate_rps
    return _plan("high-affinity", pmap, ctx, ((prefill,), (decode,)), unit, segments,
                 goodput_rps, sizing)


def _too_large(unit: Unit, sizing: Sizing) -> NoFeasiblePlan:
    return NoFeasiblePlan(f"not one copy of the smallest {unit.num_gpus}-GPU unit fits "
                          f"within {sizing.limit}")


def assemble_plan(algorithm, pmap, ctx: SearchContext, groups, whole: Unit | Instances,
                  segments, goodput_rps: float, rate_rps: float | None,
                  limited_by: str = "",
                  latency: tuple[LatencyStats, float] | None = None) -> Plan:
    """The plan of (prefill groups, decode groups) placed on segments, with the latencies
    of its instances simulated together at goodput_rps: the one place a Plan is made.
    latency: (percentiles, attainment) of that trial when it ran already."""
    (prefill, *extra_prefill), (decode, *extra_decode) = groups
    stats, attained = latency or latency_at(pmap, ctx, whole, goodput_rps)
    return Plan(
        algorithm=algorithm, model=ctx.model, accelerator=ctx.accelerator,
        prefill=prefill, decode=decode, segments=segments,
        goodput_rps=goodput_rps, attainment=attained, latency=stats,
        ttft_slo_s=ctx.slo.ttft_s, tpot_slo_s=ctx.slo.tpot_s,
        attainment_target=ctx.slo.attainment, rate_rps=rate_rps,
        latency_source=ctx.latency.describe(),
        extra_prefill=tuple(extra_prefill), extra_decode=tuple(extra_decode),
        limited_by=limited_by,
    )


def _plan(algorithm, pmap, ctx: SearchContext, groups, whole: Unit | Instances, segments,
          goodput_rps: float, sizing: Sizing,
          latency: tuple[LatencyStats, float] | None = None) -> Plan:
    """The sized plan, naming what limits it where that kept it below the rate (or where
    it is the capacity)."""
    rate = sizing.rate_rps
    is_limited = (rate and goodput_rps < rate) or sizing.is_capacity
    return assemble_plan(algorithm, pmap, ctx, groups, whole, segments, goodput_rps, rate,
                         sizing.limit if is_limited else "", latency)


def check_goodput(choice: UnitChoice, ctx: SearchContext) -> None:
    """NoFeasiblePlan when even a near-zero rate misses the SLOs."""
    if choice.goodput.rate_rps <= 0:
        s = ctx.slo
        raise NoFeasiblePlan(
            f"no request rate meets TTFT <= {s.ttft_s} s and TPOT <= {s.tpot_s} s for "
            f"{s.attainment:.0%} of requests, even at a near-zero rate",
            choice.goodput.attainment,
        )


def latency_at(pmap, ctx: SearchContext, unit: Unit | Instances,
               rate_rps: float) -> tuple[LatencyStats, float]:
    """Percentiles and attainment of a full trial (no early exit) at rate_rps."""
    (result,) = pmap(run_unit, [(ctx, unit, rate_rps, None)])
    return latency_stats(result), result.attainment(ctx.slo)
