"""How many copies of which Algorithm 2 units serve the target rate, checked by simulation.

The units' goodputs summed are only an estimate of what the copies serve together:
many instances share the bursts of one stream of arrivals (better than each copy
alone), while the router keeps a prefilled request on its prefill's node (low node
affinity), where it queues while another node's decode instances have room (worse;
KV crosses the network only from a node with no decode instance). So the copies
`packing` chose are placed and simulated together, and chosen again for the rate
scaled by how far the simulation fell from the estimate: larger while they fall short
of `workload.rateRps`, smaller while fewer GPUs may still serve it, until no other mix
fits the cluster and the GPU budget. The fewest-GPU mix that serves the rate wins;
when none does, the one that serves the most, and it says why it is short.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from distserve.plan import PhaseConfig, SegmentPlacement
from distserve.search.algorithms import UnitChoice
from distserve.search.goodput import Goodput
from distserve.search.packing import Mix, Room, choose_mix
from distserve.search.placement import pair_links, place_shapes
from distserve.search.trials import Config, Instances, SearchContext, Unit, unit_goodput

MAX_RESIZES = 4  # whole-deployment simulations while resizing the copies to the rate


@dataclass(frozen=True)
class Replicated:
    """The copies the plan deploys, and their joint goodput."""

    mix: Mix
    whole: Instances  # every copy's instances, links from where their segments sit
    segments: tuple[SegmentPlacement, ...]
    goodput: Goodput
    is_limited: bool  # the cluster or the budget holds no mix that serves more

    def groups(self, role: str) -> tuple[PhaseConfig, ...]:
        """The phase's instance groups, one per shape (equal shapes in a row merged)."""
        groups: list[PhaseConfig] = []
        for choice, copies in self.mix.shapes:
            config = choice.unit.prefill if role == "prefill" else choice.unit.decode
            count = copies * (choice.unit.n_prefill if role == "prefill" else choice.unit.n_decode)
            if groups and (groups[-1].tp, groups[-1].pp) == tuple(config):
                groups[-1] = PhaseConfig(config.tp, config.pp, groups[-1].instances + count)
            else:
                groups.append(PhaseConfig(config.tp, config.pp, count))
        return tuple(groups)


def whole_unit(prefill: PhaseConfig, decode: PhaseConfig, links) -> Unit:
    """The simulated unit of a whole placement (links: [prefill][decode] bytes/s)."""
    return Unit(
        Config(prefill.tp, prefill.pp), Config(decode.tp, decode.pp), prefill.instances,
        decode.instances, tuple(tuple(row) for row in links),
    )


def whole_instances(
    prefill: tuple[PhaseConfig, ...], decode: tuple[PhaseConfig, ...], links
) -> Instances:
    """The simulated instances of a placement of one or more groups per phase."""
    def each(groups: tuple[PhaseConfig, ...]) -> tuple[Config, ...]:
        return tuple(Config(g.tp, g.pp) for g in groups for _ in range(g.instances))

    return Instances(each(prefill), each(decode), tuple(tuple(row) for row in links))


def replicate(
    pmap: Callable, ctx: SearchContext, choices: list[UnitChoice], rate_rps: float | None,
    room: Room, progress: Callable[[str], None],
) -> Replicated | None:
    """Copies of the choices' shapes serving rate_rps (None: the most the room holds),
    placed and simulated together; None when no copy fits at all."""
    mix = choose_mix(choices, room, rate_rps)
    best: Replicated | None = None
    tried: set[Mix] = set()
    for _ in range(MAX_RESIZES):
        if mix is None or mix in tried:
            break
        tried.add(mix)
        found = _simulated(pmap, ctx, mix, room)
        progress(f"replicas: {mix.describe()} ({mix.num_gpus} GPUs) serve "
                 f"{found.goodput.rate_rps:.2f} req/s"
                 + (f" (target {rate_rps} req/s)" if rate_rps else ""))
        best = found if best is None or _is_better(found, best, rate_rps) else best
        if not rate_rps or found.goodput.rate_rps <= 0:
            break
        # NOTE: the estimate that would serve the rate, at this mix's ratio of simulated
        # to estimated goodput
        mix = choose_mix(choices, room, rate_rps * mix.estimate_rps / found.goodput.rate_rps)
        if mix is not None and best.goodput.rate_rps >= rate_rps and mix.num_gpus >= best.mix.num_gpus:
            break  # serving already, and no fewer GPUs to try
    if best is None:
        return None
    is_limited = bool(rate_rps) and best.goodput.rate_rps < rate_rps
    return Replicated(best.mix, best.whole, best.segments, best.goodput, is_limited)


def _is_better(found: Replicated, best: Replicated, rate_rps: float | None) -> bool:
    """Serving the rate on fewer GPUs, else serving more."""
    serves, served = (rate_rps is not None and r.goodput.rate_rps >= rate_rps
                      for r in (found, best))
    if serves and served:
        return found.mix.num_gpus < best.mix.num_gpus
    if serves or served:
        return serves
    return found.goodput.rate_rps > best.goodput.rate_rps


def _simulated(pmap: Callable, ctx: SearchContext, mix: Mix, room: Room) -> Replicated:
    """The mix placed, and its goodput simulated as one deployment."""
    segments = place_shapes(room.node_names, room.gpus_per_node, mix.placed())
    draft = Replicated(mix, Instances((), (), 0.0), segments, Goodput(0.0, 0.0, 0), False)
    links = pair_links(segments, ctx.intra_node_bytes_per_s, ctx.inter_node_bytes_per_s)
    whole = whole_instances(draft.groups("prefill"), draft.groups("decode"), links)
    if mix.is_single_unit:
        goodput = mix.shapes[0][0].goodput
    else:
        (goodput,) = pmap(unit_goodput, [(ctx, whole, None, None, mix.estimate_rps)])
    return Replicated(mix, whole, segments, goodput, False)
