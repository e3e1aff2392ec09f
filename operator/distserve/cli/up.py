"""`distserve up -f SPEC`: run a plan on this machine and serve the OpenAI API.

Plans the spec (or takes its fixed placement), starts one process per instance (each
pinned to its own CPU core, or given its GPUs) and the router in front of them, and
serves until Ctrl-C (SIGINT, also when a shell started it in the background, where SIGINT
comes ignored) or SIGTERM, which stop everything it started. `--demo` instead drives about
a minute of the spec's workload (at `--rate`, else `workload.rateRps`, else the planner's
goodput) with a progress bar,
prints TTFT/TPOT percentiles, SLO attainment and goodput beside the simulator's
prediction for the same requests (lengths and arrival times) on the same instances,
and stops. `--colocated N` runs N colocated instances (the baseline).

The planner predicts with this machine's latency profile: on the CPU, the first run on a
machine measures it (a minute or more, with progress lines) and caches it; later runs
read the cache (`distserve.local.profiles` says which file wins and why). `--profile
FILE` plans with FILE; `--no-measure` skips measuring and plans with the spec's
`planner.profilePath`, warning when that was measured on another machine. The line
naming the profile (path, machine, date) is printed before the plan, and again under
the demo's report. The work folder (settings, process logs) is removed on stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

from distserve.spec import SpecError, load_manifest

if TYPE_CHECKING:
    from distserve_engine.server.settings import ServeSettings

NAME = "up"
HELP = "Run a DistServeDeployment on this machine (router + instances), serving the OpenAI API."
DEMO_SECONDS = 60.0
EXIT_USAGE_ERROR = 2
EXIT_LAUNCH_ERROR = 3


def add_arguments(parser) -> None:
    """Options of `distserve up`."""
    parser.add_argument("-f", "--file", required=True, metavar="SPEC", help="DistServeDeployment YAML")
    parser.add_argument("--host", default="127.0.0.1", help="address of the OpenAI API")
    parser.add_argument("--port", type=int, default=8000, help="port of the OpenAI API (instances use the next ones)")
    parser.add_argument("--backend", choices=("process", "ray"), default="process",
                        help="run instances as child processes or as Ray actors")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (implies --backend ray)")
    parser.add_argument("--colocated", type=int, default=0, metavar="N",
                        help="run N colocated instances instead of the plan (the baseline)")
    parser.add_argument("--demo", action="store_true", help="drive a short load, report, and stop")
    parser.add_argument("--rate", type=float, default=None, help="demo rate in req/s (default: the planner's goodput)")
    parser.add_argument("--duration", type=float, default=DEMO_SECONDS, help="demo length in seconds")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="plan with this latency profile (`distserve profile -o FILE`) instead of "
                             "this machine's cached one or the spec's planner.profilePath")
    parser.add_argument("--api-key", default=None, metavar="KEYS",
                        help="require one of these comma-separated keys on /v1 (`Authorization: "
                             "Bearer KEY`); default $DISTSERVE_API_KEY, unset: open")
    parser.add_argument("--no-measure", action="store_true",
                        help="do not measure this machine's profile on first use: plan with the "
                             "cached one, else the spec's planner.profilePath")
    _add_replan_arguments(parser)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args) -> int:
    """Plan, launch, then serve until Ctrl-C (or run the demo)."""
    from distserve.local.launcher import LaunchError
    from distserve.local.settings import find_model_path
    from distserve.search import NoFeasiblePlan, plan_deployment
    from distserve.search.planner import placed_as_given

    manifest = load_manifest(args.file)
    spec = manifest.spec  # relative paths already read from the spec's folder
    model_path = find_model_path(spec)
    # SIGTERM (kill, a supervisor) stops everything as Ctrl-C does, from here on (measuring
    # included); Ray installs its own handler on `ray.init`, which exits the same way.
    # NOTE: a shell starts a background job (`distserve up ... &`) with SIGINT ignored,
    # and Python then keeps it ignored; the handler is installed explicitly so that
    # `kill -INT` stops it there too.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.api_key:  # the router reads it from its environment, never from a command line
        os.environ["DISTSERVE_API_KEY"] = args.api_key
    try:
        source = _choose_profile(args, spec, model_path)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    spec.planner.profile_path = source.path
    _log(f"profile: {source.describe()}")
    plan = None
    try:
        _log("planning ...")
        plan = plan_deployment(spec)
        _log(f"plan: {_shape(plan, 'prefill')} prefill + {_shape(plan, 'decode')} decode, "
             f"predicted goodput {plan.goodput_rps:.2f} req/s at {plan.attainment:.0%} attainment "
             f"(latency: {plan.latency_source})")
    except NoFeasiblePlan as err:
        if not (args.colocated or spec.placement):
            print(f"error: no feasible plan: {err}", file=sys.stderr)
            return 1
        _log(f"planner: no feasible plan ({err}); running the spec's placement")
        if args.replan and not args.colocated:
            plan = placed_as_given(spec, attainment=err.best_attainment)  # replanning's start
    except ValueError as err:  # the planner cannot model this spec (e.g. an unknown model)
        if not (args.colocated or spec.placement):
            raise
        _log(f"planner: no prediction ({err}); running the spec's placement")
    replanning = _replanning_settings(args, plan) if args.replan else None
    if isinstance(replanning, str):
        print(f"error: {replanning}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    try:
        launcher = build_launcher(args, spec, manifest.metadata.name, model_path, plan)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    _log(f"work folder {launcher.workdir} (settings and logs; removed on stop)")
    stack = contextlib.ExitStack()
    try:
        launcher.start(progress=_log)
        if args.prometheus and replanning is None:  # --replan starts its own and says where
            _start_prometheus(stack, launcher)
        if args.demo:
            return _demo(args, spec, plan, launcher, source)
        if replanning is not None:
            return _serve_replanning(args, spec, plan, launcher, replanning)
        _log("serving; Ctrl-C stops")
        while True:
            time.sleep(3600)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_LAUNCH_ERROR
    except KeyboardInterrupt:
        _log("stopping ...")
        return 0
    finally:
        stack.close()
        launcher.stop()


def build_launcher(args, spec, name: str, model_path: str, plan):
    """The LocalLauncher of `plan` (else the spec's placement; `--colocated N` instead):
    each instance with its own tp and pp (a mixed plan has two shapes in a role), and, on
    CUDA with child processes, only its plan's GPUs. SpecError when the plan cannot run
    on this machine."""
    from distserve.local.launcher import LocalLauncher
    from distserve.local.settings import (
        instance_counts,
        instance_gpu_ids,
        instance_parallel,
        serve_settings,
    )

    instances = instance_counts(spec, plan, args.colocated)
    parallel = instance_parallel(spec, plan, args.colocated)
    settings = serve_settings(spec, instances, name, model_path, parallel,
                              plan if not args.colocated else None)
    backend = "ray" if args.ray_address else args.backend
    # NOTE: Ray gives each actor its GPUs itself; child processes get the plan's.
    is_pinned_gpus = (plan is not None and not args.colocated and backend == "process"
                      and settings.engine.device_type == "cuda")
    return LocalLauncher(settings, args.host, args.port, backend, args.ray_address,
                         name_to_gpu_ids=instance_gpu_ids(plan) if is_pinned_gpus else None)


def _shape(plan, role: str) -> str:
    """A phase's instances, with their shapes when it has several: `3` or `1 tp2 + 2 tp1`."""
    groups = plan.groups(role)
    if len(groups) == 1:
        return str(groups[0].instances)
    return " + ".join(f"{g.instances} tp{g.tp}pp{g.pp}" for g in groups)


def _start_prometheus(stack: contextlib.ExitStack, launcher) -> None:
    """A Prometheus scraping the router and instances, its URL printed, stopped with `up`."""
    from distserve.local.prometheus import LocalPrometheus
    from distserve.local.replanning import scrape_targets

    prometheus = stack.enter_context(
        LocalPrometheus(launcher.workdir / "prometheus", scrape_targets(launcher)))
    _log(f"Prometheus at {prometheus.url}, scraping the router and instances: try the "
         f"dashboards' queries at {prometheus.url}/graph")


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _choose_profile(args, spec, model_path: str):
    """The latency profile to plan with; measures and caches this machine's on first use."""
    from distserve.cli.profile import measure_profile
    from distserve.local.profiles import THREADS_PER_RANK, choose_profile
    from distserve.local.settings import engine_config

    engine = engine_config(spec, model_path)

    def measure(path, key: dict) -> None:
        measure_profile(spec, path, f"distserve up -f {args.file} (first use on this machine)",
                        THREADS_PER_RANK, progress=lambda m: _log(f"  {m}"),
                        extra_provenance={"cache_key": key})

    return choose_profile(spec, engine, args.profile, not args.no_measure, measure, _log)


def _demo(args, spec, plan, launcher, source) -> int:
    """About a minute of the spec's workload; the report beside the simulator's prediction
    for the same requests on the same instances."""
    from distserve.local.load import drive
    from distserve.local.report import format_summary, summarize
    from distserve.workload import make_workload

    rate_rps = args.rate or spec.workload.rate_rps or (plan.goodput_rps if plan else 1.0)
    workload = make_workload(spec.workload.dataset, spec.workload.trace_path, spec.workload.arrival
                             if spec.workload.arrival != "trace" else "poisson", spec.workload.cv)
    num_requests = max(5, int(rate_rps * args.duration))
    max_len = (spec.model.max_model_len or 2048) - 1
    requests = [r for r in workload.sample(rate_rps, num_requests, seed=spec.planner.seed)
                if r.prompt_tokens + r.output_tokens <= max_len]
    _log(f"demo: {len(requests)} requests at {rate_rps:.2f} req/s (Poisson), "
         f"SLOs TTFT <= {spec.slo.ttft_seconds} s, TPOT <= {spec.slo.tpot_seconds} s")
    started_s = time.time()
    outcomes = asyncio.run(drive(launcher.url, spec.model.name, requests, seed=spec.planner.seed))
    ended_s = time.time()
    summary = summarize(outcomes, rate_rps, spec.slo.ttft_seconds, spec.slo.tpot_seconds)
    predicted = _predicted(spec, launcher.settings, requests, rate_rps)
    print(format_summary(summary, plan, spec.slo.attainment, predicted))
    if predicted is not None:
        print(f"  predicted with profile {source.describe()}")
        _print_own_factors(spec, launcher, requests, rate_rps, started_s, ended_s)
    return 0


def _print_own_factors(spec, launcher, requests, rate_rps: float, started_s: float,
                       ended_s: float) -> None:
    """The demo's iterations against the profile, and the simulator's figures with those
    factors, steady and with the speed's drift over the demo (`calibration.fit_drift`),
    and replaying the demo's speed as it moved (`calibration.as_it_ran`): how much of a
    gap is the latency model's, and how much the speed's (said why when unavailable)."""
    import dataclasses

    import httpx

    from distserve.local.calibration import as_it_ran, fetch_iterations, fit_drift, fit_iterations
    from distserve.local.prediction import DRIFT_DRAWS, LocalShape, engine_context, predict_run
    from distserve.local.report import format_other
    from distserve.search import build_context

    try:
        ctx = engine_context(build_context(spec), launcher.settings)
        shape = LocalShape.from_settings(launcher.settings)
        name_to_items = fetch_iterations(launcher)
        fit = fit_iterations(ctx, shape, name_to_items)
        own = dataclasses.replace(ctx, correction=fit.correction)
        drift, _ = fit_drift(ctx, shape, name_to_items, fit, started_s, ended_s)
        steady = predict_run(own, shape, requests, rate_rps)
        drifting = (None if drift.is_still else
                    predict_run(dataclasses.replace(own, drift=drift), shape, requests, rate_rps))
        replayed = as_it_ran(ctx, shape, name_to_items, started_s, ended_s)
        as_ran = predict_run(replayed, shape, requests, rate_rps)
    except (ValueError, httpx.HTTPError) as err:
        _log(f"demo: the instances' iterations not read ({err})")
        return
    print(f"  the runners' iterations against the profile: {fit.describe()}")
    print(format_other("simulated with these factors", steady))
    print(f"  the speed's drift over the demo: {drift.describe()}")
    if drifting is not None:
        print(format_other("simulated with these factors and drift (the median of "
                           f"{DRIFT_DRAWS} histories)", drifting))
    print(format_other(f"replaying the demo's speed as it moved ({replayed.correction.describe()}; "
                       f"{replayed.drift.describe()})", as_ran))


def _predicted(spec, settings: ServeSettings, requests, rate_rps: float):
    """The simulator's RunSummary for these requests on the settings' instances, or None
    (said why) when the planner cannot model the spec."""
    from distserve.local.prediction import LocalShape, engine_context, predict_run
    from distserve.search import build_context

    try:
        ctx = engine_context(build_context(spec), settings)
        return predict_run(ctx, LocalShape.from_settings(settings), requests, rate_rps)
    except ValueError as err:
        _log(f"demo: no simulated figures ({err})")
        return None


def _add_replan_arguments(parser) -> None:
    """Options of `distserve up --replan` (the workload analyzer's loop, run locally)."""
    from distserve.local.settings import LOCAL_REPLANNING as d

    parser.add_argument("--prometheus", action="store_true",
                        help="start a Prometheus (/usr/bin/prometheus) scraping this deployment "
                             "and print its URL (--replan starts one too)")
    parser.add_argument("--replan", action="store_true",
                        help="every --replan-interval, observe the traffic in Prometheus, decide "
                             "keep or replan, print the decision, and on replan reshuffle the processes")
    parser.add_argument("--prometheus-url", default=None, metavar="URL",
                        help="the Prometheus to read (it must scrape this deployment); default: "
                             "start one (/usr/bin/prometheus) scraping the router and instances")
    for flag, key, what in (("interval", "intervalSeconds", "seconds between decisions"),
                            ("window", "windowSeconds", "seconds of traffic one decision observes"),
                            ("hold", "holdSeconds", "seconds a shift must persist before a replan"),
                            ("cooldown", "cooldownSeconds", "seconds without a replan after a reshuffle")):
        parser.add_argument(f"--replan-{flag}", type=float, default=d[key], help=f"{what} (default {d[key]})")
    parser.add_argument("--replan-min-requests", type=int, default=d["minRequests"],
                        help=f"fewer requests in a window: no decision (default {d['minRequests']})")
    parser.add_argument("--replan-advisory", action="store_true",
                        help="only print what a replan would do; move nothing")


def _replanning_settings(args, plan):
    """The ReplanningSpec of `--replan`, or why it cannot run (a string)."""
    from pydantic import ValidationError

    from distserve.local.replanning import local_replanning

    if plan is None or args.colocated:
        return "--replan needs a plan from the planner (not --colocated, not a fixed placement alone)"
    if args.ray_address or args.backend == "ray":
        return "--replan reshuffles child processes: use --backend process"
    try:
        return local_replanning(
            intervalSeconds=args.replan_interval, windowSeconds=args.replan_window,
            holdSeconds=args.replan_hold, cooldownSeconds=args.replan_cooldown,
            minRequests=args.replan_min_requests, advisory=args.replan_advisory)
    except ValidationError as err:
        return f"--replan settings: {err.errors()[0]['msg']}"


def _serve_replanning(args, spec, plan, launcher, replanning) -> int:
    """Serve; every interval observe, decide, print and (on replan) reshuffle, until Ctrl-C."""

    from distserve.local.prometheus import LocalPrometheus
    from distserve.local.replanning import ReplanLoop, scrape_targets

    def say(line: str) -> None:
        print(line, flush=True)

    with contextlib.ExitStack() as stack:
        url, on_targets = args.prometheus_url, None
        if url is None:
            prometheus = stack.enter_context(
                LocalPrometheus(launcher.workdir / "prometheus", scrape_targets(launcher)))
            url, on_targets = prometheus.url, prometheus.set_targets
        _log(f"replanning: Prometheus at {url}; a decision every {replanning.interval_seconds:.0f} s "
             f"over {replanning.window_seconds:.0f} s, hold {replanning.hold_seconds:.0f} s, "
             f"cooldown {replanning.cooldown_seconds:.0f} s; Ctrl-C stops")
        ReplanLoop(launcher, spec, plan, replanning, url, on_targets, progress=say).run()
    return 0
