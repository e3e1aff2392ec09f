"""The placement algorithms: which instance configurations, how many, per unit of GPUs.

Algorithm 1 (high node affinity) finds the best prefill configuration and the best
decode configuration separately, each by its per-GPU goodput in a simulation of that
phase alone, then sizes the two for the traffic. Algorithm 2 (low node affinity)
enumerates inter_op (node-level segments per instance) and the intra-node
configurations of a prefill and a decode segment that share each node, and simulates
the pair jointly, KV moving over the node's link.
NOTE: in Algorithm 2 a node may hold several prefill or decode segments of the same
stage (num_prefill, num_decode), so the two phases need not be 1:1; the counts come from
the phases' own goodputs, which also rank the pairs.
NOTE: that ranking is no bound on a pair's joint goodput, so it only orders the work.
Counts x one instance's goodput undercounts: under a tail-latency SLO instances behind
one dispatcher pool their queues (OPT-13B on A100, TTFT 0.25 s: one tp1 prefill meets
it for 90% at 2.6 req/s, two together at 11.3, not 5.3); decode alone sees Poisson
arrivals that prefill smooths in the joint run; and a coarse bisection reports the low
end of its bracket. So once a best is known, every other pair is screened by one joint
trial at the best's rate per GPU: a pair that misses the SLO target there cannot beat
the best (attainment falls as the rate rises, which the bisection itself relies on),
and such a trial stops as soon as the target is out of reach.
NOTE: a deployment sized for a rate packs copies of several units on the cluster's
nodes (`packing`), so Algorithm 2 then shortlists the units whose estimates come close
to the best (SHORTLIST_SHARE, at most MAX_SHORTLIST) and the best of every footprint
(GPUs per node), whose copies fill the GPUs the others leave free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from distserve.latency import kv_capacity_tokens
from distserve.search.candidates import ClusterShape, segment_configs
from distserve.search.goodput import REL_TOL, Goodput
from distserve.search.growing import grow_to_rate
from distserve.search.trials import (
    Config,
    SearchContext,
    Unit,
    meets_target_at,
    phase_estimate,
    phase_goodput,
    unit_goodput,
)

MAX_INSTANCES_PER_UNIT = 8
MAX_RESIZES = 3  # Algorithm 1: joint re-simulations while growing the counts to the rate
SHORTLIST_SHARE = 0.8  # with packing, units estimated within this share of the best per GPU
MAX_SHORTLIST = 8  # most units kept for that reason (fill-ins not counted)
SCREEN_BATCH = 8  # pairs screened at once (the best's rate moves on between batches)
LEARN_KEYS = 6  # configurations per phase whose goodputs calibrate the others' estimates
# With packing, the phases of a pair are simulated only when its calibrated estimate per
# GPU comes within this share of the best (the shortlist then keeps SHORTLIST_SHARE of
# the best simulated), or it is the best of its footprint
PROMISING_SHARE = 0.5


@dataclass(frozen=True)
class UnitChoice:
    """The unit a placement algorithm chose and its joint goodput."""

    unit: Unit
    inter_op: int  # node-level segments per instance (1 under Algorithm 1)
    goodput: Goodput

    @property
    def per_gpu_rps(self) -> float:
        """Joint goodput per GPU."""
        return self.goodput.rate_rps / self.unit.num_gpus


def balance(
    prefill_rps: float, prefill_gpus: int, decode_rps: float, decode_gpus: int, max_gpus: int
) -> tuple[int, int, float]:
    """(num_prefill, num_decode, rate_rps): instance counts within max_gpus whose slower
    phase serves the most requests per GPU, each instance counted at its goodput alone;
    rate_rps is that slower phase's rate (an estimate: see the module's NOTE)."""
    best = (0, 0, 0.0)
    best_per_gpu = 0.0
    for num_prefill in range(1, MAX_INSTANCES_PER_UNIT + 1):
        for num_decode in range(1, MAX_INSTANCES_PER_UNIT + 1):
            gpus = num_prefill * prefill_gpus + num_decode * decode_gpus
            if gpus > max_gpus:
                break
            rate_rps = min(num_prefill * prefill_rps, num_decode * decode_rps)
            if rate_rps / gpus > best_per_gpu * (1 + 1e-9):
                best, best_per_gpu = (num_prefill, num_decode, rate_rps), rate_rps / gpus
    return best


def phase_table(
    pmap: Callable, ctx: SearchContext, configs: Iterable[Config]
) -> dict[tuple[str, Config], Goodput]:
    """Goodput of every (phase, config) alone, simulated in parallel."""
    return phase_goodputs(
        pmap, ctx, [(phase, c) for c in sorted(set(configs)) for phase in ("prefill", "decode")]
    )


def phase_goodputs(
    pmap: Callable, ctx: SearchContext, keys: list[tuple[str, Config]],
    worth: Callable[[Callable[[tuple[str, Config]], float]], set] | None = None,
) -> dict[tuple[str, Config], Goodput]:
    """Goodput of each (phase, config) of keys alone, simulated in parallel.

    worth: given each key's calibrated estimate (req/s), the keys worth simulating
    beyond the first wave; the others are left out of the table (default: all)."""
    # NOTE: the deepest pipelines first: theirs are the longest trials, and started last
    # they would leave one worker running while the others wait
    order = sorted(keys, key=lambda key: -key[1].pp)
    # NOTE: a bisection costs two trials when it starts within a step of the answer.
    # The capacity estimate is off by a factor that differs between workloads (0.2x to
    # 1.5x) far more than between one search's configurations, so a first wave of each
    # phase's configurations (LEARN_KEYS, spread over the pipeline depths) is bisected
    # from the estimate, and the rest from the estimate times the median factor the
    # first wave found. The same waves on any number of workers: the same plan.
    first = [key for phase in ("prefill", "decode") for key in _spread(
        [key for key in order if key[0] == phase], LEARN_KEYS)]
    key_to_goodput = dict(zip(first, pmap(phase_goodput, [(ctx, *key, 1.0) for key in first]),
                              strict=True))
    factors = {}
    for phase in ("prefill", "decode"):
        # NOTE: the middle of each bracket (geometric), not its low end: those sit on the
        # steps from the estimate, and their median would be the estimate itself
        found = sorted(math.sqrt(goodput.rate_rps * (goodput.fail_rps or goodput.rate_rps))
                       / phase_estimate(ctx, *key)
                       for key, goodput in key_to_goodput.items()
                       if key[0] == phase and goodput.rate_rps > 0)
        factors[phase] = found[len(found) // 2] if found else 1.0
    rest = [key for key in order if key not in key_to_goodput]
    if worth is not None:
        kept = worth(lambda key: phase_estimate(ctx, *key) * factors[key[0]])
        rest = [key for key in rest if key in kept]
    key_to_goodput |= zip(rest, pmap(phase_goodput, [(ctx, *key, factors[key[0]])
                                                     for key in rest]), strict=True)
    return {key: key_to_goodput[key] for key in keys if key in key_to_goodput}


def _spread(items: list, count: int) -> list:
    """count of items, evenly spaced from the first (all of them when there are fewer)."""
    if len(items) <= count:
        return items
    return [items[i * len(items) // count] for i in range(count)]


def best_phase_attainment(table: dict[tuple[str, Config], Goodput]) -> float:
    """The worse of the two phases' best attainments: an upper bound on what any
    configuration reached (what a user is told when no rate meets the SLOs)."""
    phases = {}
    for (phase, _), goodput in table.items():
        phases[phase] = max(phases.get(phase, 0.0), goodput.attainment)
    return min(phases.values()) if phases else 0.0


def algorithm1(
    pmap: Callable, ctx: SearchContext, configs: list[Config], cluster: ClusterShape,
    rate_rps: float | None, progress: Callable[[str], None], max_gpus: int | None = None,
    is_capacity: bool = False,
) -> UnitChoice:
    """Best prefill and best decode configuration by per-GPU goodput, sized for rate_rps
    (or balanced against each other when no rate is given, or filling max_gpus with
    is_capacity) within max_gpus (default: the cluster's), then simulated together."""
    max_gpus = min(max_gpus or cluster.num_gpus, cluster.num_gpus)
    progress(f"algorithm 1: {len(configs)} configurations x 2 phases")
    table = phase_table(pmap, ctx, configs)

    def best(phase: str) -> tuple[Config, float]:
        """The phase's configuration of most goodput per GPU, and its goodput (req/s)."""
        config = max(configs, key=lambda c: table[(phase, c)].rate_rps / c.num_gpus)
        return config, table[(phase, config)].rate_rps

    (prefill, prefill_rps), (decode, decode_rps) = best("prefill"), best("decode")
    if prefill_rps <= 0 or decode_rps <= 0:
        return UnitChoice(Unit(prefill, decode, 1, 1, ctx.inter_node_bytes_per_s), 1, Goodput(
            0.0, best_phase_attainment(table), 0))
    if is_capacity:  # the rate both phases serve with max_gpus split between them
        rate_rps = max_gpus / (prefill.num_gpus / prefill_rps + decode.num_gpus / decode_rps)
        num_prefill = max(1, math.floor(rate_rps / prefill_rps))
        num_decode = max(1, math.floor(rate_rps / decode_rps))
        rate_rps = None
    elif rate_rps:
        num_prefill, num_decode = math.ceil(rate_rps / prefill_rps), math.ceil(rate_rps / decode_rps)
    else:
        num_prefill, num_decode, _ = balance(prefill_rps, prefill.num_gpus, decode_rps,
                                             decode.num_gpus, cluster.num_gpus)
        num_prefill, num_decode = max(num_prefill, 1), max(num_decode, 1)

    def simulate(counts: tuple[int, int]) -> Goodput:
        unit = Unit(prefill, decode, *counts, ctx.inter_node_bytes_per_s)
        progress(f"algorithm 1: prefill tp{prefill.tp}pp{prefill.pp} x{counts[0]}, "
                 f"decode tp{decode.tp}pp{decode.pp} x{counts[1]}")
        estimate_rps = min(counts[0] * prefill_rps, counts[1] * decode_rps)
        (joint,) = pmap(unit_goodput, [(ctx, unit, None, None, estimate_rps)])
        return joint

    def scaled(counts: tuple[int, int], scale: float) -> tuple[int, int]:
        # NOTE: both phases together miss more requests than either alone, so the
        # per-phase counts may fall short of the rate; grow both in proportion.
        return within_gpus((math.ceil(counts[0] * scale), prefill, prefill_rps),
                           (math.ceil(counts[1] * scale), decode, decode_rps), max_gpus)

    first = within_gpus((num_prefill, prefill, prefill_rps), (num_decode, decode, decode_rps),
                        max_gpus)
    counts, joint = grow_to_rate(first, simulate, scaled, rate_rps, MAX_RESIZES)[-1]
    return UnitChoice(Unit(prefill, decode, *counts, ctx.inter_node_bytes_per_s), 1, joint)


def within_gpus(prefill: tuple[int, Config, float], decode: tuple[int, Config, float],
                max_gpus: int) -> tuple[int, int]:
    """(num_prefill, num_decode) cut to max_gpus: each (count, config, goodput of one)
    loses instances from the phase that serves more, one at a time, down to one."""
    (num_prefill, prefill_config, prefill_rps), (num_decode, decode_config, decode_rps) = prefill, decode
    while num_prefill * prefill_config.num_gpus + num_decode * decode_config.num_gpus > max_gpus:
        if num_prefill > 1 and (num_decode == 1 or num_prefill * prefill_rps >= num_decode * decode_rps):
            num_prefill -= 1
        elif num_decode > 1:
            num_decode -= 1
        else:
            break
    return num_prefill, num_decode


def algorithm2(
    pmap: Callable, ctx: SearchContext, model, cluster: ClusterShape, min_kv: tuple[int, int],
    progress: Callable[[str], None], batch_size: int = 2, is_packing: bool = False,
) -> list[UnitChoice] | None:
    """(inter_op, prefill segment, decode segment) units by joint per-GPU goodput, best
    first: the best alone, or with is_packing the shortlist to pack copies of; None when
    no configuration fits. min_kv: (prefill, decode) KV tokens needed. For the best,
    every pair is either simulated to its goodput or seen to miss the SLOs at the
    best's rate."""
    inter_ops = [
        k for k in range(1, min(cluster.max_nodes_per_instance, cluster.num_nodes) + 1)
        if model.num_layers % k == 0
    ]
    inter_op_to_segments = {
        inter_op: sorted(set(segment_configs(
            model, ctx.accelerator, cluster, inter_op, min(min_kv), ctx.latency, ctx.profile_path
        )))
        for inter_op in inter_ops
    }
    configs = [Config(segment.tp, inter_op * segment.pp)
               for inter_op, segments in inter_op_to_segments.items() for segment in segments]
    if not configs:
        return None
    pairs = list(_pairs(ctx, cluster, inter_op_to_segments, min_kv))
    # NOTE: a configuration in no pair that shares a node is never ranked: not simulated
    keys = sorted({(phase, config) for _, _, _, prefill, decode in pairs
                   for phase, config in (("prefill", prefill), ("decode", decode))})
    progress(f"algorithm 2: {len(set(configs))} instance configurations, {len(keys)} of "
             f"their {2 * len(set(configs))} phase simulations in pairs that share a node")
    worth = (lambda estimate: _promising(cluster, pairs, estimate)) if is_packing else None
    table = phase_goodputs(pmap, ctx, keys, worth)
    if is_packing:
        progress(f"algorithm 2: {len(table)} phase simulations for pairs estimated within "
                 f"{PROMISING_SHARE:.0%} of the best per GPU or best of their footprint")
    ranked = _ranked_units(ctx, cluster, pairs, table)
    if not ranked and len(table) < len(keys):  # the estimates misled: the others too
        table |= phase_goodputs(pmap, ctx, [key for key in keys if key not in table])
        ranked = _ranked_units(ctx, cluster, pairs, table)
    if not ranked:  # what a user is told is the best attainment of every configuration
        table |= phase_table(pmap, ctx, [c for c in configs
                                         if {("prefill", c), ("decode", c)} - table.keys()])
        unit = Unit(configs[0], configs[0], 1, 1, ctx.intra_node_bytes_per_s)
        return [UnitChoice(unit, 1, Goodput(0.0, best_phase_attainment(table), 0))]
    progress(f"algorithm 2: {len(ranked)} prefill/decode segment pairs")
    if not is_packing:
        return [_best_unit(pmap, ctx, ranked, batch_size, progress)]
    found = _shortlist(pmap, ctx, ranked, batch_size, progress)
    fill_ins = _best_of_each_footprint(ranked, found)
    if fill_ins:
        found = _joint(pmap, ctx, fill_ins, found)
        progress(f"algorithm 2: {len(fill_ins)} more units to fill nodes' free GPUs")
    return [choice for choice in found if choice.goodput.rate_rps > 0] or found[:1]


def _best_unit(pmap, ctx, ranked, batch_size: int, progress) -> UnitChoice:
    """The unit of most joint goodput per GPU: the first batch simulated, every later
    pair screened at the best's rate (module NOTE) and simulated if it meets it."""
    found = _joint(pmap, ctx, ranked[:batch_size], [])[:1]
    screened_out = 0
    for start in range(batch_size, len(ranked), SCREEN_BATCH):
        batch = ranked[start:start + SCREEN_BATCH]
        best = found[0].per_gpu_rps
        if best > 0:
            batch = _screen(pmap, ctx, batch, best)
            screened_out += min(SCREEN_BATCH, len(ranked) - start) - len(batch)
        if batch:
            found = _joint(pmap, ctx, batch, found)[:1]
        progress(f"algorithm 2: {min(start + SCREEN_BATCH, len(ranked))}/{len(ranked)} pairs, "
                 f"{screened_out} missing the SLOs at the best's rate, best "
                 f"{found[0].per_gpu_rps:.3f} req/s per GPU")
    return found[0]


def _screen(pmap, ctx, batch, best_per_gpu: float) -> list:
    """The batch's (estimate per GPU, unit, inter_op) that meet the SLO target at
    best_per_gpu, their estimates raised to it (where their bisection starts)."""
    # NOTE: one bisection's tolerance above the best: goodputs closer than that are equal
    passes = pmap(meets_target_at, [(ctx, unit, best_per_gpu * (1 + REL_TOL) * unit.num_gpus)
                                    for _, unit, _ in batch])
    return [(max(estimate, best_per_gpu), unit, inter_op)
            for (estimate, unit, inter_op), ok in zip(batch, passes, strict=True) if ok]


def _shortlist(pmap, ctx, ranked, batch_size: int, progress) -> list[UnitChoice]:
    """Units to pack copies of, best first: pairs in the order of their estimates while
    those come within SHORTLIST_SHARE of the best joint goodput, at most MAX_SHORTLIST.

    NOTE: a heuristic, not a bound (module NOTE): what copies serve together is settled
    by simulating them (`replicas`), and copies pool their queues as instances do, so a
    unit's own goodput does not rank its copies either.
    """
    found: list[UnitChoice] = []
    for start in range(0, len(ranked), batch_size):
        batch = ranked[start:start + batch_size]
        if found and (batch[0][0] <= found[0].per_gpu_rps * SHORTLIST_SHARE
                      or len(found) >= MAX_SHORTLIST):
            break
        found = _joint(pmap, ctx, batch, found)
        progress(f"algorithm 2: {min(start + batch_size, len(ranked))}/{len(ranked)} pairs "
                 f"simulated jointly, best {found[0].per_gpu_rps:.3f} req/s per GPU")
    return found


def _joint(pmap, ctx, batch, found: list[UnitChoice]) -> list[UnitChoice]:
    """found with the batch's (estimate per GPU, unit, inter_op) simulated jointly, best first."""
    # NOTE: bisection starts from the estimate (the phases' balance, or the rate a
    # screened pair was seen to meet)
    results = pmap(unit_goodput, [
        (ctx, unit, None, None, per_gpu * unit.num_gpus) for per_gpu, unit, _ in batch
    ])
    found = found + [UnitChoice(unit, inter_op, joint)
                     for (_, unit, inter_op), joint in zip(batch, results, strict=True)]
    return sorted(found, key=lambda choice: -choice.per_gpu_rps)


def _best_of_each_footprint(ranked, found: list[UnitChoice]) -> list:
    """The best-ranked unit of every footprint (GPUs per node) not simulated yet."""
    seen = {(choice.unit, choice.inter_op) for choice in found}
    footprints = {choice.unit.num_gpus // choice.inter_op for choice in found}
    picks = []
    for per_gpu, unit, inter_op in ranked:
        footprint = unit.num_gpus // inter_op
        if footprint not in footprints and (unit, inter_op) not in seen:
            footprints.add(footprint)
            picks.append((per_gpu, unit, inter_op))
    return picks


def _pairs(ctx, cluster, inter_op_to_segments, min_kv):
    """(inter_op, prefill segment, decode segment, prefill config, decode config) of every
    pair of segments that fits one node beside each other, each with room for its KV.

    A unit pairs a prefill segment and a decode segment that share each of inter_op
    nodes; the instance configurations span those nodes (pp = inter_op x the segment's
    stages).
    """
    for inter_op, segments in inter_op_to_segments.items():
        for prefill_segment in segments:
            for decode_segment in segments:
                if prefill_segment.num_gpus + decode_segment.num_gpus > cluster.gpus_per_node:
                    continue  # not one instance of each fits: `balance` finds no counts
                prefill = Config(prefill_segment.tp, inter_op * prefill_segment.pp)
                decode = Config(decode_segment.tp, inter_op * decode_segment.pp)
                if _has_kv(ctx, prefill, min_kv[0]) and _has_kv(ctx, decode, min_kv[1]):
                    yield inter_op, prefill_segment, decode_segment, prefill, decode


def _promising(cluster: ClusterShape, pairs, estimate: Callable) -> set[tuple[str, Config]]:
    """The (phase, config) keys of the pairs whose estimate per GPU (`balance` of the
    phases' estimates) comes within PROMISING_SHARE of the best, and of the best pair of
    every footprint (GPUs per node), whose copies fill what others leave free."""
    scored = []
    for _, prefill_segment, decode_segment, prefill, decode in pairs:
        keys = (("prefill", prefill), ("decode", decode))
        num_prefill, num_decode, rate_rps = balance(
            estimate(keys[0]), prefill_segment.num_gpus, estimate(keys[1]),
            decode_segment.num_gpus, cluster.gpus_per_node)
        footprint = num_prefill * prefill_segment.num_gpus + num_decode * decode_segment.num_gpus
        if rate_rps > 0:
            num_gpus = num_prefill * prefill.num_gpus + num_decode * decode.num_gpus
            scored.append((rate_rps / num_gpus, footprint, keys))
    best = max((per_gpu for per_gpu, _, _ in scored), default=0.0)
    kept, footprints = set(), set()
    for per_gpu, footprint, keys in sorted(scored, key=lambda item: -item[0]):
        if per_gpu >= PROMISING_SHARE * best or footprint not in footprints:
            kept.update(keys)
        footprints.add(footprint)
    return kept


def _ranked_units(ctx, cluster, pairs, table) -> list[tuple[float, Unit, int]]:
    """Every feasible (estimate per GPU, unit, inter_op) of the pairs (`_pairs`) whose
    phases are in the table, best estimate first: the slower phase's count x one
    instance's goodput (an order, no bound; module NOTE). The counts per node balance
    the two phases' goodputs on one node's GPUs."""
    ranked = []
    for inter_op, prefill_segment, decode_segment, prefill, decode in pairs:
        if ("prefill", prefill) not in table or ("decode", decode) not in table:
            continue
        num_prefill, num_decode, estimate_rps = balance(
            table[("prefill", prefill)].rate_rps, prefill_segment.num_gpus,
            table[("decode", decode)].rate_rps, decode_segment.num_gpus,
            cluster.gpus_per_node,
        )
        if estimate_rps > 0:
            unit = Unit(prefill, decode, num_prefill, num_decode, ctx.intra_node_bytes_per_s)
            ranked.append((estimate_rps / unit.num_gpus, unit, inter_op))
    ranked.sort(key=lambda item: -item[0])
    return ranked


def _has_kv(ctx: SearchContext, config: Config, tokens: int) -> bool:
    capacity = kv_capacity_tokens(ctx.model, ctx.accelerator, *config, profile_path=ctx.profile_path)
    return capacity >= tokens
