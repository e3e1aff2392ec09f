"""Goodput at twice the capacity with admission by predicted TTFT off and on.

A local deployment (1 prefill + 1 decode instance of SmolLM2-135M, one core each) is
calibrated once: the unloaded TTFT and TPOT of a few sequential requests set the SLOs
(TTFT_SCALE and TPOT_SCALE times them) and a burst of BURST requests sent at once gives
the capacity (requests / makespan). Then, for each mode, the same Poisson workloads at
OVERLOAD x capacity are replayed REPEATS times, after a warm-up at half the capacity
that also trains the router's TTFT model (it needs 16 requests). Goodput is the requests
that met both SLOs per second of the arrival window; refused requests (429) meet none.
Printed per repetition, then mean, standard deviation, min and max per mode, with the
load average (the machine is shared: figures move with it).

    python benchmarks/admission_goodput.py [--repeats 3] [--requests 30] [--overload 2.0]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time

import numpy as np

from distserve.local.launcher import LocalLauncher
from distserve.local.load import drive
from distserve.local.settings import find_model_path, serve_settings
from distserve.spec import load_manifest
from distserve.workload import Request
from distserve_engine.server.settings import Slo

PROMPT_TOKENS = (64, 192)
OUTPUT_TOKENS = (8, 16)
TTFT_SCALE = 3.0  # x the unloaded TTFT: room for a short queue
TPOT_SCALE = 4.0  # x the unloaded TPOT: batching and a shared machine
BURST = 12
PORT = 8300


def make_requests(rate_rps: float, num: int, seed: int) -> list[Request]:
    """Poisson arrivals at `rate_rps`, uniform lengths."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, num)) if rate_rps else np.zeros(num)
    return [Request(i, float(arrivals[i]), int(rng.integers(*PROMPT_TOKENS)),
                    int(rng.integers(*OUTPUT_TOKENS))) for i in range(num)]


def run(url: str, model: str, requests: list[Request]) -> list:
    return asyncio.run(drive(url, model, requests, show_progress=False))


def calibrate(url: str, model: str) -> tuple[float, float, float]:
    """(unloaded TTFT s, unloaded TPOT s, capacity req/s)."""
    sequential = []
    for i, req in enumerate(make_requests(0.0, 4, 7)):
        sequential += run(url, model, [Request(i, 0.0, req.prompt_tokens, req.output_tokens)])
    ttft_s = float(np.median([o.ttft_s for o in sequential]))
    tpot_s = float(np.median([o.tpot_s for o in sequential if o.tpot_s]))
    started_s = time.monotonic()
    outcomes = run(url, model, make_requests(0.0, BURST, 8))
    makespan_s = time.monotonic() - started_s
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    return ttft_s, tpot_s, BURST / makespan_s


def goodput_rps(outcomes: list, requests: list[Request], slo: tuple[float, float]) -> tuple:
    """(goodput req/s, attainment, refused) over the arrival window."""
    window_s = max(r.arrival_s for r in requests) or 1.0
    met = sum(o.meets(*slo) for o in outcomes)
    refused = sum(o.status == 429 for o in outcomes)
    return met / window_s, met / len(outcomes), refused


def run_mode(label: str, settings: dict, rate_rps: float, capacity_rps: float, args,
             slo: tuple[float, float]) -> list[float]:
    """Warm-up, then REPEATS overloaded runs; the goodputs."""
    goodputs = []
    with LocalLauncher(settings, port=PORT) as launcher:
        model = settings.model_name
        run(launcher.url, model, make_requests(capacity_rps / 2, 20, 99))  # warm-up
        for repeat in range(args.repeats):
            requests = make_requests(rate_rps, args.requests, seed=repeat)
            outcomes = run(launcher.url, model, requests)
            good, attainment, refused = goodput_rps(outcomes, requests, slo)
            goodputs.append(good)
            ok = [o.ttft_s for o in outcomes if o.ttft_s is not None]
            print(f"{label:<4} run {repeat}: goodput {good:.3f} req/s  attainment {attainment:6.1%}  "
                  f"refused {refused:>2}/{len(outcomes)}  TTFT p90 of served "
                  f"{np.percentile(ok, 90) if ok else float('nan'):5.2f} s  "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    return goodputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--overload", type=float, default=2.0, help="rate / measured capacity")
    args = parser.parse_args()
    spec = load_manifest("examples/local.yaml").spec
    path = find_model_path(spec)
    print(f"load average before: {os.getloadavg()}; cores: {sorted(os.sched_getaffinity(0))}",
          flush=True)
    base = serve_settings(spec, {"prefill": 1, "decode": 1}, "bench", path)
    base.max_waiting_requests = 1024  # only the TTFT prediction refuses
    with LocalLauncher(base, port=PORT) as launcher:
        ttft_s, tpot_s, capacity_rps = calibrate(launcher.url, base.model_name)
    slo = (TTFT_SCALE * ttft_s, TPOT_SCALE * tpot_s)
    rate_rps = args.overload * capacity_rps
    print(f"calibration: unloaded TTFT {ttft_s:.3f} s, TPOT {tpot_s:.4f} s, capacity "
          f"{capacity_rps:.2f} req/s (burst of {BURST}); SLOs TTFT <= {slo[0]:.2f} s, "
          f"TPOT <= {slo[1]:.3f} s; rate {rate_rps:.2f} req/s ({args.overload:g}x), "
          f"{args.requests} requests x {args.repeats} runs per mode", flush=True)
    results = {}
    for label, is_on in (("off", False), ("on", True)):
        settings = dataclasses.replace(base, slo=Slo(*slo), admit_by_ttft=is_on)
        results[label] = run_mode(label, settings, rate_rps, capacity_rps, args, slo)
    for label, goodputs in results.items():
        g = np.array(goodputs)
        print(f"admission by TTFT {label:<3}: goodput mean {g.mean():.3f} req/s  std {g.std(ddof=1) if len(g) > 1 else 0:.3f}  "
              f"min {g.min():.3f}  max {g.max():.3f}  (n={len(g)})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
