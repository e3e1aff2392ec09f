"""Per-GPU goodput of DistServe's plan against the colocated baselines, five settings.

The paper (90% attainment): chatbot 2.0-4.6x vLLM, code 5.7x, summarization 4.3x; and
1.6-7.4x / 1.6x / 1.8x DeepSpeed-MII (chunked prefill). Run: python benchmarks/bench_goodput.py
"""

from __future__ import annotations

import os
from pathlib import Path

from distserve.search import plan_deployment
from distserve.search.planner import latency_choice
from distserve.spec import load_manifest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SETTINGS = [
    ("opt-13b-chatbot", "2.0-4.6x", "1.6-7.4x"),
    ("opt-66b-chatbot", "2.0-4.6x", "1.6-7.4x"),
    ("opt-175b-chatbot", "2.0-4.6x", "1.6-7.4x"),
    ("opt-66b-code", "5.7x", "1.6x"),
    ("opt-66b-summarization", "4.3x", "1.8x"),
]


def main() -> None:
    for name, paper_vllm, paper_mii in SETTINGS:
        spec = load_manifest(EXAMPLES / f"{name}.yaml").spec
        plan = plan_deployment(spec)
        source = latency_choice(spec).source
        colo, chunk = plan.baselines["colocated"], plan.baselines["chunked_prefill"]
        print(
            f"bench_goodput {name:<22} distserve {plan.per_gpu_goodput_rps:.3f} req/s/GPU "
            f"(P tp{plan.prefill.tp}pp{plan.prefill.pp}x{plan.prefill.instances} "
            f"D tp{plan.decode.tp}pp{plan.decode.pp}x{plan.decode.instances}) | "
            f"colocated {colo.per_gpu_goodput_rps:.3f} (tp{colo.tp}pp{colo.pp}) "
            f"-> {plan.per_gpu_goodput_rps / colo.per_gpu_goodput_rps:.1f}x [paper {paper_vllm}] | "
            f"chunked {chunk.per_gpu_goodput_rps:.3f} (tp{chunk.tp}pp{chunk.pp}) "
            f"-> {plan.per_gpu_goodput_rps / chunk.per_gpu_goodput_rps:.1f}x [paper {paper_mii}] | "
            f"latency {source} | search {plan.search_seconds:.1f} s load1={os.getloadavg()[0]:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
