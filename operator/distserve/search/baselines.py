"""The best colocated plans on the same GPUs: what DistServe is measured against.

Each baseline engine (vLLM-style colocated continuous batching; chunked prefill with
piggybacked decodes) gets its best instance configuration by per-GPU goodput and is
replicated over as many GPUs as the DistServe plan takes.
NOTE: baseline instances stay inside one node (tp * pp <= GPUs per node) unless the
model needs more; the paper's vLLM++ found that wider colocated instances do not help.
"""

from __future__ import annotations

from collections.abc import Callable

from distserve.plan import BaselineResult
from distserve.search.goodput import REL_TOL, Goodput
from distserve.search.trials import PHASE_REL_TOL, Config, SearchContext, baseline_goodput

BASELINES = ("colocated", "chunked_prefill")


def baseline_configs(configs: list[Config], gpus_per_node: int) -> list[Config]:
    """The configurations the baselines try: those within a node, else the smallest."""
    inside = [c for c in configs if c.num_gpus <= gpus_per_node]
    if inside or not configs:
        return inside
    smallest = min(c.num_gpus for c in configs)
    return [c for c in configs if c.num_gpus == smallest]


def coarse_pass(ctx: SearchContext, configs: list[Config]) -> tuple[Callable, list[tuple]]:
    """(function, argument tuples) of the first, coarse pass over the configurations:
    what `best_baselines` maps, or is given the results of (run beforehand)."""
    return baseline_goodput, [(ctx, n, c, PHASE_REL_TOL) for n, c in _keys(configs)]


def _keys(configs: list[Config]) -> list[tuple[str, Config]]:
    return [(name, c) for name in BASELINES for c in configs]


def best_baselines(
    pmap: Callable, ctx: SearchContext, configs: list[Config], num_gpus: int,
    progress: Callable[[str], None], coarse_goodputs: list[Goodput] | None = None,
) -> dict[str, BaselineResult]:
    """Per baseline, its best configuration replicated over num_gpus GPUs
    (coarse_goodputs: the results of `coarse_pass`, when it ran already).

    NOTE: every configuration is bisected coarsely (PHASE_REL_TOL) first; only those
    whose bracket reaches the best per-GPU goodput are then narrowed to REL_TOL, so
    the winner and its goodput are those of a full bisection at a fraction of the trials.
    """
    progress(f"baselines: {len(configs)} configurations x {len(BASELINES)} engines")
    keys = _keys(configs)
    coarse = dict(zip(keys, coarse_goodputs or pmap(*coarse_pass(ctx, configs)), strict=True))
    contenders = [key for key in keys if _can_win(key, coarse)]
    results = dict(zip(contenders, pmap(
        baseline_goodput, [(ctx, n, c, REL_TOL, coarse[(n, c)]) for n, c in contenders]),
        strict=True))
    found = {}
    for name in BASELINES:
        config = max(
            (c for n, c in contenders if n == name),
            key=lambda c: results[(name, c)].rate_rps / c.num_gpus,
        )
        gpus = config.num_gpus
        instances = max(1, num_gpus // gpus)
        goodput = results[(name, config)].rate_rps * instances
        found[name] = BaselineResult(
            name=name, tp=config.tp, pp=config.pp, instances=instances,
            num_gpus=instances * gpus, goodput_rps=goodput,
            per_gpu_goodput_rps=goodput / (instances * gpus),
            chunk_size=ctx.chunk_size if name == "chunked_prefill" else None,
        )
    return found


def _can_win(key: tuple[str, Config], coarse: dict[tuple[str, Config], Goodput]) -> bool:
    """Whether this configuration's bracket reaches the best lower bound of its engine."""
    def per_gpu(config: Config, rps: float) -> float:
        return rps / config.num_gpus

    name, config = key
    best = max(per_gpu(c, g.rate_rps) for (n, c), g in coarse.items() if n == name)
    goodput = coarse[key]
    upper = goodput.fail_rps if goodput.fail_rps > goodput.rate_rps else goodput.rate_rps
    return per_gpu(config, upper) >= best
