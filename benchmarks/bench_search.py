"""Wall time of the placement search for the paper's OPT-66B chatbot setting.

4 nodes x 8 A100-80GB, low node affinity (Algorithm 2), TTFT 2.5 s, TPOT 0.15 s, 90%.
Goal: under 10 s on a 2-core machine. Run: python benchmarks/bench_search.py [--workers N]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from distserve.search import plan_deployment
from distserve.spec import load_manifest

SPEC = Path(__file__).resolve().parents[1] / "examples" / "opt-66b-chatbot.yaml"


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the search workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spec = load_manifest(SPEC).spec
    spec.planner.workers = args.workers
    times, cpu_times = [], []
    for _ in range(args.repeats):
        started, cpu_started = time.perf_counter(), _cpu_s()
        plan = plan_deployment(spec)
        times.append(time.perf_counter() - started)
        cpu_times.append(_cpu_s() - cpu_started)
    print(
        f"bench_search opt-66b chatbot 4x8 A100 low-affinity: workers={args.workers} "
        f"cores={os.cpu_count()} search_s min={min(times):.2f} max={max(times):.2f} "
        f"cpu_s(all processes)={min(cpu_times):.2f} load1={os.getloadavg()[0]:.1f} "
        f"(goal < 10 s) -> prefill tp{plan.prefill.tp}pp{plan.prefill.pp}x{plan.prefill.instances} "
        f"decode tp{plan.decode.tp}pp{plan.decode.pp}x{plan.decode.instances} "
        f"{plan.per_gpu_goodput_rps:.3f} req/s/GPU"
    )


if __name__ == "__main__":
    main()
