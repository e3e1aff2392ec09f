"""The placement algorithms: which instance configurations, how many, per unit of GPUs.

Algorithm 1 (high node affinity) finds the best prefill configuration and the best
decode configuration separately, each by its per-GPU goodput in a simulation of that
phase alone, then sizes the two for the traffic. Algorithm 2 (low node affinity)
enumerates inter_op (node-level segments per instance) and the intra-node
configurations of a prefill and a decode segment that share each node, and simulates
the pair jointly, KV moving over the node's link.
NOTE: in Algorithm 2 a node may hold several prefill or decode segments of the same
stage (n_prefill, n_decode), so the two phases need not be 1:1; the counts come from
the phases' own goodputs, and the per-phase goodputs also bound the joint one, so
pairs that cannot beat the best joint result so far are not simulated jointly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from distserve.latency import kv_capacity_tokens
from distserve.search.candidates import ClusterShape, segment_configs
from distserve.search.goodput import Goodput
from distserve.search.trials import Config, SearchContext, Unit, phase_goodput, unit_goodput

MAX_INSTANCES_PER_UNIT = 8
MAX_RESIZES = 3  # Algorithm 1: joint re-simulations while growing the counts to the rate


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
    """(n_prefill, n_decode, bound_rps): instance counts within max_gpus whose slower
    phase serves the most requests per GPU; bound_rps is that slower phase's rate."""
    best = (0, 0, 0.0)
    best_per_gpu = 0.0
    for n_p in range(1, MAX_INSTANCES_PER_UNIT + 1):
        for n_d in range(1, MAX_INSTANCES_PER_UNIT + 1):
            gpus = n_p * prefill_gpus + n_d * decode_gpus
            if gpus > max_gpus:
                break
            bound = min(n_p * prefill_rps, n_d * decode_rps)
            if bound / gpus > best_per_gpu * (1 + 1e-9):
                best, best_per_gpu = (n_p, n_d, bound), bound / gpus
    return best


def phase_table(
    pmap: Callable, ctx: SearchContext, configs: Iterable[Config]
) -> dict[tuple[str, Config], Goodput]:
    """Goodput of every (phase, config) alone, simulated in parallel."""
    keys = [(phase, c) for c in sorted(set(configs)) for phase in ("prefill", "decode")]
    results = pmap(phase_goodput, [(ctx, phase, c) for phase, c in keys])
    return dict(zip(keys, results, strict=True))


def best_phase_attainment(table: dict[tuple[str, Config], Goodput]) -> float:
    """The worse of the two phases' best attainments: an upper bound on what any
    configuration reached (what a user is told when no rate meets the SLOs)."""
    phases = {}
    for (phase, _), goodput in table.items():
        phases[phase] = max(phases.get(phase, 0.0), goodput.attainment)
    return min(phases.values()) if phases else 0.0


def algorithm1(
    pmap: Callable, ctx: SearchContext, configs: list[Config], cluster: ClusterShape,
    rate_rps: float | None, progress: Callable[[str], None],
) -> UnitChoice:
    """Best prefill and best decode configuration by per-GPU goodput, sized for rate_rps
    (or balanced against each other when no rate is given), then simulated together."""
    progress(f"algorithm 1: {len(configs)} configurations x 2 phases")
    table = phase_table(pmap, ctx, configs)

    def best(phase: str) -> tuple[Config, float]:
        config = max(configs, key=lambda c: table[(phase, c)].rate_rps / (c[0] * c[1]))
        return config, table[(phase, config)].rate_rps

    (cp, gp), (cd, gd) = best("prefill"), best("decode")
    if gp <= 0 or gd <= 0:
        return UnitChoice(Unit(cp, cd, 1, 1, ctx.inter_node_bytes_per_s), 1, Goodput(
            0.0, best_phase_attainment(table), 0))
    if rate_rps:
        n_p, n_d = math.ceil(rate_rps / gp), math.ceil(rate_rps / gd)
    else:
        n_p, n_d, _ = balance(gp, cp[0] * cp[1], gd, cd[0] * cd[1], cluster.num_gpus)
        n_p, n_d = max(n_p, 1), max(n_d, 1)
    for _ in range(MAX_RESIZES):
        unit = Unit(cp, cd, n_p, n_d, ctx.inter_node_bytes_per_s)
        progress(f"algorithm 1: prefill tp{cp[0]}pp{cp[1]} x{n_p}, decode tp{cd[0]}pp{cd[1]} x{n_d}")
        (joint,) = pmap(unit_goodput, [(ctx, unit, None, None, min(n_p * gp, n_d * gd))])
        if not rate_rps or joint.rate_rps >= rate_rps or joint.rate_rps <= 0:
            break
        # NOTE: both phases together miss more requests than either alone, so the
        # per-phase counts may fall short of the rate; grow both in proportion.
        scale = rate_rps / joint.rate_rps
        n_p, n_d = math.ceil(n_p * scale), math.ceil(n_d * scale)
        if n_p * cp[0] * cp[1] + n_d * cd[0] * cd[1] > cluster.num_gpus:
            break
    return UnitChoice(unit, 1, joint)


def algorithm2(
    pmap: Callable, ctx: SearchContext, model, cluster: ClusterShape, min_kv: tuple[int, int],
    progress: Callable[[str], None], batch_size: int = 2,
) -> UnitChoice | None:
    """Best (inter_op, prefill segment, decode segment) unit by joint per-GPU goodput;
    None when no configuration fits. min_kv: (prefill, decode) KV tokens needed."""
    inter_ops = [
        k for k in range(1, min(cluster.max_nodes_per_instance, cluster.num_nodes) + 1)
        if model.num_layers % k == 0
    ]
    k_to_segs = {
        k: sorted(set(segment_configs(
            model, ctx.accelerator, cluster, k, min(min_kv), ctx.latency, ctx.profile_path
        )))
        for k in inter_ops
    }
    configs = [(tp, k * lpp) for k, segs in k_to_segs.items() for tp, lpp in segs]
    if not configs:
        return None
    progress(f"algorithm 2: {len(configs)} segment configurations x 2 phases")
    table = phase_table(pmap, ctx, configs)
    ranked = _ranked_units(ctx, cluster, k_to_segs, table, min_kv)
    if not ranked:
        unit = Unit(configs[0], configs[0], 1, 1, ctx.intra_node_bytes_per_s)
        return UnitChoice(unit, 1, Goodput(0.0, best_phase_attainment(table), 0))
    progress(f"algorithm 2: {len(ranked)} prefill/decode segment pairs")
    best: UnitChoice | None = None
    for start in range(0, len(ranked), batch_size):
        batch = ranked[start:start + batch_size]
        if best is not None and batch[0][0] <= best.per_gpu_rps:
            break  # no pair left can beat the best joint goodput
        # NOTE: the phases' bound (both phases' SLOs at once) is where bisection starts
        results = pmap(unit_goodput, [
            (ctx, unit, None, None, per_gpu * unit.num_gpus) for per_gpu, unit, _ in batch
        ])
        for (_, unit, k), joint in zip(batch, results, strict=True):
            choice = UnitChoice(unit, k, joint)
            if best is None or choice.per_gpu_rps > best.per_gpu_rps:
                best = choice
        progress(f"algorithm 2: {min(start + batch_size, len(ranked))}/{len(ranked)} pairs "
                 f"simulated jointly, best {best.per_gpu_rps:.3f} req/s per GPU")
    return best


def _ranked_units(ctx, cluster, k_to_segs, table, min_kv) -> list[tuple[float, Unit, int]]:
    """Every feasible (bound per GPU, unit, inter_op), best bound first."""
    ranked = []
    for k, segs in k_to_segs.items():
        for sp in segs:
            for sd in segs:
                cp, cd = (sp[0], k * sp[1]), (sd[0], k * sd[1])
                if not (_has_kv(ctx, cp, min_kv[0]) and _has_kv(ctx, cd, min_kv[1])):
                    continue
                n_p, n_d, bound = balance(
                    table[("prefill", cp)].rate_rps, sp[0] * sp[1],
                    table[("decode", cd)].rate_rps, sd[0] * sd[1], cluster.gpus_per_node,
                )
                if bound > 0:
                    unit = Unit(cp, cd, n_p, n_d, ctx.intra_node_bytes_per_s)
                    ranked.append((bound / unit.num_gpus, unit, k))
    ranked.sort(key=lambda item: -item[0])
    return ranked


def _has_kv(ctx: SearchContext, config: Config, tokens: int) -> bool:
    capacity = kv_capacity_tokens(ctx.model, ctx.accelerator, *config, profile_path=ctx.profile_path)
    return capacity >= tokens
