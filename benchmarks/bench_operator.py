"""Time from applying a DistServeDeployment to its plan in status and its objects created.

The operator (kopf, the real handlers) runs against the kmock Kubernetes API emulator
holding 4 Nodes of 8 A100-80GB; the resource is the paper's OPT-66B chatbot setting
with the cluster shape left to the Nodes. Prints one line per run and the median.

    python benchmarks/bench_operator.py [--runs 3] [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import kmock
import yaml
from kopf.testing import KopfRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "k8s"))  # the emulator with resource versions

from kmock_cluster import (  # noqa: E402
    OPERATOR_ARGS,
    VersionedEmulator,
    make_resource,
    owned,
    prepare,
    status_of,
)

NODES = 4


def say(line: str) -> None:
    """Print past the CLI runner, which captures sys.stdout while kopf runs."""
    print(line, file=sys.__stdout__, flush=True)


def opt66b_spec(workers: int | None) -> dict:
    """The OPT-66B chatbot example, its cluster shape read from the Nodes."""
    doc = yaml.safe_load((ROOT / "examples" / "opt-66b-chatbot.yaml").read_text())
    spec = doc["spec"]
    for key in ("nodes", "gpusPerNode"):
        spec["cluster"].pop(key, None)
    if workers:
        spec.setdefault("planner", {})["workers"] = workers
    return spec


async def time_one(api, name: str, spec: dict) -> dict[str, float]:
    """Apply one resource; seconds until the plan is in status and all objects exist."""
    started = time.perf_counter()
    await api.create(make_resource(name, spec))
    planned_s = objects_s = None
    while objects_s is None:
        status = await status_of(api, name)
        if planned_s is None and status.get("planId"):
            planned_s = time.perf_counter() - started
        if status.get("phase") == "Degraded":
            raise SystemExit(f"{name}: Degraded: {status.get('message')}")
        expected = len((status.get("plan") or {}).get("segments", [])) or None
        if expected and status.get("appliedPlanId"):
            pods = await owned(api, "Pod", name)
            if len(pods) == expected and await owned(api, "Deployment", name):
                objects_s = time.perf_counter() - started
        await asyncio.sleep(0.1)
    counts = {kind: len(await owned(api, kind, name)) for kind in ("Pod", "Service", "ConfigMap", "Deployment")}
    return {"planned_s": planned_s, "objects_s": objects_s,
            "search_s": status.get("searchSeconds", 0.0), "pods": counts["Pod"],
            "objects": sum(counts.values()), "prefill": status["prefill"], "decode": status["decode"]}


async def main(runs: int, workers: int | None) -> None:
    """Start the emulator and the operator; time `runs` resources one after another."""
    async with VersionedEmulator() as emulator, kmock.Server(emulator):
        api = prepare(emulator, nodes=NODES)
        runner = KopfRunner(OPERATOR_ARGS, timeout=30).__enter__()
        try:
            say(f"bench_operator: OPT-66B chatbot, {NODES} nodes x 8 A100-80GB (kmock), "
                  f"planner workers={workers or 'all cores'}")
            results = []
            for i in range(runs):
                result = await time_one(api, f"opt-66b-{i}", opt66b_spec(workers))
                results.append(result)
                p, d = result["prefill"], result["decode"]
                say(f"run {i + 1}: plan in status {result['planned_s']:.2f} s "
                      f"(search {result['search_s']:.2f} s), objects created "
                      f"{result['objects_s']:.2f} s ({result['pods']} pods, {result['objects']} "
                      f"objects; prefill {p['instances']}x tp{p['tp']} pp{p['pp']}, "
                      f"decode {d['instances']}x tp{d['tp']} pp{d['pp']})")
            say(f"median: plan in status {statistics.median(r['planned_s'] for r in results):.2f} s, "
                  f"objects created {statistics.median(r['objects_s'] for r in results):.2f} s, "
                  f"apply after plan {statistics.median(r['objects_s'] - r['planned_s'] for r in results):.2f} s")
        finally:
            await asyncio.to_thread(runner.__exit__, None, None, None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None, help="planner processes")
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.workers))
