"""`distserve fidelity -f SPEC`: the simulator held to a real deployment on this machine.

Samples the spec's workload (lengths, Poisson arrivals at 1 req/s scaled to each rate)
and replays it on the deployment as `distserve up` launches it: the plan's prefill and
decode instances, then `--colocated N` colocated instances (the baseline). Per deployment:
1. Calibration (`--calibrate-requests`, 0 to skip): the requests after those replayed, at
   half the simulated knee; every batch the instances' runners ran is set beside the
   profile's time for the same batch (`local.calibration`), and the ratio per phase is a
   correction the simulator runs with. The profile times a bare runner; serving shares
   its cores with HTTP threads, KV exports, the router and the clients. Each later rate
   is predicted with the factors of the run just before it (the calibration, then the
   previous rate): this machine's speed drifts by ~10% within minutes. How far it moved
   within that run is fitted too (`calibration.fit_drift`), and each prediction is the
   median over DRIFT_DRAWS histories of that drift, their range printed beside it. The
   runners slow each other down (they share the host): the fit tells by how much each
   runs slower while the other instances are busy, its factors being each runner's
   speed alone, and the simulator slows each as busy as the others are at the rate it
   predicts (`simulator.host`); a run whose instances were seldom idle apart keeps the
   slowdown told before.
2. The knee: the highest rate at which the simulator meets the SLO target in steady state,
   judged on KNEE_TRACE_REQUESTS requests (a short trace scaled to a high rate is one
   burst that drains, not a rate the deployment sustains).
3. `--requests` of the sample replayed at x0.75, x1 and x1.25 the knee, or at `--rates`.
   Beside each measured figure (attainment, TTFT and TPOT p50 and p90) it prints the
   simulator's for the same requests at the same times, the gap, whether the gap is within
   the goal (attainment within 2 points, percentiles within 10%), the simulator's
   figures with the profile as measured and with the run's own iteration factors, at a
   steady speed and with the run's drift (the latency model's error told from the rest,
   and what the drift moves; each with the count of prefill iterations
   the simulator ran, to set against the instances' own: the same policy forms the same
   batches), and the 1-minute load average over the run. Then the simulator replaying
   the run's speed as it moved, window by window (`calibration.fit_history`: prefill's
   per 10 s, decode's per 2 s), with its gaps: with the speed known, what is left is
   the simulator's policies against the engine's, apart from how well the speed was
   foreseen. Then how much slower the very same prefill batches (same prompt lengths,
   same instance) ran than in the run before (`calibration.same_batches`): the speed's
   level moving between runs, which a prediction made before the run cannot know and
   which its gap at the knee follows. Then the same comparison over
   the run's requests after its first IN_RUN_REQUESTS, simulated with the factors of
   the iterations the instances ran while those first ones arrived: the runners' speed
   of that very run, as the analyzer corrects its model online from what it observes.
4. Per deployment, a line counts the runs whose figures the simulator met within the
   goal, figure by figure (`report.format_tally`), and another the same replaying each
   run's speed as it moved.
5. `--repeat N`: each rate is replayed N times in a row (after a calibration, each
   predicted with the factors of the run before it), then the replays side by side: how
   far apart the measured figures of the same requests at the same times lie, and
   whether one figure could be within the goal of every replay, with the gaps of the
   prediction and of each replay replayed at its own speed as it moved. Where the
   deployment itself does not repeat within the goal, no prediction made before it can
   meet it.
6. `--save DIR`: each run (its requests, what the client saw of each, every instance's
   iterations) is written as JSON, for `benchmarks/fidelity_replay.py` to predict again
   offline with each way of correcting the simulator, side by side on the same runs.
The latency profile is the one `distserve up` plans with (this machine's, measured on
first use and cached; `--profile FILE`, `--no-measure`); its fit error is printed first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from distserve.spec import load_manifest

NAME = "fidelity"
HELP = "Replay one trace on this machine's deployment at three rates; print measured beside simulated."
KNEE_FACTORS = (0.75, 1.0, 1.25)
KNEE_TRACE_REQUESTS = 600  # the knee is judged in steady state on at least this many
# NOTE: replayed as long as the knee is judged on: 120 requests at x1.25 the knee on
# SmolLM2 were over before a queue grew to miss the SLOs, and every rate read 100% on
# both sides; 600 read 83.2% against 83.5% at the knee (with that run's own factors)
DEFAULT_REQUESTS = KNEE_TRACE_REQUESTS
DEFAULT_CALIBRATION_REQUESTS = 40
IN_RUN_REQUESTS = 100  # a run's first requests whose iterations predict the rest of it
CALIBRATION_KNEE_FACTOR = 0.5  # calibrate below the knee: iterations, not queues, are fitted
DEFAULT_COLOCATED = 2
WARMUP_REQUESTS = 2  # first requests of a fresh process pay one-time costs: not measured


def add_arguments(parser) -> None:
    """Options of `distserve fidelity`."""
    parser.add_argument("-f", "--file", required=True, metavar="SPEC", help="DistServeDeployment YAML")
    parser.add_argument("--rates", default=None, metavar="R1,R2,R3",
                        help="rates in req/s (default: x0.75, x1, x1.25 the simulated knee of each deployment)")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS,
                        help=f"requests in the trace, replayed at every rate (default {DEFAULT_REQUESTS})")
    parser.add_argument("--calibrate-requests", type=int, default=DEFAULT_CALIBRATION_REQUESTS,
                        metavar="N",
                        help="requests of another sample replayed first, whose iterations fit the "
                             f"profile's correction (default {DEFAULT_CALIBRATION_REQUESTS}; 0: the "
                             "profile as measured)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="replay the trace N times at every rate, then print how far apart "
                             "the replays' measured figures lie: no prediction can be closer to "
                             "each of them than that (default 1)")
    parser.add_argument("--colocated", type=int, default=DEFAULT_COLOCATED, metavar="N",
                        help=f"also run N colocated instances (default {DEFAULT_COLOCATED}; 0: skip)")
    parser.add_argument("--no-disaggregated", action="store_true",
                        help="skip the plan's prefill and decode instances")
    parser.add_argument("--port", type=int, default=8000, help="port of the router (instances use the next ones)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="plan and predict with this latency profile instead of this machine's cached one")
    parser.add_argument("--no-measure", action="store_true",
                        help="do not measure this machine's profile on first use (as `distserve up`)")
    parser.add_argument("--admit-by-ttft", action="store_true",
                        help="as if the spec's router.admitByTtft were true: the router refuses a "
                             "request whose queue ahead it predicts would delay its first token "
                             "past the TTFT SLO, and the simulator with it")
    parser.add_argument("--save", default=None, metavar="DIR",
                        help="write each run (its requests, what the client saw of each, and the "
                             "instances' iterations) to DIR as JSON, to predict again offline "
                             "(benchmarks/fidelity_replay.py)")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _say(line: str) -> None:
    print(line, flush=True)


def run(args) -> int:
    """Plan, sample the trace, then for each deployment launch it and compare per rate."""
    from distserve.cli.up import EXIT_LAUNCH_ERROR, EXIT_USAGE_ERROR, _choose_profile
    from distserve.local.launcher import LaunchError
    from distserve.local.settings import find_model_path
    from distserve.search import NoFeasiblePlan, plan_deployment

    manifest = load_manifest(args.file)
    spec = manifest.spec
    if args.admit_by_ttft:
        spec.router.admit_by_ttft = True
    model_path = find_model_path(spec)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rates = [float(r) for r in args.rates.split(",")] if args.rates else None
        if rates is not None and (len(rates) == 0 or min(rates) <= 0):
            raise ValueError(f"--rates must be positive req/s, got {args.rates!r}")
        if args.requests < 1 or args.calibrate_requests < 0:
            raise ValueError(f"--requests must be >= 1 and --calibrate-requests >= 0, got "
                             f"{args.requests} and {args.calibrate_requests}")
        if args.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
        if args.save:
            try:
                Path(args.save).mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ValueError(f"--save {args.save!r}: cannot make that folder: {err}") from err
        source = _choose_profile(args, spec, model_path)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    spec.planner.profile_path = source.path
    _say(f"profile: {source.describe()}")
    _say(f"  fit error: {fit_error_text(source.path)}")
    try:
        plan = plan_deployment(spec)
    except NoFeasiblePlan as err:
        if not spec.placement:
            print(f"error: no feasible plan: {err}", file=sys.stderr)
            return 1
        plan = None
        _say(f"planner: no feasible plan ({err}); running the spec's placement")
    knee_trace = _sample_trace(spec, max(args.requests, KNEE_TRACE_REQUESTS))
    trace = knee_trace.at_rate(1.0, args.requests)
    calibration = (_sample_trace(spec, args.calibrate_requests, skip=args.requests)
                   if args.calibrate_requests else None)
    _say(f"trace: {trace.num_requests} requests of the spec's workload, replayed at every rate "
         f"(the knee judged on {knee_trace.num_requests}); SLOs TTFT <= {spec.slo.ttft_seconds} s, "
         f"TPOT <= {spec.slo.tpot_seconds} s, target {spec.slo.attainment:.0%}"
         + ("; the router refuses requests it predicts would miss the TTFT SLO"
            if spec.router.admit_by_ttft else ""))
    shapes = [] if args.no_disaggregated else [0]
    shapes += [args.colocated] if args.colocated else []
    try:
        for offset, num_colocated in enumerate(shapes):
            compare_deployment(spec, plan, manifest.metadata.name, model_path, num_colocated,
                               trace, rates, args.port + 10 * offset, knee_trace=knee_trace,
                               calibration=calibration, repeat=args.repeat,
                               save_dir=Path(args.save) if args.save else None)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_LAUNCH_ERROR
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _log("stopping ...")
        return 130
    return 0


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def fit_error_text(path: str | None) -> str:
    """The profile's recorded fit error, in words."""
    if path is None:
        return "none recorded (no profile file)"
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return f"unreadable ({path})"
    errors = doc.get("fit_error")
    if not isinstance(errors, dict) or not errors:
        return "not recorded in the profile"
    return ", ".join(
        f"{phase} mean {e.get('mean_rel', float('nan')):.1%} max {e.get('max_rel', float('nan')):.1%}"
        for phase, e in errors.items() if isinstance(e, dict))


def _sample_trace(spec, num_requests: int, skip: int = 0):
    """num_requests of the spec's workload at 1 req/s (Poisson), each fitting the context;
    skip: the first `skip` of the sample are left out (another part of the same sample:
    a trace-ordered workload replays from its first request), arrivals from the last one
    left out."""
    from distserve.local.prediction import trace_of
    from distserve.workload import Request, make_workload

    w = spec.workload
    workload = make_workload(w.dataset, w.trace_path, w.arrival if w.arrival != "trace" else "poisson", w.cv)
    max_len = (spec.model.max_model_len or 2048) - 1
    sample = workload.sample(1.0, skip + num_requests, seed=spec.planner.seed)
    start_s = sample[skip - 1].arrival_s if skip else 0.0
    requests = [Request(r.req_id - skip, r.arrival_s - start_s, r.prompt_tokens, r.output_tokens)
                for r in sample[skip:] if r.prompt_tokens + r.output_tokens <= max_len]
    return trace_of(requests)


def compare_deployment(spec, plan, name: str, model_path: str, num_colocated: int, trace,
                       rates: list[float] | None, port: int, drive_fn=None, launch=None,
                       knee_trace=None, calibration=None, iterations_fn=None,
                       repeat: int = 1, save_dir: Path | None = None) -> list[tuple]:
    """Launch one deployment (the plan's, or with no plan the spec's placement), calibrate
    on `calibration` (a trace at 1 req/s, or None), replay `trace` at each rate (around
    the knee judged on `knee_trace`, default `trace`) `repeat` times in a row, then the
    replays side by side; print and return (rate, measured, predicted, load) per replay.
    drive_fn(url, requests) -> outcomes, launch(settings, port) -> a context manager with
    .url, and iterations_fn(launcher) -> {instance name: [Iteration]} replace the HTTP load
    generator, the processes and the instances' /debug/iterations (tests). save_dir: each
    run is written there too (`save_run`)."""
    from distserve.local.calibration import (
        as_it_ran,
        fetch_iterations,
        fit_drift,
        fit_window,
        same_batches,
    )
    from distserve.local.launcher import LocalLauncher
    from distserve.local.prediction import KNEE_DROP, LocalShape, engine_context, predicted_knee_rps
    from distserve.local.report import format_replays, format_tally
    from distserve.local.settings import instance_counts, instance_parallel, serve_settings
    from distserve.search import build_context
    from distserve_engine.instance.iterations import ITERATION_HISTORY

    settings = serve_settings(spec, instance_counts(spec, plan, num_colocated), name, model_path,
                              instance_parallel(spec, plan, num_colocated),
                              plan if not num_colocated else None)
    shape = LocalShape.from_settings(settings)
    profiled = engine_context(build_context(spec), settings)
    estimate_rps = (plan.goodput_rps if plan else 0.0) or spec.workload.rate_rps or 1.0
    knee_trace = knee_trace or trace
    rows, replayed = [], []  # replayed: (measured, as the run's speed replayed)
    launch = launch or (lambda settings, port: LocalLauncher(settings, port=port))
    iterations_fn = iterations_fn or fetch_iterations
    with launch(settings, port) as launcher:
        _log(f"  {shape.describe()} serving at {launcher.url}")
        _drive(launcher.url, spec, trace.at_rate(1.0), drive_fn, WARMUP_REQUESTS)
        ctx = profiled

        def iterations_since(started_s: float) -> dict:
            """{instance: the iterations it logged}, with a note where a log no longer
            holds started_s."""
            name_to_items = iterations_fn(launcher)
            for name, items in name_to_items.items():
                if len(items) >= ITERATION_HISTORY and items[0].started_s > started_s:
                    _say(f"  note: {name} keeps its last {ITERATION_HISTORY} iterations, which "
                         f"began {items[0].started_s - started_s:.0f} s into the window: the fit "
                         "is of those")
            return name_to_items

        def fit_between(name_to_items: dict, started_s: float, until_s: float = math.inf):
            """The fit of the iterations the instances ran from started_s until until_s
            (with the slowdown beside busy instances the last fit told, where these
            iterations cannot tell it)."""
            return fit_window(profiled, shape, name_to_items, started_s, until_s,
                              ctx.correction.busy_slowdown)

        previous = None  # the run before: (its name, its instances' iterations, its window)
        if calibration is not None:
            knee_rps, _ = predicted_knee_rps(profiled, shape, knee_trace, estimate_rps)
            rate = round(max(knee_rps, 0.01) * CALIBRATION_KNEE_FACTOR, 3)
            started_s = time.time()
            outcomes = _drive(launcher.url, spec, calibration.at_rate(rate), drive_fn)
            ended_s = time.time()
            name_to_items = iterations_since(started_s)
            if save_dir is not None:
                save_run(save_dir, num_colocated, "calibration", rate, calibration.at_rate(rate),
                         outcomes, name_to_items, started_s, ended_s, settings.admit_by_ttft)
            previous = ("the calibration", name_to_items, (started_s, ended_s))
            fit = fit_between(name_to_items, started_s)
            drift, _ = fit_drift(profiled, shape, name_to_items, fit, started_s, ended_s)
            ctx = dataclasses.replace(profiled, correction=fit.correction, drift=drift)
            _say(f"\n{shape.describe()}: calibration, {calibration.num_requests} requests of another "
                 f"sample at {rate:g} req/s; the runner's iterations against the profile's time "
                 f"for the same batches: {fit.describe()}; the speed's drift: "
                 f"{drift.describe()}; the simulator runs with this correction and drift")
        knee_rps, judged_by = predicted_knee_rps(ctx, shape, knee_trace, estimate_rps)
        if not rates and knee_rps <= 0:
            raise ValueError(f"{shape.describe()}: the simulated attainment has no knee on this "
                             "trace; give --rates")
        at_rates = rates or [round(knee_rps * f, 3) for f in KNEE_FACTORS]
        unloaded = f"unloaded the simulator meets the SLOs for {judged_by + KNEE_DROP:.0%}"
        if judged_by == spec.slo.attainment:
            why = ""
        elif knee_rps <= 0:
            why = f" ({unloaded}; no rate has a knee)"
        else:
            why = f" ({unloaded}; the knee is where that falls to {judged_by:.0%})"
        _say(f"\n{shape.describe()}: simulated knee {knee_rps:.3f} req/s{why}; rates "
             + ", ".join(f"{r:g}" for r in at_rates) + " req/s")
        factors_from = "the calibration" if calibration is not None else None
        for rate in at_rates:
            replays, as_rans = [], []
            for replay in range(repeat):
                started_s = time.time()
                row, outcomes, draws = _compare_at(launcher.url, spec, ctx, shape, trace, rate,
                                                   drive_fn)
                ended_s = time.time()
                rows.append(row)
                replays.append((row[1], row[2]))
                if repeat > 1:
                    _say(f"\nreplay {replay + 1} of {repeat} at {rate:g} req/s")
                name_to_items = iterations_since(started_s)
                if save_dir is not None:
                    save_run(save_dir, num_colocated, f"rate-{len(rows)}", rate,
                             trace.at_rate(rate), outcomes, name_to_items, started_s, ended_s,
                             settings.admit_by_ttft)
                run_fit = fit_between(name_to_items, started_s)
                drift, speeds = fit_drift(profiled, shape, name_to_items, run_fit, started_s,
                                          ended_s)
                own, as_ran = _report(spec, shape, trace, row, draws, ctx, profiled,
                                      factors_from, run_fit, speeds, drift,
                                      as_it_ran(profiled, shape, name_to_items, started_s,
                                                ended_s))
                if previous is not None:
                    same = same_batches(previous[1], name_to_items, previous[2],
                                        (started_s, ended_s))
                    _say(f"  the same prefill batches as in {previous[0]}: {same.describe()}")
                previous = (f"the run before ({rate:g} req/s)", name_to_items,
                            (started_s, ended_s))
                if as_ran is not None:
                    replayed.append((row[1], as_ran))
                as_rans.append(as_ran)
                if trace.num_requests >= 2 * IN_RUN_REQUESTS:
                    first_s = float(trace.at_rate(rate).arrival_s[IN_RUN_REQUESTS])
                    _report_in_run(spec, shape, trace, row, outcomes, ctx, profiled,
                                   fit_between(name_to_items, started_s, started_s + first_s))
                if factors_from is not None and own is not None:  # the next run: the freshest factors
                    ctx, factors_from = own, f"the run at {rate:g} req/s"
            if repeat > 1:
                _say("\n" + format_replays(shape.describe(), rate, replays, None
                                            if None in as_rans else as_rans))
    _say("\n" + format_tally(shape.describe(), [(row[1], row[2]) for row in rows]))
    if replayed:
        _say(format_tally(shape.describe(), replayed, ", replaying each run's speed as it "
                          "moved (the policies held apart from how well the speed was "
                          "foreseen),"))
    return rows


def save_run(save_dir: Path, num_colocated: int, label: str, rate: float, trace, outcomes,
             name_to_items: dict, started_s: float, ended_s: float,
             admit_by_ttft: bool = False) -> Path:
    """Write one run to save_dir/<deployment>-<label>.json: the deployment (colocated
    instances, 0: the plan's prefill and decode) and whether its router admitted by
    predicted TTFT, the rate, the requests sent, what the client saw of each, and every
    instance's iterations from started_s on."""
    from distserve.local.prediction import requests_of

    deployment = f"colocated-{num_colocated}" if num_colocated else "disaggregated"
    doc = {
        "deployment": deployment, "num_colocated": num_colocated, "admit_by_ttft": admit_by_ttft,
        "label": label, "rate": rate, "started_s": started_s, "ended_s": ended_s,
        "requests": [[r.req_id, r.arrival_s, r.prompt_tokens, r.output_tokens]
                     for r in requests_of(trace)],
        "outcomes": [dataclasses.asdict(o) for o in outcomes],
        "iterations": {name: [i.to_dict() for i in items if i.started_s >= started_s]
                       for name, items in name_to_items.items()},
    }
    save_dir.mkdir(parents=True, exist_ok=True)
    path = save_dir / f"{deployment}-{label}.json"
    path.write_text(json.dumps(doc))
    return path


def load_run(path: Path) -> dict:
    """A run `save_run` wrote: the same document, its requests as `workload.Request`, its
    outcomes as `local.load.Outcome` and its iterations as `Iteration`."""
    from distserve.local.load import Outcome
    from distserve.workload import Request
    from distserve_engine.instance.iterations import Iteration

    doc = json.loads(Path(path).read_text())
    doc["requests"] = [Request(int(i), float(a), int(p), int(o)) for i, a, p, o in doc["requests"]]
    doc["outcomes"] = [Outcome(**o) for o in doc["outcomes"]]
    doc["iterations"] = {name: [Iteration.from_dict(i) for i in items]
                         for name, items in doc["iterations"].items()}
    return doc


def _report(spec, shape, trace, row: tuple, draws, ctx, profiled, factors_from: str | None,
            run_fit, speeds, drift, as_it_ran):
    """Print one rate's comparison: measured beside simulated (the median of the `draws`
    of the speed's drift, whose range follows), the factors and drift the prediction used
    (from `factors_from`, None: the profile as measured) and the figures with the profile
    as measured, then the run's own iteration factors, how far the speed moved between
    windows of the run (`speeds`, `RunSpeeds`), its `drift`, and the figures with the
    run's own factors, at a steady speed and with that drift (what the drift alone
    moves), and replaying its speed window by window (`as_it_ran`: the context
    `calibration.as_it_ran` makes), with the gaps. Returns the context with the run's own
    factors and drift, and the figures replaying its speed (both None when a phase ran
    no iteration)."""
    from distserve.local.prediction import predict_run, requests_of
    from distserve.local.report import format_comparison, format_draws, format_gaps, format_other

    rate = row[0]
    text = format_comparison(shape.describe(), *row, spec.slo.attainment)
    if len(draws) > 1:
        text += "\n" + format_draws(draws, row[1])
    sent = requests_of(trace.at_rate(rate))
    if factors_from is not None:
        text += (f"\n  simulated with the factors of {factors_from}: "
                 f"{ctx.correction.describe()}; drift "
                 f"{ctx.drift.describe() if ctx.drift else 'none'}")
        text += "\n" + format_other("with the profile as measured",
                                     predict_run(profiled, shape, sent, rate))
    text += f"\n  this run's iterations against the profile: {run_fit.describe()}"
    if speeds.phase_to_speeds and max(len(v) for v in speeds.phase_to_speeds.values()) > 1:
        text += (f"\n  this run's speed per {speeds.window_s:g} s window, against its own "
                 f"factors: {speeds.describe()}")
    text += f"\n  this run's drift: {drift.describe()}"
    own = as_ran = None
    if all(fit.num_iterations for fit in run_fit.phases):
        own = dataclasses.replace(profiled, correction=run_fit.correction, drift=drift)
        text += "\n" + format_other("with this run's own factors, steady", predict_run(
            dataclasses.replace(own, drift=None), shape, sent, rate))
        text += "\n" + format_other("with this run's own factors and drift",
                                     predict_run(own, shape, sent, rate))
        as_ran = predict_run(as_it_ran, shape, sent, rate)
        text += "\n" + format_other(
            f"replaying this run's speed as it moved ({as_it_ran.correction.describe()}; "
            f"{as_it_ran.drift.describe()})", as_ran)
        text += "\n    gap " + format_gaps(row[1], as_ran)
    _say(text)
    return own, as_ran


def _report_in_run(spec, shape, trace, row: tuple, outcomes, ctx, profiled, first_fit) -> None:
    """Print the run's requests after its first IN_RUN_REQUESTS, measured beside the
    simulator's figures with the factors of the iterations the instances ran while those
    first ones arrived (the whole trace simulated, so that they queue ahead of the rest):
    a prediction with the runners' speed of that very run, as the analyzer corrects its
    model from the window it observes (with ctx's drift, the one the prediction before
    ran with). Nothing where a phase ran no iteration then."""
    from distserve.local.prediction import predict_run, requests_of
    from distserve.local.report import format_comparison, summarize

    if not all(fit.num_iterations for fit in first_fit.phases):
        return
    rate, load = row[0], row[3]
    ctx = dataclasses.replace(profiled, correction=first_fit.correction, drift=ctx.drift)
    measured = summarize([o for o in outcomes if o.req_id >= IN_RUN_REQUESTS], rate,
                         spec.slo.ttft_seconds, spec.slo.tpot_seconds)
    predicted = predict_run(ctx, shape, requests_of(trace.at_rate(rate)), rate,
                            scored_from=IN_RUN_REQUESTS)
    what = (f"{shape.describe()}, the run's requests after its first {IN_RUN_REQUESTS}, "
            f"simulated with the factors of the iterations while those arrived "
            f"({ctx.correction.describe()})")
    _say(format_comparison(what, rate, measured, predicted, load, spec.slo.attainment))


def _compare_at(url: str, spec, ctx, shape, trace, rate: float, drive_fn) -> tuple:
    """((rate, measured, predicted, load), outcomes, the prediction's draws) of one replay
    at rate (predicted: the draws' medians)."""
    from distserve.local.prediction import median_of, predict_draws, requests_of
    from distserve.local.report import LoadSampler, summarize

    at_rate = trace.at_rate(rate)
    with LoadSampler() as load:
        outcomes = _drive(url, spec, at_rate, drive_fn)
    measured = summarize(outcomes, rate, spec.slo.ttft_seconds, spec.slo.tpot_seconds)
    failed = Counter(f"HTTP {o.status}: {o.error}" if o.error else "no token received"
                     for o in outcomes if o.error is not None or o.ttft_s is None)
    for message, count in failed.most_common():
        _say(f"  failed at {rate:g} req/s ({count} request{'s' if count > 1 else ''}): {message}")
    draws = predict_draws(ctx, shape, requests_of(at_rate), rate)
    return (rate, measured, median_of(draws), load.summary()), outcomes, draws


def _drive(url: str, spec, trace, drive_fn, limit: int | None = None):
    """Send the trace's requests (the first `limit`, one after another, with limit)."""
    from distserve.local.load import drive
    from distserve.local.prediction import requests_of

    requests = requests_of(trace)
    if limit is not None:
        requests = [type(r)(r.req_id, 0.0, r.prompt_tokens, r.output_tokens) for r in requests[:limit]]
    if drive_fn is not None:
        return drive_fn(url, requests)
    if limit is not None:
        return [asyncio.run(drive(url, spec.model.name, [r], show_progress=False))[0] for r in requests]
    return asyncio.run(drive(url, spec.model.name, requests, seed=spec.planner.seed))
