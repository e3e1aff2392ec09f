"""Real goodput on this machine: 1 prefill + 1 decode instance against 2 colocated ones.

Both deployments get the same two CPU cores (one instance per core), SmolLM2-135M, and
the same Poisson workload shaped like the paper's summarization (long prompts, short
outputs) scaled to a CPU, under a tight TPOT SLO. For each rate it prints the SLO
attainment; goodput is the highest rate tried whose attainment reaches the target.
The router and this load generator share the same two cores (and so does anything
else running on the machine): note the load average printed first.

    python benchmarks/serving_goodput.py [--rates 0.15,0.3,0.45] [--requests 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os

import numpy as np

from distserve.local.launcher import LocalLauncher
from distserve.local.load import drive
from distserve.local.report import summarize
from distserve.local.settings import serve_settings
from distserve.spec import load_manifest
from distserve.workload import Request

PROMPT_TOKENS = (384, 512)  # summarization shape, scaled: long prompts ...
OUTPUT_TOKENS = (24, 48)  # ... short outputs
TTFT_SLO_S = 10.0
TPOT_SLO_S = 0.4  # a decode step of a small batch takes ~0.2-0.4 s here; a prefill ~2-3 s
TARGET = 0.9


def make_requests(rate_rps: float, num: int, seed: int) -> list[Request]:
    """Poisson arrivals, uniform lengths."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, num))
    return [Request(i, float(arrivals[i]), int(rng.integers(*PROMPT_TOKENS)),
                    int(rng.integers(*OUTPUT_TOKENS))) for i in range(num)]


def run_config(label: str, settings: dict, rates: list[float], num: int) -> float:
    """Attainment at each rate; return the goodput."""
    goodput = 0.0
    with LocalLauncher(settings, port=8100) as launcher:
        asyncio.run(drive(launcher.url, settings["model_name"], make_requests(1.0, 2, 99), show_progress=False))
        for rate in rates:
            outcomes = asyncio.run(drive(launcher.url, settings["model_name"], make_requests(rate, num, 0),
                                         show_progress=False))
            s = summarize(outcomes, rate, TTFT_SLO_S, TPOT_SLO_S)
            print(f"{label:<12} rate {rate:.2f} req/s  attainment {s.attainment:6.1%}  "
                  f"TTFT p90 {s.ttft_p_s[90]:6.2f} s  TPOT p90 {s.tpot_p_s[90]:.3f} s  errors {s.num_errors}",
                  flush=True)
            if s.attainment >= TARGET:
                goodput = rate
    return goodput


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="0.15,0.3,0.45")
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    spec = load_manifest("examples/local.yaml").spec
    from distserve.local.settings import find_model_path

    path = find_model_path(spec)
    print(f"load average before: {os.getloadavg()}; cores: {sorted(os.sched_getaffinity(0))}")
    print(f"SLOs: TTFT <= {TTFT_SLO_S} s, TPOT <= {TPOT_SLO_S} s, target {TARGET:.0%}; prompts "
          f"{PROMPT_TOKENS} tokens, outputs {OUTPUT_TOKENS}; {args.requests} requests per rate")
    disagg = serve_settings(spec, {"prefill": 1, "decode": 1}, "bench", path)
    coloc = serve_settings(spec, {"colocated": 2}, "bench", path)
    g_d = run_config("disaggregated", disagg, rates, args.requests)
    g_c = run_config("colocated x2", coloc, rates, args.requests)
    ratio = f"{g_d / g_c:.2f}x" if g_c else "n/a (colocated met the target at no rate tried)"
    print(f"goodput: disaggregated {g_d:.2f} req/s, colocated {g_c:.2f} req/s, ratio {ratio}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
