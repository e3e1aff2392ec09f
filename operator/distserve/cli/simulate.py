"""`distserve simulate -f SPEC --rate R`: one trial of a given placement, summarised.

The placement comes from --prefill/--decode (TPxPPxN) or from the spec's
`placement`; requests come from the spec's workload at the given rate. The summary
gives attainment and TTFT/TPOT percentiles; --csv writes one row per request.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

import numpy as np

from distserve.latency import kv_capacity_tokens
from distserve.plan import PhaseConfig
from distserve.search import build_context, resolve_cluster
from distserve.search.placement import ClusterTooSmall, pair_links, place_fixed
from distserve.search.replicas import whole_unit
from distserve.search.trials import Config, instance_model, run_unit
from distserve.spec import load_manifest

NAME = "simulate"
HELP = "Simulate a prefill/decode placement at one request rate and summarise per-request latency."
EXIT_BAD_PLACEMENT = 1


def phase_arg(text: str) -> PhaseConfig:
    """TPxPPxN, e.g. 2x1x3: tensor parallel 2, pipeline 1, 3 instances."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text.strip().lower())
    if not match or min(int(g) for g in match.groups()) < 1:
        raise argparse.ArgumentTypeError(f"expected TPxPPxN with positive integers, got {text!r}")
    return PhaseConfig(*(int(g) for g in match.groups()))


def add_arguments(parser) -> None:
    """Options of `distserve simulate`."""
    parser.add_argument("-f", "--file", required=True, metavar="SPEC", help="DistServeDeployment YAML manifest")
    parser.add_argument("--rate", required=True, type=float, metavar="R", help="requests per second")
    parser.add_argument("--prefill", type=phase_arg, metavar="TPxPPxN", help="prefill instances")
    parser.add_argument("--decode", type=phase_arg, metavar="TPxPPxN", help="decode instances")
    parser.add_argument("--csv", metavar="FILE", help="write per-request results as CSV")


def run(args) -> int:
    """Simulate and print the summary; exit 1 when the placement cannot run."""
    spec = load_manifest(args.file).spec
    if args.rate <= 0:
        return _fail("--rate must be positive")
    prefill, decode = args.prefill, args.decode
    if (prefill is None) != (decode is None):
        return _fail("give both --prefill and --decode, or neither (and a spec.placement)")
    if prefill is None:
        if spec.placement is None:
            return _fail("no placement: give --prefill and --decode, or set spec.placement")
        p, d = spec.placement.prefill, spec.placement.decode
        prefill, decode = PhaseConfig(p.tp, p.pp, p.instances), PhaseConfig(d.tp, d.pp, d.instances)
    names, per_node = resolve_cluster(spec, None, None)
    ctx = build_context(spec)
    for role, phase in (("prefill", prefill), ("decode", decode)):
        try:
            capacity = kv_capacity_tokens(ctx.model, ctx.accelerator, phase.tp, phase.pp)
            if capacity > 0:
                instance_model(ctx, "disaggregated", Config(phase.tp, phase.pp))
        except ValueError as err:
            return _fail(f"{role} tp={phase.tp} pp={phase.pp}: {err}")
        if capacity <= 0:
            return _fail(f"{role} tp={phase.tp} pp={phase.pp}: {ctx.model} does not fit in "
                         f"{phase.gpus_per_instance} x {ctx.accelerator} memory")
    try:
        segments = place_fixed(
            names, per_node, prefill, decode, spec.cluster.node_affinity == "low"
        )
    except ClusterTooSmall as err:
        return _fail(f"the placement does not fit the cluster: {err}")
    unit = whole_unit(prefill, decode, pair_links(
        segments, ctx.intra_node_bytes_per_s, ctx.inter_node_bytes_per_s))
    result = run_unit(ctx, unit, args.rate, None)
    trace = ctx.trial_trace(args.rate)
    print(_summary(ctx, prefill, decode, args.rate, result))
    if args.csv:
        _write_csv(args.csv, trace, result, ctx.slo)
        print(f"wrote {args.csv} ({trace.num_requests} requests)", file=sys.stderr)
    return 0


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_PLACEMENT


def _summary(ctx, prefill: PhaseConfig, decode: PhaseConfig, rate: float, result) -> str:
    slo = ctx.slo
    q = result.percentile_s
    n = len(result.ttft_s)
    unfinished = int(np.isnan(result.tpot_s).sum())
    return "\n".join([
        f"{ctx.model} on {ctx.accelerator}: prefill tp{prefill.tp} pp{prefill.pp} x{prefill.instances}, "
        f"decode tp{decode.tp} pp{decode.pp} x{decode.instances} ({prefill.num_gpus + decode.num_gpus} GPUs)",
        f"  latency      {ctx.latency.describe()}",
        f"  rate         {rate} req/s, {n} requests over {result.duration_s:.1f} s simulated",
        f"  attainment   {result.attainment(slo):.1%} (TTFT <= {slo.ttft_s} s and TPOT <= {slo.tpot_s} s, "
        f"target {slo.attainment:.0%}, rule {slo.rule})",
        f"  TTFT         mean {np.nanmean(result.ttft_s):.3f} s  p50 {q('ttft', 50):.3f} s  "
        f"p90 {q('ttft', 90):.3f} s  p99 {q('ttft', 99):.3f} s",
        f"  TPOT         mean {np.nanmean(result.tpot_s):.4f} s  p50 {q('tpot', 50):.4f} s  "
        f"p90 {q('tpot', 90):.4f} s  p99 {q('tpot', 99):.4f} s",
    ] + ([f"  unfinished   {unfinished} requests never finished"] if unfinished else []))


def _write_csv(path: str, trace, result, slo) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["req_id", "arrival_s", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "is_slo_met"])
        for i in range(trace.num_requests):
            ttft, tpot = result.ttft_s[i], result.tpot_s[i]
            ok = bool(ttft <= slo.ttft_s and tpot <= slo.tpot_s)
            writer.writerow([i, f"{trace.arrival_s[i]:.6f}", int(trace.prompt_tokens[i]),
                             int(trace.output_tokens[i]), f"{ttft:.6f}", f"{tpot:.6f}", ok])
