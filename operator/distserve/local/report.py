"""Latency percentiles, SLO attainment and goodput of a load run, beside a plan's prediction
or the simulator's for the same requests, and the machine's load while it ran."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from distserve.local.load import Outcome
from distserve.plan import Plan

LOAD_SAMPLE_S = 1.0  # seconds between two samples of the load average
GOAL_ATTAINMENT_PT = 2.0  # fidelity's goal: simulated attainment within this of measured
GOAL_PERCENTILE_REL = 0.10  # and each simulated percentile within this share of measured
# the percentiles the goal holds: label, RunSummary field, percentile
GOAL_PERCENTILES = (("TTFT p50", "ttft_p_s", 50), ("TTFT p90", "ttft_p_s", 90),
               ("TPOT p50", "tpot_p_s", 50), ("TPOT p90", "tpot_p_s", 90))


@dataclass
class RunSummary:
    """One load run at one rate."""

    rate_rps: float
    num_requests: int
    num_errors: int
    attainment: float  # share of requests meeting both SLOs
    ttft_p_s: dict[int, float]  # percentile -> seconds
    tpot_p_s: dict[int, float]
    num_prefill_batches: int | None = None  # simulated runs: prefill iterations (`SimResult`)

    @property
    def slo_goodput_rps(self) -> float:
        """Requests per second served within both SLOs at this rate."""
        return self.rate_rps * self.attainment


def summarize(outcomes: list[Outcome], rate_rps: float, ttft_slo_s: float,
              tpot_slo_s: float) -> RunSummary:
    """Percentiles over the successful requests; attainment over all of them."""
    ok = [o for o in outcomes if o.error is None and o.ttft_s is not None]
    ttfts = np.array([o.ttft_s for o in ok]) if ok else np.array([np.nan])
    tpots = np.array([o.tpot_s for o in ok if o.tpot_s is not None]) if ok else np.array([np.nan])
    if tpots.size == 0:
        tpots = np.array([np.nan])
    met = sum(o.meets(ttft_slo_s, tpot_slo_s) for o in outcomes)
    return RunSummary(
        rate_rps=rate_rps,
        num_requests=len(outcomes),
        num_errors=len(outcomes) - len(ok),
        attainment=met / max(1, len(outcomes)),
        ttft_p_s={p: float(np.percentile(ttfts, p)) for p in (50, 90, 99)},
        tpot_p_s={p: float(np.percentile(tpots, p)) for p in (50, 90, 99)},
    )


def format_summary(s: RunSummary, plan: Plan | None, target: float,
                   predicted: RunSummary | None = None) -> str:
    """Measured figures; beside them the simulator's for the same requests (predicted)
    when given, and the planner's goodput when there is a plan."""
    def sim(text: str) -> str:
        return f"   (simulated: {text})" if predicted is not None else ""

    p = predicted
    lines = [
        f"  rate        {s.rate_rps:.2f} req/s, {s.num_requests} requests, {s.num_errors} errors"
        + sim("the same requests at the same times"),
        f"  TTFT        {_percentiles(s.ttft_p_s, '.3f')}" + (sim(_percentiles(p.ttft_p_s, '.3f')) if p else ""),
        f"  TPOT        {_percentiles(s.tpot_p_s, '.4f')}" + (sim(_percentiles(p.tpot_p_s, '.4f')) if p else ""),
        f"  attainment  {s.attainment:.1%} of requests met both SLOs (target {target:.0%})"
        + (sim(f"{p.attainment:.1%}") if p else ""),
        f"  goodput     {s.slo_goodput_rps:.2f} req/s within SLO at this rate; "
        f"{'meets' if s.attainment >= target else 'misses'} the target"
        + (sim(f"{p.slo_goodput_rps:.2f} req/s") if p else "")
        + (f"   (planner goodput: {plan.goodput_rps:.2f} req/s)" if plan else ""),
    ]
    return "\n".join(lines)


def _percentiles(p_s: dict[int, float], fmt: str) -> str:
    return "  ".join(f"p{q} {p_s[q]:{fmt}} s" for q in (50, 90, 99))


class LoadSampler:
    """The 1-minute load average at the start, its mean over the run, and at the end."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(LOAD_SAMPLE_S):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> tuple[float, float, float]:
        """(start, mean, end) of the samples."""
        return self.samples[0], sum(self.samples) / len(self.samples), self.samples[-1]


def format_comparison(what: str, rate: float, measured, predicted, load: tuple[float, float, float],
                      target: float) -> str:
    """One rate's block: each figure measured, simulated, the gap and the goal, and the load."""
    load_text = f"load {load[0]:.1f} -> {load[2]:.1f} (mean {load[1]:.1f})"
    lines = [f"{what} at {rate:g} req/s: {measured.num_requests} requests, "
             f"{measured.num_errors} errors (simulated {predicted.num_errors} refused or "
             f"unfinished); {load_text}; gap: simulated less measured"]
    gap = (predicted.attainment - measured.attainment) * 100  # simulated - measured
    label_to_within = goals_met(measured, predicted)
    within = label_to_within["attainment"]
    lines.append(f"  attainment  measured {measured.attainment:6.1%}  simulated {predicted.attainment:6.1%}"
                 f"  gap {gap:+5.1f} pt  {'within' if within else 'outside'} {GOAL_ATTAINMENT_PT:g} pt   "
                 f"[{load_text}] (target {target:.0%})")
    for label, field, p in GOAL_PERCENTILES:
        m, s = getattr(measured, field)[p], getattr(predicted, field)[p]
        rel = (s - m) / m if m else float("nan")  # simulated relative to measured
        verdict = "within" if label_to_within[label] else "outside"
        lines.append(f"  {label}    measured {m:7.3f} s simulated {s:7.3f} s  gap {rel:+6.1%}   "
                     f"{verdict} {GOAL_PERCENTILE_REL:.0%}   [{load_text}]")
    return "\n".join(lines)


def goals_met(measured: RunSummary, predicted: RunSummary) -> dict[str, bool]:
    """{"attainment", then each of GOAL_PERCENTILES' labels: whether the simulated figure
    is within the goal of the measured one}."""
    out = {"attainment": abs(predicted.attainment - measured.attainment) * 100
           <= GOAL_ATTAINMENT_PT}
    for label, field, p in GOAL_PERCENTILES:
        m, s = getattr(measured, field)[p], getattr(predicted, field)[p]
        out[label] = bool(m) and abs(s - m) / m <= GOAL_PERCENTILE_REL
    return out


def format_gaps(measured: RunSummary, predicted: RunSummary) -> str:
    """Each figure's gap in one line, e.g. "attainment +0.2 pt, TTFT p50 -2.3%, ...: 5 of 5
    within the goal"."""
    within = goals_met(measured, predicted)
    parts = [f"attainment {(predicted.attainment - measured.attainment) * 100:+.1f} pt"]
    for label, field, p in GOAL_PERCENTILES:
        m, s = getattr(measured, field)[p], getattr(predicted, field)[p]
        parts.append(f"{label} {_relative_gap(m, s)}")
    return f"{', '.join(parts)}: {sum(within.values())} of {len(within)} within the goal"


def format_tally(what: str, pairs: list[tuple[RunSummary, RunSummary]],
                 how: str = "") -> str:
    """How many runs' figures the simulator met the goal for, figure by figure, over
    (measured, predicted) pairs: the comparison's verdict in one line (`how`: how it was
    simulated, where not as predicted)."""
    verdicts = [goals_met(m, p) for m, p in pairs]

    def count(label: str) -> int:
        return sum(v[label] for v in verdicts)

    labels = [label for label, _, _ in GOAL_PERCENTILES]
    return (f"{what}: the simulator{how} within the goal ({GOAL_ATTAINMENT_PT:g} pt, "
            f"{GOAL_PERCENTILE_REL:.0%}) for attainment at {count('attainment')} of "
            f"{len(pairs)} runs and for {sum(map(count, labels))} of {len(pairs) * len(labels)} "
            "percentiles (" + ", ".join(f"{label} {count(label)}" for label in labels) + ")")


def format_replays(what: str, rate: float, replays: list[tuple[RunSummary, RunSummary]],
                   as_ran: list[RunSummary] | None = None) -> str:
    """The replays of the same requests at one rate, (measured, simulated) each: how far
    apart the measured figures lie, whether one figure could be within the goal of every
    replay (no prediction can do better than that), and the simulator's gap to each, and
    with `as_ran` (each replay simulated at its own speed as it moved) the gap to that."""
    measured = [m for m, _ in replays]
    predicted = [s for _, s in replays]

    def gaps(gap, simulated: list[RunSummary], unit: str = "") -> str:
        """gap(measured, simulated) of each replay, joined; and the same to `as_ran`."""
        text = ", ".join(gap(m, s) for m, s in zip(measured, simulated, strict=True))
        if as_ran is None:
            return text + unit
        return (text + unit + "; replaying each one's speed as it moved, gaps "
                + ", ".join(gap(m, s) + unit for m, s in zip(measured, as_ran, strict=True)))

    lines = [f"{what} at {rate:g} req/s, {len(replays)} replays of the same requests at the "
             "same times: the measured figures, how far apart, and the simulator's gap to each "
             "(simulated less measured)"]
    attained = [m.attainment * 100 for m in measured]
    apart = max(attained) - min(attained)
    one_fits = apart <= 2 * GOAL_ATTAINMENT_PT
    points = gaps(lambda m, s: f"{(s.attainment - m.attainment) * 100:+.1f}", predicted, " pt")
    lines.append(f"  attainment  measured {_range(attained, '.1f')} %, {apart:.1f} pt apart: "
                 f"{_fits(one_fits)} within {GOAL_ATTAINMENT_PT:g} pt of every replay; "
                 f"gaps {points}")
    for label, field, p in GOAL_PERCENTILES:
        ms = [getattr(m, field)[p] for m in measured]
        one_fits = (1 - GOAL_PERCENTILE_REL) * max(ms) <= (1 + GOAL_PERCENTILE_REL) * min(ms)
        ratio = f"x{max(ms) / min(ms):.2f}" if min(ms) > 0 else "n/a"
        relative = gaps(lambda m, s, field=field, p=p: _relative_gap(getattr(m, field)[p],
                                                                      getattr(s, field)[p]),
                        predicted)
        lines.append(f"  {label}    measured {_range(ms, '.3f')} s, highest {ratio} the lowest: "
                     f"{_fits(one_fits)} within {GOAL_PERCENTILE_REL:.0%} of every replay; "
                     f"gaps {relative}")
    return "\n".join(lines)


def _relative_gap(measured: float, simulated: float) -> str:
    return f"{(simulated - measured) / measured:+.1%}" if measured else "n/a"


def format_draws(draws: list[RunSummary], measured: RunSummary) -> str:
    """The range of each figure over the histories of a drifting speed the prediction
    drew, and whether the measured figure lies inside it."""
    def part(label: str, values: list[float], value: float, fmt: str, unit: str) -> str:
        inside = "inside" if min(values) <= value <= max(values) else "outside"
        return f"{label} {_range(values, fmt)}{unit} ({inside})"

    parts = [part("attainment", [d.attainment * 100 for d in draws], measured.attainment * 100,
                  ".1f", "%")]
    parts += [part(label, [getattr(d, field)[p] for d in draws], getattr(measured, field)[p],
                   ".3f", " s") for label, field, p in GOAL_PERCENTILES]
    return (f"  over {len(draws)} histories of the speed's drift (the simulated figure is the "
            "median; whether the measured one lies inside the range): " + ", ".join(parts))


def _range(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def _fits(one_fits: bool) -> str:
    return "one figure can be" if one_fits else "no one figure is"


def format_other(what: str, predicted) -> str:
    """The simulator's figures under another correction (the profile as measured, or a
    run's own iteration factors), to tell the latency model's error from the rest."""
    return (f"  {what}: attainment {predicted.attainment:6.1%}, "
            f"TTFT p50/p90 {predicted.ttft_p_s[50]:.3f}/{predicted.ttft_p_s[90]:.3f} s, "
            f"TPOT p50/p90 {predicted.tpot_p_s[50]:.3f}/{predicted.tpot_p_s[90]:.3f} s"
            + ("" if predicted.num_prefill_batches is None else
               f", {predicted.num_prefill_batches} prefill iterations"))
