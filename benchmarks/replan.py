"""Replanning under a day of shifting traffic: static plan vs replica-only autoscaling vs decide().

OPT-66B on 4 nodes x 8 A100-80GB (the paper's setting, low node affinity), one SLO for
the whole day (the chatbot's: TTFT 2.5 s, TPOT 0.15 s, 90%). The traffic
(`replan_traffic.py`) swings 3x in rate, shifts code -> summarization and chatbot ->
summarization, and bursts once. Every interval (`--interval-s`, the spec's
`intervalSeconds`) each strategy looks at the last window (histogram buckets -> fitted
lengths, as the analyzer sees Prometheus) and may move, unless its last move still runs
(the operator judges nothing while a reshuffle runs); attainment and GPUs are scored per
window of `--score-s` (a multiple of the interval):
(a) static: the plan for the morning's code traffic sized for the day's peak, never moved;
(b) replica-only (the peers' method): the same parallelism and prefill:decode ratio,
    copies sized for the observed rate on the observed workload;
(c) replanning: `analyzer.decide` (hold, cooldown, minimum gain, weight-loading cost).
A move is the operator's incremental reshuffle (`k8s.reshuffling.plan_reshuffle`, on the
plans' nodes and GPUs): instances the two plans share stay; new instances start first
where free GPUs allow; the rest each wait for an old instance to drain and start on its
GPUs; every new instance loads weights for `--reload-s` before it serves, and a drain
waits until the instances created before it serve. What serves changes at each of
those moments (old instances not yet drained beside new ones already up), and the GPUs
held count every instance created or not yet deleted. Each interval's requests are
simulated on what served them, piece by piece; a piece's queues carry over from the
interval before (its requests of the last `--warmup-s` are simulated again ahead of
this interval's, on the same instances), and start empty where a move changes what
serves; a request that arrives while a phase has no instance serving fails.

Run: python benchmarks/replan.py --plot replan.png
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass, field, replace

import numpy as np
from replan_traffic import APPS, Seen, Traffic, make_traffic, mix_at, observe

from distserve.analyzer.decide import DecisionState, decide
from distserve.analyzer.observe import RECENT_SHARE
from distserve.analyzer.replan import SearchEvaluator, serving_unit
from distserve.analyzer.scaling import move_pieces, plan_instances, ratio_text, reshuffle_steps
from distserve.analyzer.settings import ReplanningSpec
from distserve.catalog import get_model
from distserve.k8s.reshuffling import Instance
from distserve.latency import Correction
from distserve.plan import Plan
from distserve.search import SearchOverrides, build_context, plan_deployment
from distserve.search.trials import simulate_unit
from distserve.simulator import SLO, Trace
from distserve.spec import parse_spec

NODES, GPUS_PER_NODE = 4, 8
SPEC = {
    "model": {"name": "facebook/opt-66b"},
    "slo": {"ttftSeconds": 2.5, "tpotSeconds": 0.15, "attainment": 0.9},
    "workload": {"dataset": "code"},
    "cluster": {"nodes": NODES, "gpusPerNode": GPUS_PER_NODE, "accelerator": "A100-80GB",
                "nodeAffinity": "low", "interNodeBandwidthGbps": 25},
}


@dataclass(frozen=True)
class Piece:
    """From `from_s` on (until the next piece), these instances serve and this many GPUs are held."""

    from_s: float
    instances: tuple[Instance, ...]
    gpus: int


@dataclass
class Strategy:
    """One way of running the day: its plan now and what it did so far."""

    name: str
    plan: Plan
    attainment: list[float] = field(default_factory=list)  # per scored window
    gpus: list[float] = field(default_factory=list)  # time-weighted per scored window
    gpu_s: float = 0.0  # GPU-seconds held in the scored window so far
    reshuffles: int = 0
    state: DecisionState = field(default_factory=DecisionState)
    last_move_s: float = -1e18
    # what serves since the last move, from each piece's start (the last: the plan, on)
    pieces: tuple[Piece, ...] = ()
    ttft_s: np.ndarray | None = None  # per request of the day, NaN until served
    tpot_s: np.ndarray | None = None


def main() -> None:
    args = parse_args()
    started, load_before = time.monotonic(), os.getloadavg()
    planner = {"numRequests": args.num_requests, "workers": args.workers, "seed": args.seed}
    spec = parse_spec({**SPEC, "planner": planner})
    settings = ReplanningSpec.model_validate({
        "enabled": True, "intervalSeconds": args.interval_s, "windowSeconds": args.window_s,
        "holdSeconds": args.hold_s, "cooldownSeconds": args.cooldown_s,
        "reloadSeconds": args.reload_s, "minGain": args.min_gain, "headroom": args.headroom,
        "maxGpus": 32})
    day_s = args.hours * 3600
    traffic = make_traffic(day_s, args.base_rps, args.seed)
    print_settings(args, spec, settings, traffic)
    evaluator = SearchEvaluator(spec, max_gpus=settings.max_gpus)
    peak_rps = 3 * args.base_rps * settings.headroom
    initial = plan_deployment(spec.model_copy(update={"workload": spec.workload.model_copy(
        update={"rate_rps": peak_rps})}), overrides=SearchOverrides(with_baselines=False))
    print(f"initial plan (code at {peak_rps:.1f} req/s): {ratio_text(initial)}, "
          f"{initial.num_gpus} GPUs", flush=True)
    strategies = [Strategy(name, initial) for name in ("static", "replica-only", "replanning")]
    for s in strategies:
        s.ttft_s = np.full(len(traffic.arrival_s), np.nan)
        s.tpot_s = np.full(len(traffic.arrival_s), np.nan)
    truth = build_context(spec, SearchOverrides(correction=Correction(
        args.true_prefill_factor, args.true_decode_factor)))
    max_len = get_model(spec.model.name).max_position
    per_window = round(args.score_s / args.interval_s)
    for k in range(int(day_s // args.interval_s)):
        start_s, end_s = k * args.interval_s, (k + 1) * args.interval_s
        if k > 0:
            move(strategies, traffic, start_s, settings, evaluator, max_len, spec, args.verbose)
        for s in strategies:
            serve(s, traffic, start_s, end_s, truth, args.warmup_s)
        if (k + 1) % per_window == 0:
            scored_from_s = end_s - args.score_s
            for s in strategies:
                score(s, traffic, scored_from_s, end_s, truth.slo)
            print_interval((k + 1) // per_window - 1, scored_from_s, args.score_s, day_s,
                           traffic, strategies)
    print_summary(strategies, spec.slo.attainment, args.score_s)
    print(f"load average: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} at "
          f"the start, {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end; run time "
          f"{time.monotonic() - started:.0f} s on {len(os.sched_getaffinity(0))} cores")
    if args.plot:
        plot(args.plot, strategies, args.score_s, spec.slo.attainment)


def move(strategies, traffic: Traffic, now_s: float, settings, evaluator, max_len, spec,
         verbose: bool = False) -> None:
    """Each adaptive strategy looks at the last window and may change its plan."""
    seen, seen_recent = {}, {}
    index = traffic.between(max(0.0, now_s - settings.window_seconds), now_s)
    recent_index = traffic.between(max(0.0, now_s - settings.window_seconds / RECENT_SHARE), now_s)
    for s in strategies:
        seen[s.name] = Seen(s.ttft_s[index], s.tpot_s[index])
        seen_recent[s.name] = Seen(s.ttft_s[recent_index], s.tpot_s[recent_index])
    slo = SLO(spec.slo.ttft_seconds, spec.slo.tpot_seconds, spec.slo.attainment, spec.slo.rule)
    observation = observe(traffic, now_s, settings.window_seconds, max_len, None, slo)
    for s in strategies:
        # NOTE: as the operator does, no decision while a move runs (its new instances
        # are not all serving yet)
        if s.name == "static" or (s.pieces and s.pieces[-1].from_s > now_s):
            continue
        seen_obs = observe_latencies(observation, seen[s.name], slo)
        seen_obs = replace(seen_obs, recent=observe_latencies(
            observation.recent, seen_recent[s.name], slo))
        if s.name == "replica-only":
            new = replica_only(s, seen_obs, now_s, settings, evaluator)
        else:
            decision = decide(seen_obs, s.plan, settings, s.state, evaluator)
            s.state = decision.state
            new = decision.plan if decision.action == "replan" else None
            if decision.action != "keep" or decision.kind or verbose:
                n = decision.numbers
                sized = (f" [sized {n.sized_rate_rps:.2f} req/s; latency x{n.prefill_factor:.2f}"
                         f" prefill, x{n.decode_factor:.2f} decode]" if n.sized_rate_rps else "")
                print(f"    (c) {now_s / 60:.0f} min {decision.action} {decision.kind or ''}: "
                      f"{decision.reason}{sized}")
        if new is not None:
            s.pieces = reshuffle_pieces(s.plan, new, now_s, settings.reload_seconds)
            if verbose:
                tag = "c" if s.name == "replanning" else "b"
                print(f"    ({tag}) move: " + ", ".join(
                    f"+{p.from_s - now_s:.0f} s {_roles(p.instances)} {p.gpus} GPUs"
                    for p in s.pieces))
            s.plan, s.reshuffles, s.last_move_s = new, s.reshuffles + 1, now_s


def observe_latencies(observation, seen: Seen, slo):
    """The shared traffic observation with one deployment's served latencies."""
    finite_ttft, finite_tpot = seen.ttft_s[np.isfinite(seen.ttft_s)], seen.tpot_s[np.isfinite(seen.tpot_s)]
    with np.errstate(invalid="ignore"):
        ok = (seen.ttft_s <= slo.ttft_s) & (seen.tpot_s <= slo.tpot_s)
    return replace(
        observation, attainment=float(ok.mean()) if len(ok) else None,
        ttft_p90_s=float(np.percentile(finite_ttft, 90)) if len(finite_ttft) else None,
        tpot_p90_s=float(np.percentile(finite_tpot, 90)) if len(finite_tpot) else None,
    )


def replica_only(s: Strategy, observation, now_s: float, settings, evaluator) -> Plan | None:
    """Copies of the same shape for the observed rate; down only after the cooldown."""
    if observation.num_requests < settings.min_requests:
        return None
    rate = observation.arrival_rate_rps * settings.headroom
    new = evaluator.scale(s.plan, observation, rate, Correction())
    if new is None or new.num_gpus == s.plan.num_gpus:
        return None
    if new.num_gpus < s.plan.num_gpus and now_s - s.last_move_s < settings.cooldown_seconds:
        return None
    return new


def serve(s: Strategy, traffic: Traffic, start_s, end_s, truth, warmup_s: float) -> None:
    """Simulate the interval's requests on what served them; count the GPUs held."""
    pieces = s.pieces or (Piece(-math.inf, tuple(plan_instances(s.plan, "now")), s.plan.num_gpus),)
    for k, piece in enumerate(pieces):
        until_s = pieces[k + 1].from_s if k + 1 < len(pieces) else math.inf
        lo, hi = max(start_s, piece.from_s), min(end_s, until_s)
        if hi <= lo:
            continue
        # NOTE: the same instances served the piece's requests before this interval: those
        # of the last warmup_s go first, so that a queue (a burst's) carries over
        carried_s = max(piece.from_s, lo - warmup_s)
        simulate(s, piece.instances, traffic, traffic.between(carried_s, hi), carried_s, truth,
                 keep_from_s=lo)
        s.gpu_s += piece.gpus * (hi - lo)


def score(s: Strategy, traffic: Traffic, start_s: float, end_s: float, slo) -> None:
    """Record the scored window's attainment and time-weighted GPUs."""
    index = traffic.between(start_s, end_s)
    with np.errstate(invalid="ignore"):
        ok = (s.ttft_s[index] <= slo.ttft_s) & (s.tpot_s[index] <= slo.tpot_s)
    s.attainment.append(float(ok.mean()) if len(ok) else 1.0)
    s.gpus.append(s.gpu_s / (end_s - start_s))
    s.gpu_s = 0.0


def _roles(instances) -> str:
    """How many prefill and decode instances serve, as `2P+1D`."""
    roles = [i.role for i in instances]
    return f"{roles.count('prefill')}P+{roles.count('decode')}D"


def gpus_of(instance: Instance) -> int:
    return sum(instance.node_to_gpus.values())


def reshuffle_pieces(old: Plan, new: Plan, now_s: float, reload_s: float) -> tuple[Piece, ...]:
    """What serves from now on, piece by piece (the last: the new plan, from when the
    move ends); see the module docstring."""
    nodes = [f"node-{i}" for i in range(NODES)]
    before, scheduled = reshuffle_steps(old, new, nodes, GPUS_PER_NODE)
    held = [(now_s, sum(gpus_of(i) for i in before))]  # (time, change of GPUs held)
    for step, started in scheduled:
        if step.action in ("create", "delete"):
            sign = 1 if step.action == "create" else -1
            held.append((now_s + started * reload_s, sign * gpus_of(step.instance)))
    serving = [(now_s + loading * reload_s, instances)
               for loading, instances in move_pieces(before, scheduled)]
    pieces = []
    for moment in sorted({t for t, _ in serving} | {t for t, _ in held}):
        instances = [i for t, i in serving if t <= moment][-1]
        gpus = sum(change for t, change in held if t <= moment)
        if not pieces or (instances, gpus) != (pieces[-1].instances, pieces[-1].gpus):
            pieces.append(Piece(moment, instances, gpus))
    # once the move ends, the new plan serves in its own instance order
    return (*pieces[:-1], replace(pieces[-1], instances=tuple(plan_instances(new, "new"))))


def simulate(
    s: Strategy, instances, traffic: Traffic, index: np.ndarray, start_s: float, truth,
    keep_from_s: float,
) -> None:
    """These requests served by these instances, from empty queues at start_s (failed
    where a phase has none); the latencies of those arriving from keep_from_s are kept."""
    if len(index) == 0:
        return
    kept = index[traffic.arrival_s[index] >= keep_from_s]
    served = serving_unit(truth, instances)
    if served is None:
        s.ttft_s[kept], s.tpot_s[kept] = math.inf, math.inf
        return
    trace = Trace(traffic.arrival_s[index] - start_s, traffic.prompt_tokens[index],
                  traffic.output_tokens[index])
    result = simulate_unit(truth, served, trace)
    mine = len(index) - len(kept)
    s.ttft_s[kept], s.tpot_s[kept] = result.ttft_s[mine:], result.tpot_s[mine:]


def print_settings(args, spec, settings, traffic: Traffic) -> None:
    """The day and the settings every strategy runs under."""
    print(f"replan: OPT-66B on 4 x 8 A100-80GB, SLO TTFT {spec.slo.ttft_seconds} s TPOT "
          f"{spec.slo.tpot_seconds} s for {spec.slo.attainment:.0%}; {args.hours} h, "
          f"{len(traffic.arrival_s)} requests, base {args.base_rps} req/s (3x at noon, one 2x "
          f"burst), seed {args.seed}")
    print(f"  interval {settings.interval_seconds:.0f} s, window {settings.window_seconds:.0f} s, "
          f"hold {settings.hold_seconds:.0f} s, cooldown {settings.cooldown_seconds:.0f} s, "
          f"reload {settings.reload_seconds:.0f} s, min gain {settings.min_gain:.0%}, headroom "
          f"{settings.headroom}, budget {settings.max_gpus} GPUs; search: "
          f"{spec.planner.num_requests} requests per trial, {spec.planner.workers} workers; "
          f"true latency = model x (prefill {args.true_prefill_factor}, decode "
          f"{args.true_decode_factor}); scored per {args.score_s:.0f} s window, queues "
          f"carried over {args.warmup_s:.0f} s", flush=True)


def print_interval(
    k: int, start_s: float, interval_s: float, day_s: float, traffic: Traffic, strategies
) -> None:
    mix = mix_at(start_s / day_s)
    mix_text = "/".join(f"{m:.0%}" for m in mix)
    cells = " | ".join(
        f"{s.name[:7]:<7} {s.attainment[-1]:6.1%} {s.gpus[-1]:4.1f} GPUs" for s in strategies
    )
    rate_rps = len(traffic.between(start_s, start_s + interval_s)) / interval_s
    print(f"  window {k:2d} t={start_s / 60:4.0f} min {rate_rps:4.1f} req/s mix "
          f"{'/'.join(a[:4] for a in APPS)} {mix_text:<12} | {cells}", flush=True)


def print_summary(strategies, target: float, interval_s: float) -> None:
    for label, s in zip("abc", strategies, strict=True):
        meeting = sum(a >= target for a in s.attainment)
        gpu_hours = sum(s.gpus) * interval_s / 3600
        print(f"({label}) {s.name:<12} windows meeting the target {meeting}/{len(s.attainment)} "
              f"({meeting / len(s.attainment):.1%}); GPU-hours {gpu_hours:.1f}; reshuffles "
              f"{s.reshuffles}; final plan {ratio_text(s.plan)} ({s.plan.num_gpus} GPUs)")


def plot(path: str, strategies, interval_s: float, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for s in strategies:
        minutes = np.arange(len(s.attainment)) * interval_s / 60
        top.step(minutes, s.attainment, where="post", label=s.name)
        bottom.step(minutes, s.gpus, where="post", label=s.name)
    top.axhline(target, color="grey", linestyle="--", label="target")
    top.set_ylabel("SLO attainment per window")
    bottom.set_ylabel("GPUs")
    bottom.set_xlabel("minutes")
    top.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=2.5)
    parser.add_argument("--base-rps", type=float, default=2.0)
    parser.add_argument("--interval-s", type=float, default=60,
                        help="seconds between two decisions (the spec's intervalSeconds)")
    parser.add_argument("--score-s", type=float, default=300,
                        help="seconds of the windows attainment and GPUs are scored on")
    parser.add_argument("--warmup-s", type=float, default=120,
                        help="seconds of a piece's earlier requests simulated again ahead of "
                        "each interval's (its queues carry over)")
    parser.add_argument("--window-s", type=float, default=900)
    parser.add_argument("--hold-s", type=float, default=300)
    parser.add_argument("--cooldown-s", type=float, default=900)
    parser.add_argument("--reload-s", type=float, default=180)
    parser.add_argument("--min-gain", type=float, default=0.15)
    parser.add_argument("--headroom", type=float, default=1.2)
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--true-prefill-factor", type=float, default=1.0)
    parser.add_argument("--true-decode-factor", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write a PNG of attainment and GPUs")
    parser.add_argument("--verbose", action="store_true", help="print every decision of (c)")
    args = parser.parse_args()
    ratio = args.score_s / args.interval_s
    if ratio < 1 or abs(ratio - round(ratio)) > 1e-9:
        parser.error(f"--score-s ({args.score_s:g}) must be a whole multiple of --interval-s "
                     f"({args.interval_s:g})")
    return args


if __name__ == "__main__":
    main()
