"""How many copies of which Algorithm 2 units serve the target rate, checked by simulation.

The units' goodputs summed are only an estimate of what the copies serve together:
many instances share the bursts of one stream of arrivals (better than each copy
alone), while the router keeps a prefilled request on its prefill's node (low node
affinity), where it queues while another node's decode instances have room (worse;
KV crosses the network only from a node with no decode instance). So the copies
`packing` chose are placed and simulated together, and chosen again, larger, for the
rate scaled by how far the simulation fell short of `workload.rateRps` (`growing`).
Once a mix serves the rate, the mixes on fewer GPUs (as many copies of its first shape
or fewer, each alone or with a filler of another shape) are tried, fewest GPUs first,
each by one whole-deployment trial at the rate. The fewest-GPU mix that serves the
rate wins, then the one of most goodput; when none serves it, the one that serves the
most, and it says why it is short.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import groupby

from distserve.plan import LatencyStats, PhaseConfig, SegmentPlacement
from distserve.search.algorithms import UnitChoice
from distserve.search.goodput import Goodput, find_goodput_wide
from distserve.search.growing import grow_to_rate
from distserve.search.packing import Mix, Room, choose_mix, fewer_gpu_mixes
from distserve.search.placement import pair_links, place_shapes
from distserve.search.trials import (
    Config,
    Instances,
    SearchContext,
    Unit,
    judged_at,
)

MAX_RESIZES = 4  # whole-deployment simulations while growing the copies to the rate
MAX_FEWER_TRIALS = 8  # whole-deployment trials of mixes on fewer GPUs, once one serves
# A whole deployment's trials at once: two, the search's usual workers, on any number of
# them, so that the plan does not depend on the machine
WIDE_TRIALS = 2


@dataclass(frozen=True)
class Replicated:
    """The copies the plan deploys, and their joint goodput."""

    mix: Mix
    whole: Instances  # every copy's instances, links from where their segments sit
    segments: tuple[SegmentPlacement, ...]
    goodput: Goodput
    is_limited: bool  # the cluster or the budget holds no mix that serves more
    # percentiles of the whole deployment's full trial at the goodput, when one ran
    latency: LatencyStats | None = None

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
    found: list[Replicated] = []

    def simulate(mix: Mix) -> Goodput:
        found.append(_simulated(pmap, ctx, mix, room))
        progress(f"replicas: {mix.describe()} ({mix.num_gpus} GPUs) serve "
                 f"{found[-1].goodput.rate_rps:.2f} req/s"
                 + (f" (target {rate_rps} req/s)" if rate_rps else ""))
        return found[-1].goodput

    def scaled(mix: Mix, scale: float) -> Mix | None:
        # NOTE: the estimate that would serve the rate, at this mix's ratio of simulated
        # to estimated goodput
        return choose_mix(choices, room, mix.estimate_rps * scale)

    grow_to_rate(choose_mix(choices, room, rate_rps), simulate, scaled, rate_rps, MAX_RESIZES)
    if not found:
        return None
    serving = [r for r in found if rate_rps and r.goodput.rate_rps >= rate_rps]
    if not serving:
        best = max(found, key=lambda r: (r.goodput.rate_rps, -r.mix.num_gpus))
        return replace(best, is_limited=bool(rate_rps))
    best = min(serving, key=lambda r: (r.mix.num_gpus, -r.goodput.rate_rps))
    return _on_fewer_gpus(pmap, ctx, choices, room, rate_rps, best, progress) or best


def _on_fewer_gpus(pmap: Callable, ctx: SearchContext, choices: list[UnitChoice], room: Room,
                   rate_rps: float, serving: Replicated,
                   progress: Callable[[str], None]) -> Replicated | None:
    """The mix of fewest GPUs, then most attainment at rate_rps, that serves rate_rps on
    fewer GPUs than serving (`packing.fewer_gpu_mixes`), each judged by one
    whole-deployment trial at the rate; None when none does.

    NOTE: a copy too many overshoots by a whole unit (8 x 24 GPUs serving 153 req/s where
    7 serve 109 and 120 are asked); a filler of a smaller shape closes the gap instead.
    """
    ratio = serving.goodput.rate_rps / serving.mix.estimate_rps
    candidates = fewer_gpu_mixes(choices, room, rate_rps, serving.mix, ratio)
    for num_gpus, group in groupby(candidates[:MAX_FEWER_TRIALS], key=lambda mix: mix.num_gpus):
        drafts = [_placed(ctx, mix, room) for mix in group]
        judged = pmap(judged_at, [(ctx, draft.whole, rate_rps) for draft in drafts])
        winners = []
        for draft, (attainment, latency) in zip(drafts, judged, strict=True):
            ok = attainment >= ctx.slo.attainment
            progress(f"replicas: {draft.mix.describe()} ({num_gpus} GPUs) "
                     f"{'meet' if ok else 'miss'} the SLOs at {rate_rps} req/s")
            if ok:
                winners.append((attainment, latency, draft))
        if winners:
            # NOTE: the first of the most attainment at the rate: only its goodput is bisected
            attainment, latency, best = max(winners, key=lambda found: found[0])
            goodput, latency = whole_goodput(pmap, ctx, best.whole, rate_rps,
                                             {rate_rps: (attainment, latency)})
            progress(f"replicas: {best.mix.describe()} ({num_gpus} GPUs) serve "
                     f"{goodput.rate_rps:.2f} req/s (target {rate_rps} req/s)")
            return replace(best, goodput=goodput, latency=latency)
    return None


def _placed(ctx: SearchContext, mix: Mix, room: Room) -> Replicated:
    """The mix placed, its instances linked by where their segments sit; goodput unknown."""
    segments = place_shapes(room.node_names, room.gpus_per_node, mix.placed())
    draft = Replicated(mix, Instances((), (), 0.0), segments, Goodput(0.0, 0.0, 0), False)
    links = pair_links(segments, ctx.intra_node_bytes_per_s, ctx.inter_node_bytes_per_s)
    whole = whole_instances(draft.groups("prefill"), draft.groups("decode"), links)
    return replace(draft, whole=whole)


def _simulated(pmap: Callable, ctx: SearchContext, mix: Mix, room: Room) -> Replicated:
    """The mix placed, and its goodput simulated as one deployment."""
    draft = _placed(ctx, mix, room)
    if mix.is_single_unit:
        return replace(draft, goodput=mix.shapes[0][0].goodput)
    goodput, latency = whole_goodput(pmap, ctx, draft.whole, mix.estimate_rps)
    return replace(draft, goodput=goodput, latency=latency)


def whole_goodput(
    pmap: Callable, ctx: SearchContext, whole: Instances, estimate_rps: float,
    known: dict[float, tuple[float, LatencyStats | None]] | None = None,
) -> tuple[Goodput, LatencyStats | None]:
    """The goodput of one whole deployment, its trials spread over the search's workers,
    and the latency percentiles of its trial at that rate (`judged_at`; None when none
    ran there). known: (attainment, percentiles) already judged at some rates."""
    seen = dict(known or {})

    def run_trials(rates: list[float]) -> list[float]:
        seen.update(zip(rates, pmap(judged_at, [(ctx, whole, rate) for rate in rates]),
                        strict=True))
        return [seen[rate][0] for rate in rates]

    goodput = find_goodput_wide(run_trials, ctx.slo, estimate_rps, WIDE_TRIALS,
                                known={rate: judged[0] for rate, judged in seen.items()})
    return goodput, seen.get(goodput.rate_rps, (0.0, None))[1]
