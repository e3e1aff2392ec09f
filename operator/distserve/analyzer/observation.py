"""What the workload analyzer saw in one window: the contract between observing and deciding.

`observe.py` fills an `Observation` from Prometheus (never from the pods); `decide.py`
turns it, the current plan and the spec into keep-or-replan. Every figure is over the
window `[end_s - window_s, end_s]`; a figure that could not be measured is None, and
`num_requests` below the spec's minimum means no decision is made on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LengthFit:
    """A length distribution fitted to a histogram's binned counts (tokens)."""

    family: str  # the scipy.stats family chosen, e.g. "lognorm", or "histogram" (the counts' own shape)
    params: tuple[float, ...]  # its parameters, as scipy.stats takes them (none for "histogram")
    mean_tokens: float
    p50_tokens: float
    p90_tokens: float
    bucket_upper_tokens: tuple[float, ...]  # the histogram's upper bounds (le), +Inf last
    bucket_counts: tuple[float, ...]  # requests per bucket in the window (not cumulative)

    @property
    def bounds(self) -> tuple[float, ...]:
        """The histogram's bounds (two histograms with equal bounds add up bucket by bucket)."""
        return self.bucket_upper_tokens

    @property
    def cells(self) -> tuple[float, ...]:
        """The histogram's counts, in the order of `bounds`."""
        return self.bucket_counts

    def distribution(self):
        """The fitted distribution as a frozen `scipy.stats` one (continuous: a draw rounds to
        its integer length). The histogram's (`fit.HISTOGRAM`) spreads each bucket's share
        evenly over its integers, the +Inf bucket (then empty) left out."""
        import scipy.stats

        if self.family != "histogram":
            return getattr(scipy.stats, self.family)(*self.params)
        upper = np.asarray(self.bucket_upper_tokens, dtype=float)
        counts = np.asarray(self.bucket_counts, dtype=float)
        finite = np.isfinite(upper)
        edges = np.concatenate([[0.0], upper[finite] + 0.5])  # integers (lo, hi] as in fit.py
        return scipy.stats.rv_histogram((counts[finite], edges), density=False)

    def sample(self, num: int, rng: np.random.Generator, max_tokens: int | None = None) -> np.ndarray:
        """`num` lengths drawn from the fit (at least 1, at most `max_tokens`), for the simulator."""
        values = self.distribution().rvs(size=num, random_state=rng)
        values = np.maximum(1, np.rint(values)).astype(np.int64)
        return np.minimum(values, max_tokens) if max_tokens else values


@dataclass(frozen=True)
class JointLengths:
    """Finished requests per (prompt class, generated-length class): which prompts had which
    outputs, coarsely (`distserve_request_generation_tokens_by_prompt`). The two length
    histograms say how long prompts and outputs are; this says how they pair."""

    prompt_upper_tokens: tuple[float, ...]  # the classes' upper bounds (prompt_le), +Inf last
    output_upper_tokens: tuple[float, ...]  # the buckets' upper bounds (le), +Inf last
    counts: tuple[tuple[float, ...], ...]  # [prompt class][output bucket], not cumulative

    @property
    def total(self) -> float:
        return float(np.sum(self.counts))

    @property
    def bounds(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The classes' and the buckets' bounds (as `LengthFit.bounds`)."""
        return self.prompt_upper_tokens, self.output_upper_tokens

    @property
    def cells(self) -> tuple[tuple[float, ...], ...]:
        """The counts, per prompt class and output bucket (as `LengthFit.cells`)."""
        return self.counts

    @classmethod
    def of_lengths(cls, prompts: np.ndarray, outputs: np.ndarray,
                   max_model_len: int) -> JointLengths:
        """What the engine's joint histogram holds for these (prompt, output) pairs."""
        # NOTE: imported here: the engine's metrics module pulls in torch, which the
        # operator (that imports this module) must not need
        from distserve_engine.metrics import joint_buckets_tokens

        upper = (*(float(b) for b in joint_buckets_tokens(max_model_len)), float("inf"))
        rows = np.searchsorted(np.asarray(upper[:-1]), prompts, side="left")
        columns = np.searchsorted(np.asarray(upper[:-1]), outputs, side="left")
        counts = np.zeros((len(upper), len(upper)))
        np.add.at(counts, (rows, columns), 1.0)
        return cls(upper, upper, tuple(tuple(float(c) for c in row) for row in counts))


@dataclass(frozen=True)
class PhaseObservation:
    """One phase's health over the window (prefill or decode)."""

    queue_time_p90_s: float | None = None
    kv_usage_mean: float | None = None  # share of KV blocks in use, mean over instances


@dataclass(frozen=True)
class Observation:
    """The traffic and the service it got over one window."""

    end_s: float  # unix time the window ends
    window_s: float
    num_requests: int  # arrivals in the window, refused ones included
    arrival_rate_rps: float
    arrival_cv: float | None  # burstiness: the gaps' CV from sub-window counts (`observe.dispersion_cv`)
    prompt: LengthFit | None
    output: LengthFit | None
    joint: JointLengths | None = None  # how prompts and outputs pair (None: not exported)
    ttft_attainment: float | None = None  # share of finished requests within the TTFT SLO
    tpot_attainment: float | None = None
    attainment: float | None = None  # both SLOs (the plan's rule)
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    num_refused: int = 0
    phases: dict[str, PhaseObservation] = field(default_factory=dict)  # "prefill", "decode"
    plan_id: str | None = None  # the plan the deployment served under (distserve_plan_info)
    # arrivals per sub-window of `subwindow_s`, oldest first: the window as it came, for
    # replaying it (`replan.SearchEvaluator.replay`); empty when not measured
    arrival_counts: tuple[float, ...] = ()
    subwindow_s: float | None = None
    # The window's last third (arrivals, lengths and attainment): where a rising rate or
    # a shift of the length mix under way is now; against the rest of the window, its
    # trend (`forecast.py`); after a reshuffle early in the window, the service now.
    recent: Observation | None = None
    # The third before `recent` (arrivals and lengths): against it, the pace of a mix
    # shift that began within the window (`forecast.py`)
    previous: Observation | None = None

    @property
    def recent_rate_rps(self) -> float | None:
        """Arrivals per second over the window's last third (None: not measured)."""
        return self.recent.arrival_rate_rps if self.recent is not None else None
