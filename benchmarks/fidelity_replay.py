"""Predict the runs `distserve fidelity --save DIR` wrote once more, offline, with each
way the simulator can be corrected, side by side: how close each comes to what was
measured, on the very same runs (no deployment runs here, and the host's mood of the
day is the same for every variant).

As `fidelity` does, each run after a deployment's first (its calibration) is predicted
from the run just before it: that run's iterations fitted against the profile
(`local.calibration`), then the simulator run on the requests the run sent, at its rate.
The variants:
- one factor a phase: each phase's ratio of sums over the run's mix of idle and busy
  neighbours, as before the slowdown was modelled;
- with the slowdown: each runner's speed alone, and x(1 + slowdown x the share of the
  other instances busy) (`simulator.host`); a run whose instances were never idle apart
  keeps the slowdown of the run before, as `fidelity` does;
each at a steady speed and with the run's drift (the median over DRIFT_DRAWS histories,
what `fidelity` prints). Then the same fitted on every run before it together (the
deployment's history pooled), and on each run's own iterations (hindsight: the policies
held apart from how the speed moved between runs), there also replaying the run's speed
as it moved, window by window (`calibration.fit_history`, what `fidelity` prints beside
each run: the policies held apart from how the speed moved within the run too). Prints,
per run, the
measured figures and each variant's gaps, and per variant the runs and figures within
the goal (attainment within 2 points, percentiles within 10%: `report.goals_met`). Per
pair of runs in a row it prints how much slower the very same prefill batches (same
prompt lengths, same instance) ran in the second, in CPU time and in wall time: the
speed's level moving between runs, apart from the batches each formed. Runs
saved with the router admitting by predicted TTFT (`fidelity --admit-by-ttft`) are
predicted with that admission too. It asserts nothing.

    .venv/bin/distserve fidelity -f examples/local.yaml --save /tmp/fid-runs
    .venv/bin/python benchmarks/fidelity_replay.py /tmp/fid-runs [-f examples/local.yaml]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from distserve.cli.fidelity import load_run
from distserve.cli.up import _choose_profile
from distserve.local.calibration import fit_drift, fit_history, fit_window, same_batches
from distserve.local.prediction import LocalShape, engine_context, median_of, predict_draws
from distserve.local.report import GOAL_PERCENTILES, goals_met, summarize
from distserve.local.settings import (
    find_model_path,
    instance_counts,
    instance_parallel,
    serve_settings,
)
from distserve.search import build_context, plan_deployment
from distserve.spec import load_manifest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
VARIANTS = ("one factor a phase, steady", "one factor a phase, drift",
            "with the slowdown, steady", "with the slowdown, drift")
# the run's own speed window by window (`fit_history`): hindsight only
AS_IT_RAN = ("one factor a phase, as it ran", "with the slowdown, as it ran")


def fitted_contexts(profiled, shape, doc: dict, known_slowdown: float,
                    with_history: bool = True) -> dict:
    """{variant: the context a prediction from this run runs with} (with_history: the
    AS_IT_RAN ones too, replayed only on the run itself), and the slowdown the next run
    keeps where it cannot tell one."""
    items, started_s, ended_s = doc["iterations"], doc["started_s"], doc["ended_s"]
    slowed = fit_window(profiled, shape, items, started_s, busy_slowdown=known_slowdown)
    mixed = fit_window(profiled, shape, items, started_s, tell_slowdown=False)
    contexts = {}
    for tag, fit in (("one factor a phase", mixed), ("with the slowdown", slowed)):
        drift, _ = fit_drift(profiled, shape, items, fit, started_s, ended_s)
        contexts[f"{tag}, steady"] = dataclasses.replace(profiled, correction=fit.correction,
                                                         drift=None)
        contexts[f"{tag}, drift"] = dataclasses.replace(profiled, correction=fit.correction,
                                                        drift=drift)
        if with_history:
            history = fit_history(profiled, shape, items, fit, started_s, ended_s)
            contexts[f"{tag}, as it ran"] = dataclasses.replace(
                profiled, correction=fit.correction, drift=history)
    return {"contexts": contexts, "slowed": slowed, "mixed": mixed}


def pool(docs: list[dict]) -> dict:
    """The runs as one: every instance's iterations of them all, from the first's start
    to the last's end."""
    iterations: dict[str, list] = {}
    for doc in docs:
        for name, items in doc["iterations"].items():
            iterations.setdefault(name, []).extend(items)
    return {"iterations": iterations, "started_s": docs[0]["started_s"],
            "ended_s": docs[-1]["ended_s"]}


def gaps_text(measured, predicted) -> str:
    """The attainment gap in points and each percentile's in %, and the goals met."""
    within = goals_met(measured, predicted)
    parts = [f"{(predicted.attainment - measured.attainment) * 100:+6.1f} pt"]
    for _, field, p in GOAL_PERCENTILES:
        m, s = getattr(measured, field)[p], getattr(predicted, field)[p]
        parts.append(f"{(s - m) / m:+7.1%}" if m else "    n/a")
    return "  ".join(parts) + f"   {sum(within.values())}/{len(within)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="where `distserve fidelity --save` wrote its runs")
    parser.add_argument("-f", "--file", default=str(EXAMPLES / "local.yaml"),
                        help="the spec the runs were made with (default examples/local.yaml)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="the latency profile (default: this machine's cached one)")
    args = parser.parse_args()
    paths = sorted(Path(args.dir).glob("*.json"))
    if not paths:
        print(f"error: no runs (*.json) in {args.dir}", file=sys.stderr)
        return 2
    manifest = load_manifest(args.file)
    spec = manifest.spec
    model_path = find_model_path(spec)
    source = _choose_profile(argparse.Namespace(profile=args.profile, no_measure=True), spec,
                             model_path)
    spec.planner.profile_path = source.path
    plan = plan_deployment(spec)
    slo = spec.slo
    print(f"profile: {source.describe()}")
    by_deployment: dict[str, list[dict]] = {}  # in the order they ran
    for doc in sorted(map(load_run, paths), key=lambda doc: doc["started_s"]):
        by_deployment.setdefault(doc["deployment"], []).append(doc)
    whens = ("from the run before", "from every run before", "own (hindsight)")
    tallies = {f"{when}: {v}": [] for when in whens for v in VARIANTS}
    tallies |= {f"{whens[-1]}: {v}": [] for v in AS_IT_RAN}
    for deployment, docs in by_deployment.items():
        n = docs[0]["num_colocated"]
        # runs saved before the router could admit by TTFT admitted by the waiting bound
        spec.router.admit_by_ttft = docs[0].get("admit_by_ttft", False)
        settings = serve_settings(spec, instance_counts(spec, plan, n), manifest.metadata.name,
                                  model_path, instance_parallel(spec, plan, n),
                                  plan if not n else None)
        shape = LocalShape.from_settings(settings)
        profiled = engine_context(build_context(spec), settings)
        fits, pooled, known = [], [], 0.0
        for k, doc in enumerate(docs):
            fits.append(fitted_contexts(profiled, shape, doc, known))
            known = fits[-1]["slowed"].busy_slowdown
            pooled.append(fitted_contexts(profiled, shape, pool(docs[:k + 1]), 0.0,
                                          with_history=False))
        print(f"\n{shape.describe()} ({deployment}): {len(docs)} runs")
        for doc, fit in zip(docs, fits, strict=True):
            print(f"  {doc['label']} at {doc['rate']:g} req/s: one factor a phase "
                  f"{fit['mixed'].correction.describe()}; with the slowdown "
                  f"{fit['slowed'].correction.describe()}")
        for before, after in zip(docs, docs[1:], strict=False):
            same = same_batches(before["iterations"], after["iterations"],
                                (before["started_s"], before["ended_s"]),
                                (after["started_s"], after["ended_s"]))
            print(f"  the same prefill batches in {after['label']} as in {before['label']}: "
                  f"{same.describe()}")
        header = ("attainment  " + "  ".join(f"{label:>7s}" for label, _, _ in GOAL_PERCENTILES)
                  + "   goals")
        for k in range(1, len(docs)):
            doc, rate = docs[k], docs[k]["rate"]
            measured = summarize(doc["outcomes"], rate, slo.ttft_seconds, slo.tpot_seconds)
            print(f"\n  {doc['label']} at {rate:g} req/s, {measured.num_requests} requests: "
                  f"measured attainment {measured.attainment:.1%}, TTFT p50/p90 "
                  f"{measured.ttft_p_s[50]:.3f}/{measured.ttft_p_s[90]:.3f} s, TPOT p50/p90 "
                  f"{measured.tpot_p_s[50]:.3f}/{measured.tpot_p_s[90]:.3f} s")
            print(f"  {'gap: simulated less measured':58s}  {header}")
            for when, source_fit in zip(whens, (fits[k - 1], pooled[k - 1], fits[k]),
                                        strict=True):
                for variant in VARIANTS + (AS_IT_RAN if when == whens[-1] else ()):
                    ctx = source_fit["contexts"][variant]
                    predicted = median_of(predict_draws(ctx, shape, doc["requests"], rate))
                    tallies[f"{when}: {variant}"].append((measured, predicted))
                    print(f"  {when + ', ' + variant:58s}  " + gaps_text(measured, predicted))
    print("\nwithin the goal (2 pt, 10%), over every run above:")
    for name, pairs in tallies.items():
        verdicts = [goals_met(m, p) for m, p in pairs]
        attainment = sum(v["attainment"] for v in verdicts)
        percentiles = sum(v[label] for v in verdicts for label, _, _ in GOAL_PERCENTILES)
        print(f"  {name:60s} attainment {attainment}/{len(pairs)}, percentiles "
              f"{percentiles}/{len(pairs) * len(GOAL_PERCENTILES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
