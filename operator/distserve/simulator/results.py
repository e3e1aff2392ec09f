"""What a simulation reports per request, and how SLO attainment is judged from it.

A request's TTFT is the time from its arrival to its first token (which the prefill
phase produces); its TPOT is (finish - first token) / (output tokens - 1). Attainment
is either the share of requests meeting both SLOs ("both") or, under "per-phase", the
smaller of the shares meeting each SLO, so that the P-th percentile TTFT and TPOT are
each within their SLO exactly when attainment >= P.

The recorder also decides when a trial may stop early: once more requests have failed
than the target allows, no later event can bring attainment back up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distserve_engine.admission import AdmissionControl, Overloaded, Ticket


@dataclass(frozen=True)
class SLO:
    """Latency objectives and the share of requests that must meet them."""

    ttft_s: float
    tpot_s: float
    attainment: float = 0.9
    rule: str = "both"  # "both" or "per-phase"


@dataclass(frozen=True)
class Trace:
    """The requests of one trial as columns (the simulators index them by position)."""

    arrival_s: np.ndarray  # (N,) float, sorted
    prompt_tokens: np.ndarray  # (N,) int
    output_tokens: np.ndarray  # (N,) int, at least 1

    @property
    def num_requests(self) -> int:
        """How many requests the trace holds."""
        return len(self.arrival_s)

    @classmethod
    def from_requests(cls, requests: Sequence) -> Trace:
        """Columns from objects with arrival_s, prompt_tokens and output_tokens."""
        ordered = sorted(requests, key=lambda r: r.arrival_s)
        return cls(
            np.array([r.arrival_s for r in ordered], dtype=float),
            np.array([max(1, int(r.prompt_tokens)) for r in ordered], dtype=np.int64),
            np.array([max(1, int(r.output_tokens)) for r in ordered], dtype=np.int64),
        )

    def at_rate(self, rate_scale: float, num_requests: int | None = None) -> Trace:
        """The first num_requests requests (default all) with arrivals compressed
        rate_scale times, lengths kept."""
        n = num_requests or self.num_requests
        return Trace(self.arrival_s[:n] / rate_scale, self.prompt_tokens[:n], self.output_tokens[:n])


@dataclass(frozen=True)
class SimResult:
    """Per-request latencies of one trial; NaN where a request never got that far."""

    ttft_s: np.ndarray  # (N,)
    tpot_s: np.ndarray  # (N,)
    is_stopped_early: bool  # the trial ended once the SLO target was out of reach
    duration_s: float  # simulated time until the last event
    num_preemptions: int = 0  # decode requests preempted for lack of KV (recomputed)
    # prefill iterations run: prefill batches, and the prefills of preempted requests
    # (what the engine's instances log as "prefill" iterations, to set beside them)
    num_prefill_batches: int = 0
    # requests the router refused on arrival (its limit of requests waiting for their
    # first token, `max_waiting`, or their predicted TTFT past `admit_by_ttft_s`): NaN
    # latencies, failures, as a 429 is to a client
    num_refused: int = 0

    def attainment(self, slo: SLO) -> float:
        """Share of requests meeting the SLOs under slo.rule (unfinished ones fail)."""
        n = len(self.ttft_s)
        if n == 0:
            return 0.0
        with np.errstate(invalid="ignore"):
            ttft_ok = self.ttft_s <= slo.ttft_s  # NaN compares False: a failure
            tpot_ok = self.tpot_s <= slo.tpot_s
        if slo.rule == "per-phase":
            return float(min(ttft_ok.sum(), tpot_ok.sum())) / n
        return float((ttft_ok & tpot_ok).sum()) / n

    def percentile_s(self, which: str, q: float) -> float:
        """The q-th percentile of "ttft" or "tpot" over requests that reached it."""
        values = self.ttft_s if which == "ttft" else self.tpot_s
        values = values[~np.isnan(values)]
        return float(np.percentile(values, q)) if len(values) else math.nan


class Recorder:
    """Collects first-token and finish times and stops the loop when the SLO is lost."""

    def __init__(self, trace: Trace, slo: SLO | None, loop, max_waiting: int | None = None,
                 admit_by_ttft_s: float | None = None, num_entry: int = 1) -> None:
        n = trace.num_requests
        self.arrival_s = trace.arrival_s.tolist()
        self.output_tokens = trace.output_tokens.tolist()
        self.ttft_s = [math.nan] * n
        self.tpot_s = [math.nan] * n
        self._loop = loop
        self._slo = slo
        # NOTE: with no SLO (plots, `distserve simulate`) every request runs to the end.
        self._allowed = n if slo is None else math.floor((1.0 - slo.attainment) * n + 1e-9)
        self._is_both = slo is None or slo.rule != "per-phase"
        self._ttft_failed = 0
        self._tpot_failed = 0
        self._ttft_ok = [True] * n
        self.num_preemptions = 0  # the simulators count here
        self.num_prefill_batches = 0
        # the engine's router's own admission (None: every request is admitted), with
        # the prompt of each request and the instances a request enters by (prefill, or
        # colocated), over which it shares the waiting prompt tokens
        self._admission = None if max_waiting is None and admit_by_ttft_s is None else (
            AdmissionControl(max_waiting if max_waiting is not None else math.inf, None,
                             admit_by_ttft_s, admit_by_ttft_s is not None))
        self._prompt_tokens = trace.prompt_tokens.tolist()
        self._num_entry = num_entry
        self._tickets: dict[int, Ticket] = {}  # admitted and not finished
        self.num_refused = 0

    def admit(self, rid: int) -> bool:
        """Whether the router takes request rid on arrival, by the engine's router's own
        `AdmissionControl` (`distserve_engine.admission`): refused (a failure, never
        served, as a 429 is to a client) while `max_waiting` admitted requests wait for
        their first token, or, with `admit_by_ttft_s`, when the TTFT its line fitted on
        the requests so far predicts for the prompt tokens queued ahead is past it."""
        if self._admission is None:
            return True
        try:
            self._tickets[rid] = self._admission.admit(int(self._prompt_tokens[rid]),
                                                       self._num_entry)
        except Overloaded:
            self.num_refused += 1
            self._ttft_ok[rid] = False
            self._ttft_failed += 1
            if not self._is_both:
                self._tpot_failed += 1
            self._check()
            return False
        return True

    def first_token(self, rid: int, time_s: float) -> None:
        """Request rid produced its first token at time_s."""
        ttft = time_s - self.arrival_s[rid]
        ticket = self._tickets.get(rid)
        if ticket is not None:
            ticket.first_token(ttft)  # no longer waiting; its TTFT trains the line
        self.ttft_s[rid] = ttft
        if self._slo is not None and ttft > self._slo.ttft_s:
            self._ttft_ok[rid] = False
            self._ttft_failed += 1
            self._check()

    def finish(self, rid: int, time_s: float, first_token_s: float) -> None:
        """Request rid produced its last token at time_s."""
        ticket = self._tickets.pop(rid, None)
        if ticket is not None:
            ticket.release()
        out = self.output_tokens[rid]
        tpot = (time_s - first_token_s) / (out - 1) if out > 1 else 0.0
        self.tpot_s[rid] = tpot
        if self._slo is not None and tpot > self._slo.tpot_s:
            # under "both" a request that already missed TTFT is not counted twice
            if not self._is_both or self._ttft_ok[rid]:
                self._tpot_failed += 1
                self._check()

    def _check(self) -> None:
        failed = (
            self._ttft_failed + self._tpot_failed
            if self._is_both
            else max(self._ttft_failed, self._tpot_failed)
        )
        if failed > self._allowed:
            self._loop.is_stopped = True

    def result(self) -> SimResult:
        """The trial's per-request latencies."""
        return SimResult(
            np.array(self.ttft_s, dtype=float),
            np.array(self.tpot_s, dtype=float),
            self._loop.is_stopped,
            self._loop.now,
            self.num_preemptions,
            self.num_prefill_batches,
            self.num_refused,
        )
