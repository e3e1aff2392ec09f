"""Attainment against rate for a plan and its baselines (what `distserve plan --plot` draws).

Rates are per GPU, so that systems on different numbers of GPUs compare on one axis;
every point is a full trial without early exit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distserve.plan import Plan
from distserve.search.placement import pair_links
from distserve.search.replicas import whole_instances
from distserve.search.trials import Instances, SearchContext, run_baseline, run_unit


@dataclass(frozen=True)
class Curve:
    """One system's attainment at each per-GPU rate."""

    label: str
    per_gpu_rate_rps: list[float]
    attainment: list[float]


def plan_unit(ctx: SearchContext, plan: Plan) -> Instances:
    """The simulated instances of a whole plan (every group of a mixed one), links from
    where its segments sit."""
    links = pair_links(plan.segments, ctx.intra_node_bytes_per_s, ctx.inter_node_bytes_per_s)
    return whole_instances(plan.groups("prefill"), plan.groups("decode"), links)


def attainment_curves(ctx: SearchContext, plan: Plan, num_points: int = 12) -> list[Curve]:
    """Curves for the plan and each baseline, from 0.2x to 2x the plan's per-GPU goodput."""
    top = max(plan.per_gpu_goodput_rps, 1e-3)
    rates = [float(r) for r in np.linspace(0.2 * top, 2.0 * top, num_points)]
    unit = plan_unit(ctx, plan)
    curves = [Curve(
        f"DistServe ({plan.num_gpus} GPUs)", rates,
        [run_unit(ctx, unit, r * plan.num_gpus, None).attainment(ctx.slo) for r in rates],
    )]
    for name, b in plan.baselines.items():
        curves.append(Curve(
            f"{name} tp{b.tp}pp{b.pp} x{b.instances}", rates,
            [
                run_baseline(ctx, name, (b.tp, b.pp), b.instances, r * b.num_gpus, None)
                .attainment(ctx.slo)
                for r in rates
            ],
        ))
    return curves
