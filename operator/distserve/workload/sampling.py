"""Workloads: which requests the simulator replays at a given rate.

A `Workload` pairs a length sample (a shipped dataset or a trace's lengths) with an
arrival process (Poisson, gamma with a coefficient of variation, or a trace's own
inter-arrival pattern). `sample(rate_rps, num_requests, seed)` draws requests: lengths
drawn at random from the sample (a trace's are replayed in order from its first
request, cycling),
arrivals at the requested mean rate. The same seed gives the same requests, so every
candidate placement of a search sees the same traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distserve.workload.arrivals import gamma_arrivals, poisson_arrivals, scaled_trace_arrivals
from distserve.workload.lengths import LengthSample, load_lengths
from distserve.workload.trace import Request, TraceError, load_trace

ARRIVALS = ("poisson", "gamma", "trace")


@dataclass(frozen=True)
class Workload:
    """Lengths and an arrival process; draws request lists at any rate."""

    lengths: LengthSample
    arrival: str = "poisson"  # "poisson", "gamma" or "trace"
    cv: float = 1.0  # coefficient of variation of gamma gaps
    trace_gaps_s: np.ndarray | None = None  # inter-arrival gaps of the trace, for "trace"
    is_trace_order: bool = False  # replay lengths in the trace's order instead of at random

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.arrival == "trace" and self.trace_gaps_s is None:
            raise ValueError("arrival 'trace' needs a trace (Workload.from_trace)")
        if self.cv <= 0:
            raise ValueError(f"cv must be positive, got {self.cv}")

    @property
    def name(self) -> str:
        """The dataset's name or the trace's path."""
        return self.lengths.name

    @property
    def trace_rate_rps(self) -> float | None:
        """The trace's own mean rate, or None without a trace pattern."""
        if self.trace_gaps_s is None:
            return None
        return 1.0 / float(np.mean(self.trace_gaps_s))

    @classmethod
    def from_dataset(cls, name: str, arrival: str = "poisson", cv: float = 1.0) -> Workload:
        """A shipped dataset (chatbot, code, summarization) with Poisson or gamma arrivals."""
        return cls(load_lengths(name), arrival, cv)

    @classmethod
    def from_trace(cls, path: str | Path, arrival: str = "trace", cv: float = 1.0) -> Workload:
        """A JSON Lines trace: its lengths in order, its own gaps (or Poisson/gamma)."""
        requests = sorted(load_trace(path), key=lambda r: r.arrival_s)
        lengths = LengthSample(
            str(path),
            np.array([r.prompt_tokens for r in requests], dtype=np.int64),
            np.array([r.output_tokens for r in requests], dtype=np.int64),
        )
        arrivals_s = np.array([r.arrival_s for r in requests])
        span_s = arrivals_s[-1] - arrivals_s[0]
        if span_s <= 0:
            if arrival == "trace":
                raise TraceError(f"{path}: its requests all arrive at once: no pattern to scale")
            return cls(lengths, arrival, cv, is_trace_order=True)
        # NOTE: one gap per request, the first being the mean, so that replaying from the
        # start at the trace's own rate reproduces its arrivals.
        gaps_s = np.diff(arrivals_s, prepend=arrivals_s[0] - span_s / (len(arrivals_s) - 1))
        return cls(lengths, arrival, cv, gaps_s, is_trace_order=True)

    def sample(self, rate_rps: float, num_requests: int, seed: int = 0) -> list[Request]:
        """num_requests requests arriving at a mean rate_rps, the same for the same seed."""
        rng = np.random.default_rng(seed)
        if self.is_trace_order:  # a trace replays from its first request, cycling
            index = np.arange(num_requests) % len(self.lengths)
        else:
            index = rng.integers(0, len(self.lengths), num_requests)
        arrivals_s = self._arrivals(rate_rps, num_requests, rng)
        prompts, outputs = self.lengths.prompt_tokens[index], self.lengths.output_tokens[index]
        return [
            Request(i, float(arrivals_s[i]), int(prompts[i]), int(outputs[i]))
            for i in range(num_requests)
        ]

    def _arrivals(self, rate_rps: float, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        if self.arrival == "poisson":
            return poisson_arrivals(rate_rps, num_requests, rng)
        if self.arrival == "gamma":
            return gamma_arrivals(rate_rps, num_requests, self.cv, rng)
        return scaled_trace_arrivals(self.trace_gaps_s, rate_rps, num_requests)


def make_workload(
    dataset: str = "chatbot",
    trace_path: str | Path | None = None,
    arrival: str = "poisson",
    cv: float = 1.0,
) -> Workload:
    """The workload a spec describes (its `workload` fields): a trace wins over a dataset."""
    if trace_path:
        return Workload.from_trace(trace_path, arrival, cv)
    return Workload.from_dataset(dataset, arrival, cv)
