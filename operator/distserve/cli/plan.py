"""`distserve plan -f SPEC`: search the placement and show it, or print it as JSON.

Progress goes to stderr while the search runs; the chosen plan, its predicted
goodput, attainment and latency percentiles, the latency source every candidate and
baseline was timed with, and the best colocated and chunked-prefill plans on the same
GPUs go to stdout (one JSON object with --json, the source under "latency_source").
A rate the cluster (or `planner.maxGpus`) cannot serve gets the best plan that fits
and a line saying by how much it falls short; `--capacity` plans for the most the
cluster serves within the SLOs and prints that rate.

A spec that leaves the cluster shape to the Nodes (as one applied to a cluster does)
gets it from `--nodes/--gpus-per-node/--accelerator`, else from the current kubeconfig's
cluster (`shape`); with neither, the command says which flags to give.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from distserve.cli.shape import ShapeUnknown, complete_cluster
from distserve.latency import SourceChoice
from distserve.plan import Plan
from distserve.search import NoFeasiblePlan, plan_deployment
from distserve.search.planner import latency_choice
from distserve.spec import load_manifest

NAME = "plan"
HELP = "Search the goodput-optimal prefill/decode placement for a DistServeDeployment spec."
EXIT_NO_PLAN = 1
EXIT_NO_SHAPE = 2


def add_arguments(parser) -> None:
    """Options of `distserve plan`."""
    parser.add_argument("-f", "--file", required=True, metavar="SPEC",
                        help="DistServeDeployment YAML manifest")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--capacity", action="store_true",
                        help="plan for the highest rate the cluster serves within the SLOs "
                        "(workload.rateRps ignored) and print it")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw SLO attainment against per-GPU rate for the plan and baselines")
    cluster = parser.add_argument_group(
        "cluster shape", "override spec.cluster; unset there and here: read from the "
        "current kubeconfig's cluster")
    cluster.add_argument("--nodes", type=_positive_int, metavar="N", help="number of nodes")
    cluster.add_argument("--gpus-per-node", type=_positive_int, metavar="G", help="GPUs per node")
    cluster.add_argument("--accelerator", metavar="NAME",
                         help="GPU type: A100-80GB, H100-80GB, H200-141GB, L40S or CPU")


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def run(args) -> int:
    """Plan, print, optionally plot; exit 1 when no placement meets the SLOs."""
    manifest = load_manifest(args.file)
    try:
        spec, source = complete_cluster(manifest.spec, nodes=args.nodes,
                                        gpus_per_node=args.gpus_per_node,
                                        accelerator=args.accelerator)
    except ShapeUnknown as err:
        print(f"error: cluster shape unknown: {err}", file=sys.stderr)
        return EXIT_NO_SHAPE
    latency = latency_choice(spec)
    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    progress(f"cluster: {spec.cluster.nodes} x {spec.cluster.gpus_per_node} "
             f"{spec.cluster.accelerator} from {source}")
    try:
        plan = plan_deployment(spec, progress=progress, is_capacity=args.capacity)
    except NoFeasiblePlan as err:
        print(f"error: no feasible plan: {err}", file=sys.stderr)
        return EXIT_NO_PLAN
    if args.json:
        doc = {**plan.to_dict(), "latency_source": {
            "source": latency.source, "tps": list(latency.tps) if latency.tps else None,
            "profile": latency.profile_path or None, "reason": latency.reason,
        }, "admit_by_ttft": spec.router.admit_by_ttft}
        print(json.dumps(doc, indent=2))
    else:
        print(format_plan(plan, manifest.metadata.name, latency, spec.router.admit_by_ttft))
    if args.plot:
        _plot(spec, plan, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def format_plan(plan: Plan, name: str, latency: SourceChoice | None = None,
                admits_by_ttft: bool = False) -> str:
    """The human-readable report of a plan (and of the latency source, when given);
    admits_by_ttft: the spec's router refuses by predicted TTFT, and the plan was
    simulated so."""
    lines = [
        f"plan for {name}: {plan.model} on {plan.num_gpus} x {plan.accelerator} "
        f"({plan.algorithm}, searched in {plan.search_seconds:.1f} s)",
        "",
        f"  {'phase':<8} {'tp':>3} {'pp':>3} {'instances':>9} {'GPUs':>5}",
    ]
    for role in ("prefill", "decode"):
        for phase in plan.groups(role):
            lines.append(f"  {role:<8} {phase.tp:>3} {phase.pp:>3} {phase.instances:>9} "
                         f"{phase.num_gpus:>5}")
    lines += [
        "",
        f"  goodput      {plan.goodput_rps:.2f} req/s  ({plan.per_gpu_goodput_rps:.3f} req/s per GPU)",
        f"  attainment   {plan.attainment:.1%} at goodput (target {plan.attainment_target:.0%}, "
        f"TTFT <= {plan.ttft_slo_s} s, TPOT <= {plan.tpot_slo_s} s)",
    ]
    if admits_by_ttft:
        lines.append("  refusals     the router turns away a request it predicts would miss the "
                     "TTFT SLO (router.admitByTtft); each counted as a miss")
    if plan.rate_rps:
        lines.append(f"  sized for    {plan.rate_rps} req/s")
    if plan.shortfall_rps > 0:
        lines.append(f"  short by     {plan.shortfall_rps:.2f} req/s: the best plan within "
                     f"{plan.limited_by} serves {plan.goodput_rps:.2f} of {plan.rate_rps} req/s")
    elif not plan.rate_rps and plan.limited_by:
        lines.append(f"  capacity     {plan.goodput_rps:.2f} req/s within the SLOs on {plan.limited_by}")
    if latency is not None:
        lines.append(f"  latency      {latency.describe()}")
    if plan.latency:
        lat = plan.latency
        lines += [
            f"  TTFT         p50 {lat.ttft_p50_s:.3f} s   p90 {lat.ttft_p90_s:.3f} s   p99 {lat.ttft_p99_s:.3f} s",
            f"  TPOT         p50 {lat.tpot_p50_s:.4f} s  p90 {lat.tpot_p90_s:.4f} s  p99 {lat.tpot_p99_s:.4f} s",
        ]
    lines += ["", "  placement"]
    for seg in plan.segments:
        gpus = ",".join(map(str, seg.gpu_ids))
        lines.append(f"    {seg.role:<8} #{seg.instance:<3} stage {seg.stage:<2} {seg.node}  GPUs {gpus}")
    if plan.baselines:
        lines += ["", "  baselines on the same GPUs (per-GPU goodput, DistServe's gain)"]
        for b in plan.baselines.values():
            gain = plan.per_gpu_goodput_rps / b.per_gpu_goodput_rps if b.per_gpu_goodput_rps else float("inf")
            chunk = f" chunk {b.chunk_size}" if b.chunk_size else ""
            lines.append(
                f"    {b.name:<16} tp{b.tp} pp{b.pp} x{b.instances}{chunk}: "
                f"{b.per_gpu_goodput_rps:.3f} req/s per GPU  -> DistServe {gain:.1f}x"
            )
    return "\n".join(lines)


def _plot(spec, plan: Plan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from distserve.search import build_context
    from distserve.search.curves import attainment_curves

    ctx = build_context(spec)
    fig, ax = plt.subplots(figsize=(6, 4))
    for curve in attainment_curves(ctx, plan):
        ax.plot(curve.per_gpu_rate_rps, [100 * a for a in curve.attainment], marker="o", label=curve.label)
    ax.axhline(100 * plan.attainment_target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("rate per GPU (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(f"{plan.model}: TTFT {plan.ttft_slo_s} s, TPOT {plan.tpot_slo_s} s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
