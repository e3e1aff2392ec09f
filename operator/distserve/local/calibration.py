"""The latency profile held to a serving deployment's own iterations.

The profile is measured on a bare runner (`distserve profile`). Serving adds work on the
same cores: the instance's HTTP threads, KV exports to decode, the router and the
clients beside it, and on the engine thread itself, between runner calls, scheduling,
KV imports and emitting tokens. Each instance keeps its runner's recent batches timed,
with the engine thread's overhead before each (`GET /debug/iterations`,
`distserve_engine.instance.iterations`); here every one of them is set beside the time
the profile gives the very same batch (its lengths, the instance's tp and pp and serving
mode), and the ratio of the sums, per phase, is a `Correction` the simulator can run
with (for decode, the factor beside a time per sequence of a step, fitted by least
squares over the steps: the tokens a serving instance streams and the KV it imports grow
with its batch, where the profile's bare steps do not; on SmolLM2 0.05-1.05 ms a
sequence): a simulated iteration stands for all the time its instance is busy with it.
The ratio of sums weighs each iteration by its time, as a phase's capacity does; the
spread of the per-iteration ratios says how steady it is. Each runner call also keeps
the engine thread's CPU time, so the fit says how much of its calls' time the runner
held its core: what is left of a factor is the runner itself running slower or faster
than when the profile was measured (on SmolLM2 in bfloat16, factors of x0.96-1.61 over
four runs of `distserve fidelity` in an hour, the runner off its core 3-14% of its
calls' time: the host's own speed drifts that much).

The instances of a local deployment share the host, and each runner runs slower while
another is busy (caches, memory bandwidth, a core's sibling thread): on SmolLM2 on a
2-core host, a decode step x0.99 of its profile beside an idle prefill runner and x1.08
beside a busy one, 1P+1D and 2 colocated instances alike fitting x1.09. One factor per
phase would average that over how busy the others were, which the load sets: a factor
fitted at one rate is too fast at a higher one. So each iteration is set beside its
share of time the other instances' engine threads were busy, the slowdown is fitted
over the phases that ran both beside idle and busy ones (`_fit_slowdown`), and the
factors are each runner's speed alone; the simulator slows each instance as busy as
the others are (`simulator.host`). A run whose instances were seldom idle apart (at or
past the knee: MIN_CONTRAST_SHARE) cannot tell one, and keeps the slowdown it is given.

A constant factor is the mean of a speed that moves. `speeds_by_window` tells each
window of a run against the run's factor, and `fit_drift` makes of it the `SpeedDrift`
the simulator can run with: per phase, the spread of log speed across windows less what
the windows' own batches' scatter alone would give it (the variance of a ratio of sums,
from its iterations' residuals), and a prefill batch's spread about its window.
NOTE: decode steps follow each other closely, so their residuals are not independent
and a decode window's noise is underestimated: its drift reads high, if anything.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from distserve.latency import Correction
from distserve.latency.corrected import MAX_BUSY_SLOWDOWN, per_sequence_text
from distserve.local.prediction import LocalShape
from distserve.local.settings import local_instance_name
from distserve.search.candidates import Config
from distserve.search.trials import SearchContext, instance_model
from distserve.simulator import SpeedDrift, SpeedHistory
from distserve_engine.instance.iterations import ITERATION_HISTORY, KINDS, Iteration

MIN_SEQUENCE_S = 1e-6  # a time per sequence below this is the fit's rounding: none
# iterations of a phase that ran with the other instances mostly idle, and as many that
# ran with them mostly busy, for the phase to tell how much they slow it, and the share
# of the phase's time each side must hold: at and past the knee the others are idle for
# 0-4% of the time, and the slowdown fitted on so few read anything from x1.03 to x1.25
# (SmolLM2, one `fidelity` run), where a calibration below the knee reads x1.12-1.16
MIN_CONTRAST_ITERATIONS = 20
MIN_CONTRAST_SHARE = 0.1
MIN_WINDOW_ITERATIONS = 10  # a phase's window with fewer iterations tells no speed
MIN_DRIFT_WINDOWS = 3  # fewer windows of a phase tell no spread between them
MAX_DRIFT_SD = 0.5  # of log speed: more is a broken run, not a drift to simulate
# NOTE: each phase's drift over the shortest window that holds enough of its iterations:
# a decode step's speed moves within seconds (on SmolLM2, 8% in sd over 2 s windows,
# 5% over 30 s: slower while a prefill runs beside it, and more), which is what spreads
# TPOT over requests; a prefill batch takes ~0.5 s, so prefill's windows are longer
PREFILL_DRIFT_WINDOW_S = 30.0
DECODE_DRIFT_WINDOW_S = 2.0
# a run's speed replayed window by window (`fit_history`): prefill's over windows that
# hold a few batches, decode's over the drift's; fewer iterations tell no window's speed
HISTORY_PREFILL_WINDOW_S = 10.0
HISTORY_DECODE_WINDOW_S = 2.0
MIN_HISTORY_ITERATIONS = 3


@dataclass(frozen=True)
class PhaseFit:
    """Measured against profiled time of one phase's iterations."""

    phase: str  # "prefill" or "decode"
    num_iterations: int
    measured_s: float  # the iterations' measured seconds, overhead included, summed
    profiled_s: float  # the profile's seconds for the same batches, summed
    overhead_s: float  # of measured_s, the engine thread's time between runner calls
    p10: float  # of the per-iteration ratios
    p90: float
    runner_s: float = 0.0  # the runner calls' seconds of the iterations that timed their CPU
    runner_cpu_s: float = 0.0  # the engine thread's CPU seconds in those calls
    # decode: seconds each sequence of a step adds beyond the profile's time
    # (`_sequence_s`), and the sequences the iterations ran, summed
    sequence_s: float = 0.0
    num_sequences: int = 0

    @property
    def factor(self) -> float:
        """Measured over profiled time, less the time per sequence (1.0 where nothing was
        measured): with it, the sums of measured and modelled time agree."""
        if self.profiled_s <= 0:
            return 1.0
        return (self.measured_s - self.sequence_s * self.num_sequences) / self.profiled_s

    def describe(self) -> str:
        """e.g. "prefill x1.16 (per batch x1.04-1.36, 133 batches)"."""
        if not self.num_iterations:
            return f"{self.phase}: no iterations (x1.00)"
        core = (f", the runner on its core {self.runner_cpu_s / self.runner_s:.0%} of its calls' "
                "time" if self.runner_s > 0 else "")
        between = self.overhead_s / self.measured_s
        return (f"{self.phase} x{self.factor:.2f}{per_sequence_text(self.sequence_s)} (per "
                f"iteration x{self.p10:.2f}-{self.p90:.2f}, {self.num_iterations} iterations, "
                f"{between:.0%} of the time between runner calls{core})")


@dataclass(frozen=True)
class IterationFit:
    """Both phases' fits and the correction they make."""

    phases: tuple[PhaseFit, ...]
    # each runner's slowdown while the other instances are busy (the factors are its
    # speed alone), and whether these iterations told it or it was given (`busy_slowdown`)
    busy_slowdown: float = 0.0
    is_slowdown_measured: bool = False

    @property
    def correction(self) -> Correction:
        """Per-phase factors, clamped to what a correction allows."""
        by = {fit.phase: fit for fit in self.phases}
        prefill, decode = by.get("prefill"), by.get("decode")
        return Correction.clamped(prefill.factor if prefill else 1.0,
                                  decode.factor if decode else 1.0,
                                  decode.sequence_s if decode else 0.0, self.busy_slowdown)

    def describe(self) -> str:
        """Both phases in one line, and the slowdown beside busy instances."""
        if self.is_slowdown_measured:
            beside = f"x{1 + self.busy_slowdown:.2f} while the other instances are busy"
        elif self.busy_slowdown > 0:
            beside = (f"x{1 + self.busy_slowdown:.2f} while the other instances are busy, as "
                      "measured before (these iterations ran too few beside idle ones to tell)")
        else:
            return "; ".join(fit.describe() for fit in self.phases)
        return "; ".join(fit.describe() for fit in self.phases) + f"; each {beside}"


def fetch_iterations(launcher) -> dict[str, list[Iteration]]:
    """{instance name: its runner's recent iterations} from each instance process of a
    `LocalLauncher` (`GET /debug/iterations`)."""
    import httpx

    out = {}
    for proc in launcher.procs:
        if proc.role == "router":
            continue
        response = httpx.get(f"{proc.url}/debug/iterations", params={"limit": ITERATION_HISTORY},
                             timeout=30.0)
        response.raise_for_status()
        out[proc.name] = [Iteration.from_dict(doc) for doc in response.json()]
    return out


def profiled_s(ctx: SearchContext, serving_mode: str, config: Config, item: Iteration) -> float:
    """The profile's time for this iteration on an instance of this configuration (the
    simulator's own timer: the same figure a simulated batch takes)."""
    timer = instance_model(ctx, serving_mode, config).timer
    if item.kind == "prefill":
        return timer.prefill_iteration_s(item.lens)
    alpha_s, slope_s = timer.decode_line(len(item.lens))
    return alpha_s + slope_s * sum(item.lens)


def fit_iterations(ctx: SearchContext, shape: LocalShape,
                   name_to_iterations: Mapping[str, Iterable[Iteration]],
                   busy_slowdown: float = 0.0, tell_slowdown: bool = True) -> IterationFit:
    """Each phase's measured over profiled time, over every instance of the shape, with
    the slowdown of each while the others are busy (`_fit_slowdown`; busy_slowdown, one
    measured before, where these iterations cannot tell it, or with tell_slowdown False),
    the factors being each runner's speed alone (with no slowdown, one factor a phase
    over the run's mix of idle and busy neighbours). ctx's own correction is left out:
    the fit is against the profile as measured. A ValueError for an instance the shape
    does not have."""
    kind_to_timed = _timed_iterations(ctx, shape, name_to_iterations)
    measured = _fit_slowdown(kind_to_timed) if tell_slowdown else None
    slowdown = busy_slowdown if measured is None else measured
    return IterationFit(tuple(_phase_fit(kind, _beside_busy(timed, slowdown))
                              for kind, timed in kind_to_timed.items()),
                        slowdown, measured is not None)


def fit_window(ctx: SearchContext, shape: LocalShape,
               name_to_iterations: Mapping[str, list[Iteration]], started_s: float,
               until_s: float = math.inf, busy_slowdown: float = 0.0,
               tell_slowdown: bool = True) -> IterationFit:
    """The fit of the iterations that started from started_s until until_s."""
    return fit_iterations(ctx, shape, _between(name_to_iterations, started_s, until_s),
                          busy_slowdown, tell_slowdown)


@dataclass(frozen=True)
class RunSpeeds:
    """How a run's speed moved against its own factors (`speeds_by_window`)."""

    window_s: float
    # {phase: each window's measured over modelled time}, windows of enough iterations
    phase_to_speeds: dict[str, list[float]]
    # {phase: the variance of each of those windows' log speed that its own iterations'
    # spread alone makes}: what the spread across windows holds of noise, not drift
    phase_to_noise: dict[str, list[float]]
    prefill_batch_sd: float  # of a prefill batch's log time around its window's speed

    def between_sd(self, phase: str) -> float:
        """The phase's drift: the spread (sd) of log speed across windows less what the
        windows' noise accounts for (0 with fewer than MIN_DRIFT_WINDOWS windows)."""
        speeds = self.phase_to_speeds.get(phase, [])
        if len(speeds) < MIN_DRIFT_WINDOWS:
            return 0.0
        spread = float(np.var(np.log(speeds), ddof=1))
        noise = float(np.mean(self.phase_to_noise[phase]))
        return min(MAX_DRIFT_SD, math.sqrt(max(0.0, spread - noise)))

    def describe(self) -> str:
        """e.g. "prefill x0.95-1.06 (10 windows), decode x0.93-1.11 (10 windows)"."""
        return ", ".join(f"{phase} x{min(v):.2f}-{max(v):.2f} ({len(v)} windows)"
                         for phase, v in self.phase_to_speeds.items() if v)


def speeds_by_window(ctx: SearchContext, shape: LocalShape,
                     name_to_iterations: Mapping[str, list[Iteration]], run_fit: IterationFit,
                     started_s: float, ended_s: float, window_s: float,
                     min_iterations: int = MIN_WINDOW_ITERATIONS) -> RunSpeeds:
    """Each window's speed against run_fit (the fit of the iterations from started_s on),
    in windows of window_s (the last one takes the rest, past ended_s too), leaving out a
    phase's windows of fewer than min_iterations iterations: how far the runners' speed
    moved within a run that one constant factor stands for, and how much of that the
    batches' own spread makes."""
    phase_to_speeds: dict[str, list[float]] = {}
    phase_to_noise: dict[str, list[float]] = {}
    prefill_residuals: list[tuple[float, float]] = []  # (modelled s, log of measured/window's)
    windows = _window_pairs(ctx, shape, name_to_iterations, run_fit, started_s, ended_s,
                            {"prefill": window_s, "decode": window_s})
    for phase, window_to_pairs in windows.items():
        for window in sorted(window_to_pairs):
            if len(window_to_pairs[window]) < min_iterations:
                continue
            measured, modelled = np.array(window_to_pairs[window]).T
            speed = measured.sum() / modelled.sum()
            # the ratio of sums' own variance, from its iterations' spread about it
            noise = float(np.sum((measured - speed * modelled) ** 2)) / modelled.sum() ** 2
            phase_to_speeds.setdefault(phase, []).append(float(speed))
            phase_to_noise.setdefault(phase, []).append(noise / speed ** 2)
            if phase == "prefill":
                prefill_residuals += zip(modelled, np.log(measured / (speed * modelled)),
                                         strict=True)
    batch_sd = 0.0
    if prefill_residuals:
        weights, logs = np.array(prefill_residuals).T
        batch_sd = math.sqrt(float(np.sum(weights * logs ** 2) / np.sum(weights)))
    return RunSpeeds(window_s, phase_to_speeds, phase_to_noise, batch_sd)


def fit_drift(ctx: SearchContext, shape: LocalShape,
              name_to_iterations: Mapping[str, list[Iteration]], run_fit: IterationFit,
              started_s: float, ended_s: float,
              min_iterations: int = MIN_WINDOW_ITERATIONS) -> tuple[SpeedDrift, RunSpeeds]:
    """The drift the simulator runs with, of the iterations from started_s on: prefill's
    over PREFILL_DRIFT_WINDOW_S windows with a batch's spread about its window, decode's
    over DECODE_DRIFT_WINDOW_S windows (`speeds_by_window`); and the run's speeds over
    the prefill windows (both phases), which say what one constant factor stands for."""
    prefill, decode = (speeds_by_window(ctx, shape, name_to_iterations, run_fit, started_s,
                                        ended_s, window_s, min_iterations)
                       for window_s in (PREFILL_DRIFT_WINDOW_S, DECODE_DRIFT_WINDOW_S))
    drift = SpeedDrift(PREFILL_DRIFT_WINDOW_S, prefill.between_sd("prefill"),
                       DECODE_DRIFT_WINDOW_S, decode.between_sd("decode"),
                       min(MAX_DRIFT_SD, prefill.prefill_batch_sd))
    return drift, prefill


def fit_history(ctx: SearchContext, shape: LocalShape,
                name_to_iterations: Mapping[str, list[Iteration]], run_fit: IterationFit,
                started_s: float, ended_s: float,
                prefill_window_s: float = HISTORY_PREFILL_WINDOW_S,
                decode_window_s: float = HISTORY_DECODE_WINDOW_S,
                min_iterations: int = MIN_HISTORY_ITERATIONS) -> SpeedHistory:
    """The speed the run's runners ran at, window by window from started_s, against
    run_fit (the fit of the iterations from started_s on, with its slowdown beside busy
    instances where it has one): a window of fewer than min_iterations of a phase takes
    the speed of the window before (the first measured one, at the start; 1.0 where none
    is). The simulator replays it (`SpeedHistory`): what a run's figures come to with its
    speed known, window by window, and no more."""
    windows = _window_pairs(ctx, shape, name_to_iterations, run_fit, started_s, ended_s,
                            {"prefill": prefill_window_s, "decode": decode_window_s})
    phase_to_speeds = {}
    for phase, window_s in (("prefill", prefill_window_s), ("decode", decode_window_s)):
        count = max(1, int((ended_s - started_s) // window_s))  # as `_window_pairs` cuts
        measured = {}
        for window, pairs in windows.get(phase, {}).items():
            if len(pairs) >= min_iterations:
                took, modelled = np.array(pairs).T
                measured[window] = float(took.sum() / modelled.sum())
        speed = measured[min(measured)] if measured else 1.0
        speeds = []
        for window in range(count):
            speed = measured.get(window, speed)
            speeds.append(speed)
        phase_to_speeds[phase] = tuple(speeds)
    return SpeedHistory(prefill_window_s, phase_to_speeds["prefill"], decode_window_s,
                        phase_to_speeds["decode"])


def as_it_ran(ctx: SearchContext, shape: LocalShape,
              name_to_iterations: Mapping[str, list[Iteration]], started_s: float,
              ended_s: float) -> SearchContext:
    """ctx running at the speed the run from started_s to ended_s ran at, window by
    window: its iterations' factors, one a phase, and its `fit_history`.
    NOTE: one factor a phase, no slowdown beside busy instances: the windows carry the
    neighbours' effect at their own grain (over four saved `fidelity` runs of 21 rates,
    18 of 21 attainments and 83 of 84 percentiles within the goal this way, 16 and 80
    with the slowdown under the windows)."""
    fit = fit_window(ctx, shape, name_to_iterations, started_s, tell_slowdown=False)
    history = fit_history(ctx, shape, name_to_iterations, fit, started_s, ended_s)
    return dataclasses.replace(ctx, correction=fit.correction, drift=history)


def _window_pairs(ctx: SearchContext, shape: LocalShape,
                  name_to_iterations: Mapping[str, list[Iteration]], run_fit: IterationFit,
                  started_s: float, ended_s: float, phase_to_window_s: Mapping[str, float],
                  ) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """{phase: {window: (measured s, modelled s) of each of its iterations}}, the model
    being run_fit's, windows of phase_to_window_s from started_s (the last one takes the
    rest, past ended_s too)."""
    whole = {fit.phase: fit for fit in run_fit.phases}
    run = _timed_iterations(ctx, shape, _between(name_to_iterations, started_s, math.inf))
    out: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for phase, timed in run.items():
        fit, window_s = whole[phase], phase_to_window_s[phase]
        last_window = max(1, int((ended_s - started_s) // window_s)) - 1
        window_to_pairs = out.setdefault(phase, {})
        for item, p in _beside_busy(timed, run_fit.busy_slowdown):
            if p > 0:
                window = min(int((item.started_s - started_s) // window_s), last_window)
                window_to_pairs.setdefault(window, []).append(
                    (item.busy_s, fit.factor * p + fit.sequence_s * len(item.lens)))
    return out


@dataclass(frozen=True)
class SameBatches:
    """The very same prefill batches in two runs (`same_batches`)."""

    count: int  # batches of the same prompt lengths on the same instance in both
    cpu: float  # geometric mean of their engine thread's CPU time, the later run's over the earlier's
    wall: float  # the same of their wall time

    def describe(self) -> str:
        """e.g. "152 batches, wall time x1.064 (CPU time x1.059)"."""
        if not self.count:
            return "none in common"
        return f"{self.count} batches, wall time x{self.wall:.3f} (CPU time x{self.cpu:.3f})"


def same_batches(before: Mapping[str, Iterable[Iteration]], after: Mapping[str, Iterable[Iteration]],
                 before_window: tuple[float, float] = (-math.inf, math.inf),
                 after_window: tuple[float, float] = (-math.inf, math.inf)) -> SameBatches:
    """How much slower the very same work ran in one run than in the one before: the
    prefill batches of the same prompt lengths on the same instance that both ran (each
    in its window of start times), their mean times set side by side. The speed's level
    moving between the runs, apart from the batches each formed and from the profile's
    fit; where the engine thread's CPU time moved less than the wall time, the runner
    waited for its core."""
    def by_batch(name_to_iterations, window) -> dict:
        out: dict = {}
        for name, items in _between(name_to_iterations, *window).items():
            for item in items:
                if item.kind == "prefill":
                    cpu_s = item.cpu_s if item.cpu_s is not None else item.seconds
                    out.setdefault((name, item.lens), []).append((cpu_s, item.seconds))
        return out

    first, then = by_batch(before, before_window), by_batch(after, after_window)
    common = sorted(set(first) & set(then))
    if not common:
        return SameBatches(0, 1.0, 1.0)
    logs = np.log([np.mean(then[key], axis=0) / np.mean(first[key], axis=0) for key in common])
    cpu, wall = np.exp(logs.mean(axis=0))
    return SameBatches(len(common), float(cpu), float(wall))


def _between(name_to_iterations: Mapping[str, Iterable[Iteration]], started_s: float,
             until_s: float) -> dict[str, list[Iteration]]:
    return {name: [i for i in items if started_s <= i.started_s < until_s]
            for name, items in name_to_iterations.items()}


def _timed_iterations(ctx: SearchContext, shape: LocalShape,
                    name_to_iterations: Mapping[str, Iterable[Iteration]],
                    ) -> dict[str, list[tuple[Iteration, float, float]]]:
    """{kind: (iteration, the profile's time for its batch, the share of its time the
    other instances were busy)} over the shape's instances (ctx's own correction left
    out); a ValueError for an instance the shape lacks."""
    bare = dataclasses.replace(ctx, correction=Correction(), drift=None)
    name_to_config = {}
    for role, shapes in shape.role_to_parallel.items():
        for index, parallel in enumerate(shapes):
            name_to_config[local_instance_name(role, index)] = (role, Config(parallel.tp, parallel.pp))
    name_to_items = {name: list(items) for name, items in name_to_iterations.items()}
    for name in name_to_items:
        if name not in name_to_config:
            raise ValueError(f"iterations of instance {name!r}, which the deployment "
                             f"({shape.describe()}) does not have: {sorted(name_to_config)}")
    shares = _busy_shares(name_to_items)
    kind_to_timed: dict[str, list[tuple[Iteration, float, float]]] = {kind: [] for kind in KINDS}
    for name, items in name_to_items.items():
        role, config = name_to_config[name]
        serving_mode = "colocated" if role == "colocated" else "disaggregated"
        for item, share in zip(items, shares[name], strict=True):
            kind_to_timed[item.kind].append(
                (item, profiled_s(bare, serving_mode, config, item), share))
    return kind_to_timed


def _busy_shares(name_to_items: Mapping[str, list[Iteration]]) -> dict[str, np.ndarray]:
    """{instance: per iteration, the share of its time (its engine thread's, overhead
    included) that the other instances' engine threads were busy, averaged over them}."""
    spans = {}
    for name, items in name_to_items.items():
        ends = np.array([item.started_s + item.seconds for item in items], dtype=float)
        spans[name] = (ends - np.array([item.busy_s for item in items], dtype=float), ends)
    out = {}
    for name, (starts, ends) in spans.items():
        others = [_busy_within(*spans[other], starts, ends) for other in spans if other != name]
        length = np.maximum(ends - starts, 1e-9)
        out[name] = (np.mean(others, axis=0) / length if others else np.zeros(len(starts)))
    return out


def _busy_within(starts: np.ndarray, ends: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                 ) -> np.ndarray:
    """Seconds of the spans [starts, ends) (one thread's: apart, in any order) within
    each [lo, hi)."""
    if not len(starts):
        return np.zeros(len(lo))
    order = np.argsort(starts)
    starts, lengths = starts[order], (ends - starts)[order]
    before = np.concatenate(([0.0], np.cumsum(lengths)))  # busy before each span

    def busy_until(t: np.ndarray) -> np.ndarray:
        last = np.searchsorted(starts, t, side="right") - 1  # the last span started by t
        at = np.maximum(last, 0)
        inside = np.clip(t - starts[at], 0.0, lengths[at])
        return np.where(last >= 0, before[at] + inside, 0.0)

    return np.clip(busy_until(hi) - busy_until(lo), 0.0, None)


def _fit_slowdown(kind_to_timed: Mapping[str, list[tuple[Iteration, float, float]]],
                  ) -> float | None:
    """How much slower a runner runs while the other instances are busy, over the phases
    that ran both ways (MIN_CONTRAST_ITERATIONS beside mostly idle and as many beside
    mostly busy ones, each side MIN_CONTRAST_SHARE of the phase's time; None where no
    phase did): weighted least squares of measured = a_phase x profiled + b x profiled x
    busy share (+ s x sequences, decode), each iteration's relative error weighed by its
    time; the slowdown is b over the phases' a (weighed by their profiled time), one for
    both phases, clamped to [0, MAX_BUSY_SLOWDOWN]."""
    told = {}
    for phase, timed in kind_to_timed.items():
        timed = [t for t in timed if t[1] > 0]
        busy = [share >= 0.5 for _, _, share in timed]
        busy_s = sum(p for (_, p, _), is_busy in zip(timed, busy, strict=True) if is_busy)
        total_s = sum(p for _, p, _ in timed)
        if (min(sum(busy), len(timed) - sum(busy)) >= MIN_CONTRAST_ITERATIONS
                and min(busy_s, total_s - busy_s) >= MIN_CONTRAST_SHARE * total_s):
            told[phase] = timed
    if not told:
        return None
    # columns: a per phase, b, then s where decode is told
    num_columns = len(told) + 1 + ("decode" in told)
    design, measured, weights = [], [], []
    for column, (phase, timed) in enumerate(told.items()):
        for item, p, share in timed:
            row = [0.0] * num_columns
            row[column], row[len(told)] = p, p * share
            if phase == "decode":
                row[-1] = len(item.lens)
            design.append(row)
            measured.append(item.busy_s)
            weights.append(1.0 / math.sqrt(p))
    w = np.array(weights)
    coef, *_ = np.linalg.lstsq(np.array(design) * w[:, None], np.array(measured) * w,
                               rcond=None)
    profiled = [sum(p for _, p, _ in timed) for timed in told.values()]
    alone = float(np.dot(coef[:len(told)], profiled) / sum(profiled))
    slowdown = float(coef[len(told)]) / alone if alone > 0 else 0.0
    return min(MAX_BUSY_SLOWDOWN, max(0.0, slowdown))


def _beside_busy(timed: list[tuple[Iteration, float, float]], slowdown: float,
                 ) -> list[tuple[Iteration, float]]:
    """(iteration, the profile's time slowed by the others' busy share) of each."""
    return [(item, p * (1.0 + slowdown * share)) for item, p, share in timed]


def _phase_fit(phase: str, pairs: list[tuple[Iteration, float]]) -> PhaseFit:
    pairs = [(item, p) for item, p in pairs if p > 0]
    if not pairs:
        return PhaseFit(phase, 0, 0.0, 0.0, 0.0, math.nan, math.nan)
    ratios = np.array([item.busy_s / p for item, p in pairs])
    timed = [item for item, _ in pairs if item.cpu_s is not None]
    sequence_s = _sequence_s(pairs) if phase == "decode" else 0.0
    return PhaseFit(phase, len(pairs), sum(item.busy_s for item, _ in pairs),
                    sum(p for _, p in pairs), sum(item.overhead_s for item, _ in pairs),
                    float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90)),
                    sum(item.seconds for item in timed), sum(item.cpu_s for item in timed),
                    sequence_s, sum(len(item.lens) for item, _ in pairs))


def _sequence_s(pairs: list[tuple[Iteration, float]]) -> float:
    """Decode: the seconds per sequence s in measured = f x profiled + s x sequences, by
    least squares over the iterations (0 where that comes out negative, or where the
    batches do not vary enough to tell s from f)."""
    measured = np.array([item.busy_s for item, _ in pairs])
    design = np.array([[p, len(item.lens)] for item, p in pairs], dtype=float)
    if len(pairs) < 3 or np.linalg.matrix_rank(design) < 2:
        return 0.0
    (_, per_sequence), *_ = np.linalg.lstsq(design, measured, rcond=None)
    return float(per_sequence) if per_sequence > MIN_SEQUENCE_S else 0.0

