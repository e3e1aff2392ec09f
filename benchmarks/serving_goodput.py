"""Real goodput on this machine: 1 prefill + 1 decode instance against 2 colocated ones.

Both deployments get the same two CPU cores (one instance pinned per core), SmolLM2-135M,
and the same Poisson workloads shaped like the paper's summarization (long prompts,
short outputs) scaled to a CPU. The router and this load generator are not pinned: they
share the two cores in both deployments alike (note the load average printed first).

SLOs, as the paper does, are multiples of one request's latency on this hardware:
before the runs a process pinned to one core measures the prefill of a mean prompt
(P) and a decode step beside it (D); TTFT SLO = TTFT_SCALE x P, TPOT SLO = TPOT_SCALE x D.
Rates are fractions of one core's prefill capacity 1/P. The TPOT SLO is what a decode
stream meets on its own core, and misses when multi-second prefills stall it. For each
rate it prints the attainment (both SLOs) and latency percentiles; a deployment stops
climbing after two rates in a row under the target, or one under STOP_BELOW. Goodput is
the highest rate whose attainment reaches the target, and, where a higher rate tried
misses it, the rate where attainment crosses the target, linear between the two (the
grid alone puts a deployment anywhere between a rate that met the target and the next).
Each deployment's queues start empty at each rate: near one core's prefill capacity
(1/P) a queue grows for the whole replay, so the more requests per rate, the nearer the
figure is to the steady state.

Which deployment wins depends on the SLOs, as in the paper's SLO-scale figures: a loose
TTFT lets one prefill core queue, a tight TPOT is what a colocated decode stream misses
behind its neighbour's prefills. So every request's TTFT and TPOT are kept, and after the
runs both deployments' goodputs are recomputed from the same requests for a grid of SLO
scales (--ttft-scales x --tpot-scales): a deployment climbs to higher rates until it
misses even the grid's loosest pair, so each goodput in the grid has the rate past it.
The CPU matters the same way: one neighbour's prefill adds P/(n-1) to the TPOT of a
colocated stream of n tokens, so where P/D is large (a slow prefill against the decode
step, as bfloat16 without AMX) one stall uses up the TPOT SLO, and where it is small
(AMX's fast prefill) colocated absorbs several.

    python benchmarks/serving_goodput.py [--fractions 0.4,0.55,...,1.9] [--requests 60]
        [--ttft-slo S --tpot-slo S]   # fixed SLOs instead of the calibrated ones
        [--ttft-scales 3,6,12,24 --tpot-scales 1.5,2,2.5,4]   # the grid (x P, x D)
        [--deployments disaggregated,colocated]  # one alone to repeat its figure
        [--dtype auto|float32|bfloat16]  # the engine's (auto: bfloat16 on a CPU with AMX
                                         # or AVX512-BF16, as `distserve up` serves)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from distserve.local.launcher import LocalLauncher
from distserve.local.load import Outcome, drive
from distserve.local.report import summarize
from distserve.local.settings import find_model_path, serve_settings
from distserve.spec import load_manifest
from distserve.workload import Request
from distserve_engine.server.settings import ServeSettings

PROMPT_TOKENS = (512, 1024)  # summarization shape, scaled: long prompts ...
OUTPUT_TOKENS = (16, 32)  # ... short outputs
TTFT_SCALE = 6.0  # x one mean prefill: room for a short queue on one prefill core
TPOT_SCALE = 2.5  # x one decode step: headroom for batching, HTTP hops and a shared machine;
# one 2-5 s prefill stall spread over a 16-32 token output already uses it up
TARGET = 0.9
STOP_BELOW = 0.5  # attainment far under the target: higher rates only do worse
PORT = 8100

CALIBRATE = """
import os, sys, time, json
os.sched_setaffinity(0, {0})
for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[k] = "1"
import torch
torch.set_num_threads(1)
from distserve_engine.config import EngineConfig
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence
r = ModelRunner(EngineConfig(model=sys.argv[1], max_model_len=2048, dtype=sys.argv[3]))
n = int(sys.argv[2])
def seq(i):
    return Sequence(str(i), list(range(1000, 1000 + n)), SamplingParams(max_tokens=64, ignore_eos=True))
prefill_s, decode_s = [], []
for i in range(3):
    s = seq(i)
    t = time.perf_counter(); r.prefill([s]); prefill_s.append(time.perf_counter() - t)
    for _ in range(6):
        t = time.perf_counter(); r.decode([s]); decode_s.append(time.perf_counter() - t)
    r.free(s)
print(json.dumps({"prefill_s": sorted(prefill_s)[1], "decode_s": sorted(decode_s)[len(decode_s) // 2],
                  "dtype": str(r.dtype).removeprefix("torch.")}))
"""


def calibrate(model_path: str, dtype: str) -> tuple[float, float, str]:
    """(prefill of a mean prompt, decode step beside it) in seconds, pinned to one core,
    and the dtype the engine ran."""
    mean_prompt = sum(PROMPT_TOKENS) // 2
    out = subprocess.run([sys.executable, "-c", CALIBRATE, model_path, str(mean_prompt), dtype],
                         capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    return doc["prefill_s"], doc["decode_s"], doc["dtype"]


def make_requests(rate_rps: float, num: int, seed: int) -> list[Request]:
    """Poisson arrivals, uniform lengths."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, num))
    return [Request(i, float(arrivals[i]), int(rng.integers(*PROMPT_TOKENS)),
                    int(rng.integers(*OUTPUT_TOKENS))) for i in range(num)]


@dataclass(frozen=True)
class Goodput:
    """A deployment's goodput: the highest rate tried that met the target, and the rate
    where attainment crosses the target (None where no higher rate tried missed it)."""

    met_rps: float
    crossing_rps: float | None

    def describe(self) -> str:
        if not self.met_rps:
            return "none (no rate tried met the target)"
        if self.crossing_rps is None:
            return f">= {self.met_rps:.3f} req/s (no rate tried missed the target)"
        return f"{self.crossing_rps:.3f} req/s (met up to {self.met_rps:.3f})"

    @property
    def figure_rps(self) -> float:
        return self.crossing_rps if self.crossing_rps is not None else self.met_rps


def goodput_of(points: list[tuple[float, float]]) -> Goodput:
    """(rate, attainment) pairs, low to high -> the goodput, as the module docstring says."""
    met = [i for i, (_, attainment) in enumerate(points) if attainment >= TARGET]
    if not met:
        return Goodput(0.0, None)
    i = met[-1]
    rate, attainment = points[i]
    if i + 1 == len(points):
        return Goodput(rate, None)
    next_rate, next_attainment = points[i + 1]
    share = (attainment - TARGET) / (attainment - next_attainment)
    return Goodput(rate, rate + share * (next_rate - rate))


Slo = tuple[float, float]  # (TTFT, TPOT) seconds
Measured = list[tuple[float, list[Outcome]]]  # (rate, what each request saw), low to high


def attainment(outcomes: list[Outcome], slo: Slo) -> float:
    return sum(o.meets(*slo) for o in outcomes) / max(1, len(outcomes))


def run_config(label: str, settings: ServeSettings, rates: list[float], num: int,
               slo: Slo, loosest: Slo) -> Measured:
    """Each rate, low to high, until attainment under the loosest SLOs of the grid falls
    under STOP_BELOW, or under the target twice in a row; what every request saw."""
    measured: Measured = []
    with LocalLauncher(settings, port=PORT) as launcher:
        warmup = make_requests(0.5, 2, 99)
        asyncio.run(drive(launcher.url, settings.model_name, warmup, show_progress=False))
        for rate in rates:
            started_s = time.monotonic()
            outcomes = asyncio.run(drive(launcher.url, settings.model_name, make_requests(rate, num, 0),
                                         show_progress=False))
            s = summarize(outcomes, rate, *slo)
            print(f"{label:<14} rate {rate:.3f} req/s  attainment {s.attainment:6.1%}  "
                  f"TTFT p50/p90 {s.ttft_p_s[50]:5.2f}/{s.ttft_p_s[90]:5.2f} s  "
                  f"TPOT p50/p90 {s.tpot_p_s[50]:.3f}/{s.tpot_p_s[90]:.3f} s  errors {s.num_errors}  "
                  f"({time.monotonic() - started_s:.0f} s, load {os.getloadavg()[0]:.2f})", flush=True)
            measured.append((rate, outcomes))
            at_loosest = [attainment(o, loosest) for _, o in measured]
            if at_loosest[-1] < STOP_BELOW or (len(at_loosest) >= 2 and max(at_loosest[-2:]) < TARGET):
                print(f"{label:<14} under the target even at the grid's loosest SLOs: higher rates skipped",
                      flush=True)
                break
    return measured


def goodput_at(measured: Measured, slo: Slo) -> Goodput:
    return goodput_of([(rate, attainment(outcomes, slo)) for rate, outcomes in measured])


def goodput_text(g: Goodput, lowest_rps: float) -> str:
    if not g.met_rps:
        return f"<{lowest_rps:.2f}"
    return f"{'>=' if g.crossing_rps is None else ''}{g.figure_rps:.2f}"


def ratio_text(g_d: Goodput, g_c: Goodput, lowest_rps: float) -> str:
    """Disaggregated over colocated at the crossings; where either missed the target at
    every rate tried or met it at every one, the ratio is a bound and says which."""
    if not g_d.met_rps:
        return "n/a" if not g_c.met_rps else f"<{lowest_rps / g_c.figure_rps:.2f}x"
    if not g_c.met_rps:
        return f">{g_d.figure_rps / lowest_rps:.2f}x"
    if g_d.crossing_rps is None and g_c.crossing_rps is None:
        return "?"
    mark = ">=" if g_d.crossing_rps is None else "<=" if g_c.crossing_rps is None else ""
    return f"{mark}{g_d.figure_rps / g_c.figure_rps:.2f}x"


def print_slo_grid(disagg: Measured, coloc: Measured, prefill_s: float, decode_s: float,
                   ttft_scales: list[float], tpot_scales: list[float]) -> None:
    """Both goodputs and their ratio for each SLO pair, from the requests measured above."""
    lowest = min(rate for rate, _ in disagg + coloc)  # both start at the same rate
    print("goodput by SLO scale, from the same requests (disaggregated / colocated x2 req/s, and "
          "their ratio; >= met the target at every rate tried, < at none):")
    print("  TPOT \\ TTFT " + "".join(f"{f'{t:g} x P':>24}" for t in ttft_scales))
    for tpot_scale in tpot_scales:
        cells = []
        for ttft_scale in ttft_scales:
            slo = (ttft_scale * prefill_s, tpot_scale * decode_s)
            g_d, g_c = goodput_at(disagg, slo), goodput_at(coloc, slo)
            cells.append(f"{goodput_text(g_d, lowest)}/{goodput_text(g_c, lowest)} "
                         f"{ratio_text(g_d, g_c, lowest):>8}")
        print(f"  {f'{tpot_scale:g} x D':<12}" + "".join(f"{c:>24}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fractions", default="0.4,0.55,0.7,0.85,1.0,1.15,1.3,1.6,1.9",
                        help="rates as fractions of one core's prefill capacity 1/P")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--ttft-slo", type=float, default=None)
    parser.add_argument("--tpot-slo", type=float, default=None)
    parser.add_argument("--ttft-scales", default="3,6,12,24", help="the grid's TTFT SLOs, x P")
    parser.add_argument("--tpot-scales", default="1.5,2,2.5,4", help="the grid's TPOT SLOs, x D")
    parser.add_argument("--deployments", default="disaggregated,colocated",
                        help="which to run (one alone prints its goodput, no ratio)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the engine's dtype (auto: its choice on this CPU, as `distserve up`)")
    args = parser.parse_args()
    shapes = {"disaggregated": ("disaggregated", {"prefill": 1, "decode": 1}),
              "colocated": ("colocated x2", {"colocated": 2})}
    chosen = args.deployments.split(",")
    if unknown := [d for d in chosen if d not in shapes]:
        parser.error(f"--deployments: unknown {unknown}; expected a comma list of {sorted(shapes)}")
    spec = load_manifest("examples/local.yaml").spec
    spec.model.dtype = args.dtype
    path = find_model_path(spec)
    print(f"load average before: {os.getloadavg()}; cores: {sorted(os.sched_getaffinity(0))}", flush=True)
    prefill_s, decode_s, dtype = calibrate(path, args.dtype)
    slo = (args.ttft_slo or TTFT_SCALE * prefill_s, args.tpot_slo or TPOT_SCALE * decode_s)
    rates = [round(float(f) / prefill_s, 3) for f in args.fractions.split(",")]
    print(f"calibration (one pinned core, {dtype} ({args.dtype})): prefill of "
          f"{sum(PROMPT_TOKENS) // 2} tokens {prefill_s:.2f} s, decode step {decode_s:.3f} s")
    print(f"SLOs: TTFT <= {slo[0]:.2f} s, TPOT <= {slo[1]:.3f} s, target {TARGET:.0%}; prompts "
          f"{PROMPT_TOKENS} tokens, outputs {OUTPUT_TOKENS}; {args.requests} Poisson requests per rate; "
          f"rates {rates} req/s (= {args.fractions} x 1/P)", flush=True)
    ttft_scales = [float(x) for x in args.ttft_scales.split(",")]
    tpot_scales = [float(x) for x in args.tpot_scales.split(",")]
    loosest = (max(ttft_scales + [slo[0] / prefill_s]) * prefill_s,
               max(tpot_scales + [slo[1] / decode_s]) * decode_s)
    measured = {d: run_config(shapes[d][0], serve_settings(spec, shapes[d][1], "bench", path),
                              rates, args.requests, slo, loosest) for d in chosen}
    if len(measured) == 1:
        ((name, alone),) = measured.items()
        print(f"goodput: {name} {goodput_at(alone, slo).describe()}")
    else:
        disagg, coloc = measured["disaggregated"], measured["colocated"]
        g_d, g_c = goodput_at(disagg, slo), goodput_at(coloc, slo)
        lowest = min(rates)
        met = (f"; {g_d.met_rps / g_c.met_rps:.2f}x at the highest rates met"
               if g_d.met_rps and g_c.met_rps else "")
        print(f"goodput: disaggregated {g_d.describe()}, colocated x2 {g_c.describe()}; "
              f"ratio {ratio_text(g_d, g_c, lowest)} at the crossings{met}")
        print_slo_grid(disagg, coloc, prefill_s, decode_s, ttft_scales, tpot_scales)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
