"""Planning at cluster scale: OPT-175B chatbot on 32 nodes x 8 H100-80GB, low node affinity.

For each case (a target rate, or the cluster's capacity as `distserve plan --capacity`
plans it) and each repeat: the plan (groups per phase), GPUs used, predicted goodput,
the search's wall and CPU seconds (this process and its search workers), and the load
average beside them, since the machine may be shared; before and after, the seconds of a
fixed Python loop, so that runs on machines (or minutes) of different speed compare.
Run: python benchmarks/bench_cluster_plan.py [--rates 120 150] [--capacity] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from distserve.plan import Plan
from distserve.search import plan_deployment
from distserve.spec import load_manifest

SPEC = Path(__file__).resolve().parents[1] / "examples" / "opt-175b-chatbot-h100-cluster.yaml"


def reference_loop_s() -> float:
    """Seconds of a fixed pure-Python loop: how fast this machine runs the simulator's
    kind of code right now (a shared 2-core machine drifts by tens of percent)."""
    started, total = time.perf_counter(), 0
    for i in range(10_000_000):
        total += i
    return time.perf_counter() - started


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the search workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def describe(plan: Plan) -> str:
    """e.g. "prefill tp1pp8x5 + tp1pp6x2, decode tp4pp4x5 + tp4pp3x2"."""
    return ", ".join(
        f"{role} " + " + ".join(f"tp{g.tp}pp{g.pp}x{g.instances}" for g in plan.groups(role))
        for role in ("prefill", "decode")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", type=float, nargs="*", default=[120.0, 150.0])
    parser.add_argument("--capacity", action="store_true", help="also plan for the capacity")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    cases = [(rate, False) for rate in args.rates] + ([(None, True)] if args.capacity else [])
    print(f"reference loop {reference_loop_s():.2f} s (10M additions) before", flush=True)
    for rate, is_capacity in cases:
        for repeat in range(args.repeats):
            spec = load_manifest(SPEC).spec
            spec.workload.rate_rps = rate
            spec.planner.workers = args.workers
            started, cpu_started = time.perf_counter(), _cpu_s()
            plan = plan_deployment(spec, is_capacity=is_capacity)
            wall_s, cpu_s = time.perf_counter() - started, _cpu_s() - cpu_started
            load1, load5, _ = os.getloadavg()
            case = "capacity" if is_capacity else f"rate {rate:g} req/s"
            short = f" short by {plan.shortfall_rps:.2f}" if plan.shortfall_rps else ""
            print(f"opt-175b 32x8 H100 {case} #{repeat + 1}: {describe(plan)}; "
                  f"{plan.num_gpus} GPUs, goodput {plan.goodput_rps:.2f} req/s{short}; "
                  f"search wall {wall_s:.1f} s cpu {cpu_s:.1f} s (all processes); "
                  f"load {load1:.1f} {load5:.1f} on {os.cpu_count()} cores", flush=True)
    print(f"reference loop {reference_loop_s():.2f} s (10M additions) after", flush=True)


if __name__ == "__main__":
    main()
