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
from distserve.search.trials import Config, SearchContext, baseline_goodput

BASELINES = ("colocated", "chunked_prefill")


def baseline_configs(configs: list[Config], gpus_per_node: int) -> list[Config]:
    """The configurations the baselines try: those within a node, else the smallest."""
    inside = [c for c in configs if c[0] * c[1] <= gpus_per_node]
    if inside or not configs:
        return inside
    smallest = min(c[0] * c[1] for c in configs)
    return [c for c in configs if c[0] * c[1] == smallest]


def best_baselines(
    pmap: Callable, ctx: SearchContext, configs: list[Config], num_gpus: int,
    progress: Callable[[str], None],
) -> dict[str, BaselineResult]:
    """Per baseline, its best configuration replicated over num_gpus GPUs."""
    progress(f"baselines: {len(configs)} configurations x {len(BASELINES)} engines")
    keys = [(name, c) for name in BASELINES for c in configs]
    results = dict(zip(keys, pmap(baseline_goodput, [(ctx, n, c) for n, c in keys]), strict=True))
    found = {}
    for name in BASELINES:
        config = max(configs, key=lambda c: results[(name, c)].rate_rps / (c[0] * c[1]))
        gpus = config[0] * config[1]
        instances = max(1, num_gpus // gpus)
        goodput = results[(name, config)].rate_rps * instances
        found[name] = BaselineResult(
            name=name, tp=config[0], pp=config[1], instances=instances,
            num_gpus=instances * gpus, goodput_rps=goodput,
            per_gpu_goodput_rps=goodput / (instances * gpus),
            chunk_size=ctx.chunk_size if name == "chunked_prefill" else None,
        )
    return found
