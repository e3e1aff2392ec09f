"""A latency model scaled per phase by what a running deployment was seen to do.

The profile or the analytic model predicts iteration times offline; a deployment in
production runs faster or slower than that (other kernels, other clocks, a noisy
neighbour). The workload analyzer holds the plan's predicted TTFT and TPOT against the
measured ones and fits one factor per phase (`analyzer/replan.py`); the next search
times every candidate with its latency model wrapped here, so that a replan does not
inherit the offline model's bias. A factor of 1.0 leaves the phase as the model has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distserve.latency.base import LatencyModel

# A factor outside this range is a fit gone wrong (a broken metric, a stalled
# instance), not a slower or faster GPU: the correction never goes beyond it.
MIN_FACTOR = 0.25
MAX_FACTOR = 4.0
MAX_SEQUENCE_S = 0.1  # a decode step's time per sequence beyond this is a fit gone wrong
MAX_BUSY_SLOWDOWN = 1.0  # twice as slow beside busy neighbours is a fit gone wrong


@dataclass(frozen=True)
class Correction:
    """Per-phase multipliers on the latency model's iteration times, and a decode step's
    time per sequence beside its multiplier."""

    prefill_factor: float = 1.0  # prefill batch times are multiplied by this
    decode_factor: float = 1.0  # decode step times are multiplied by this
    # seconds a decode step takes per sequence in it, beyond the factor: work that grows
    # with the batch and that a bare runner's profile does not time (a serving
    # instance's tokens streamed and KV imported on its core; `local.calibration`)
    decode_sequence_s: float = 0.0
    # instances that share a host (a local deployment) each run x(1 + this x the share of
    # the others busy), the factors being their speed alone (`local.calibration`); the
    # latency model does not see it, the simulators do (`simulator.host`)
    busy_slowdown: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_factor", "decode_factor"):
            value = getattr(self, name)
            if not MIN_FACTOR <= value <= MAX_FACTOR:
                raise ValueError(f"{name} must be in [{MIN_FACTOR}, {MAX_FACTOR}], got {value}")
        if not 0.0 <= self.decode_sequence_s <= MAX_SEQUENCE_S:
            raise ValueError(f"decode_sequence_s must be in [0, {MAX_SEQUENCE_S}], got "
                             f"{self.decode_sequence_s}")
        if not 0.0 <= self.busy_slowdown <= MAX_BUSY_SLOWDOWN:
            raise ValueError(f"busy_slowdown must be in [0, {MAX_BUSY_SLOWDOWN}], got "
                             f"{self.busy_slowdown}")

    @property
    def is_identity(self) -> bool:
        """Whether the correction changes nothing."""
        return (self.prefill_factor == 1.0 and self.decode_factor == 1.0
                and self.decode_sequence_s == 0.0 and self.busy_slowdown == 0.0)

    def describe(self) -> str:
        """e.g. "prefill x1.02, decode x0.75 + 0.58 ms a sequence, each x1.09 while the
        others are busy"."""
        return (f"prefill x{self.prefill_factor:.2f}, decode x{self.decode_factor:.2f}"
                f"{per_sequence_text(self.decode_sequence_s)}"
                f"{busy_slowdown_text(self.busy_slowdown)}")

    @staticmethod
    def clamped(prefill_factor: float, decode_factor: float,
                decode_sequence_s: float = 0.0, busy_slowdown: float = 0.0) -> Correction:
        """A correction with both factors brought inside [MIN_FACTOR, MAX_FACTOR] (the
        time per sequence inside [0, MAX_SEQUENCE_S], the slowdown inside [0,
        MAX_BUSY_SLOWDOWN])."""
        def clamp(value: float) -> float:
            return min(MAX_FACTOR, max(MIN_FACTOR, value))

        return Correction(clamp(prefill_factor), clamp(decode_factor),
                          min(MAX_SEQUENCE_S, max(0.0, decode_sequence_s)),
                          min(MAX_BUSY_SLOWDOWN, max(0.0, busy_slowdown)))


def busy_slowdown_text(slowdown: float) -> str:
    """A slowdown beside busy neighbours as a suffix, ", each x1.09 while the others are
    busy" ("" for none)."""
    return f", each x{1 + slowdown:.2f} while the others are busy" if slowdown > 0 else ""


def per_sequence_text(seconds: float) -> str:
    """A decode step's time per sequence as a suffix, " + 0.58 ms a sequence" ("" for none)."""
    return f" + {seconds * 1e3:.2f} ms a sequence" if seconds > 0 else ""


class CorrectedLatencyModel:
    """A latency model whose prefill and decode iterations are scaled by a Correction."""

    def __init__(self, inner: LatencyModel, correction: Correction) -> None:
        self.inner = inner
        self.correction = correction
        self.model, self.accelerator = inner.model, inner.accelerator
        self.tp, self.pp, self.serving_mode = inner.tp, inner.pp, inner.serving_mode
        self.source = f"{inner.source} (corrected)"

    def prefill_stage_s(self, prompt_lens: Sequence[int]) -> float:
        """The inner prefill time times the prefill factor."""
        return self.inner.prefill_stage_s(prompt_lens) * self.correction.prefill_factor

    def decode_stage_s(self, context_lens: Sequence[int]) -> float:
        """The inner decode step time times the decode factor, and the time per sequence
        (shared over the pp stages: once a step)."""
        c = self.correction
        return (self.inner.decode_stage_s(context_lens) * c.decode_factor
                + c.decode_sequence_s * len(context_lens) / self.pp)

    def mixed_stage_s(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]
    ) -> float:
        """A colocated iteration: scaled as prefill when it holds a chunk, else as decode."""
        c = self.correction
        factor = c.prefill_factor if prefill_chunks else c.decode_factor
        return (self.inner.mixed_stage_s(prefill_chunks, decode_context_lens) * factor
                + c.decode_sequence_s * len(decode_context_lens) / self.pp)

    def stage_handoff_s(self, num_tokens: int) -> float:
        """Hand-offs move activations over a link: not corrected."""
        return self.inner.stage_handoff_s(num_tokens)


def corrected(latency_model: LatencyModel, correction: Correction | None) -> LatencyModel:
    """latency_model scaled by correction (the model itself when there is nothing to scale)."""
    if correction is None or correction.is_identity:
        return latency_model
    return CorrectedLatencyModel(latency_model, correction)
