"""How many copies of an Algorithm 2 unit serve the target rate, checked by simulation.

The unit's goodput times the number of copies overstates what the copies serve
together: the router sends a prefilled request to the least loaded decode instance
of any copy, so some KV crosses the slow network between nodes, and the tail of the
joint latency is worse than each copy's. So, as Algorithm 1 does, the copies are
placed and simulated together at the target rate's scale, and their count grows
until the whole deployment's goodput reaches `workload.rateRps` (or the cluster is
full).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from distserve.plan import PhaseConfig, SegmentPlacement
from distserve.search.goodput import Goodput
from distserve.search.placement import ClusterTooSmall, pair_links, place_units
from distserve.search.trials import Config, SearchContext, Unit, unit_goodput

MAX_GROWTHS = 4  # re-simulations while the copies fall short of the rate


@dataclass(frozen=True)
class Replicated:
    """The copies of a unit that the plan deploys, and their joint goodput."""

    whole: Unit  # every copy's instances, links from where their segments sit
    copies: int
    segments: tuple[SegmentPlacement, ...]
    goodput: Goodput


def whole_unit(prefill: PhaseConfig, decode: PhaseConfig, links) -> Unit:
    """The simulated unit of a whole placement (links: [prefill][decode] bytes/s)."""
    return Unit(
        Config(prefill.tp, prefill.pp), Config(decode.tp, decode.pp), prefill.instances,
        decode.instances, tuple(tuple(row) for row in links),
    )


def replicate(
    pmap: Callable, ctx: SearchContext, unit: Unit, inter_op: int, one: Goodput,
    rate_rps: float, node_names: list[str], gpus_per_node: int,
    progress: Callable[[str], None],
) -> Replicated:
    """Copies of unit (whose own goodput is `one`), placed and simulated together,
    grown until they serve rate_rps.

    Raises ClusterTooSmall when the copies needed do not fit on the nodes.
    """
    copies = max(1, math.ceil(rate_rps / one.rate_rps))
    if copies == 1:  # the unit alone serves the rate: its joint goodput is already known
        segments = place_units(node_names, gpus_per_node, unit, inter_op, 1)
        return Replicated(unit, 1, segments, one)
    for _ in range(MAX_GROWTHS):
        try:
            segments = place_units(node_names, gpus_per_node, unit, inter_op, copies)
        except ClusterTooSmall as err:
            raise ClusterTooSmall(
                f"{copies} copies of the {unit.num_gpus}-GPU unit ({copies * unit.num_gpus} "
                f"GPUs) do not fit: {err}"
            ) from None
        whole = whole_unit(
            PhaseConfig(*unit.prefill, unit.n_prefill * copies),
            PhaseConfig(*unit.decode, unit.n_decode * copies),
            pair_links(segments, ctx.intra_node_bytes_per_s, ctx.inter_node_bytes_per_s),
        )
        (goodput,) = pmap(unit_goodput, [(ctx, whole, None, None, copies * one.rate_rps)])
        progress(f"replicas: {copies} x unit serve {goodput.rate_rps:.2f} req/s "
                 f"(target {rate_rps} req/s)")
        if goodput.rate_rps >= rate_rps or goodput.rate_rps <= 0:
            break
        copies = max(copies + 1, math.ceil(copies * rate_rps / goodput.rate_rps))
    return Replicated(whole, copies, segments, goodput)
