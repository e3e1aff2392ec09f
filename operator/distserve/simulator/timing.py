"""How long one iteration of an instance takes, cached so that a trial rarely asks twice.

The latency model answers for one pipeline stage; this module turns that into the
times the simulators use: a prefill batch's per-stage time and hand-off, and a decode
iteration through all stages of a pipeline lane. Decode time is affine in the batch's
total context for a fixed batch size (every latency model here reads KV once per
token), so it is fitted once per batch size as `alpha + slope * total_context` and
stepped in closed form between batch changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Two context lengths at which the decode line is fitted per batch size.
_FIT_CONTEXT_LO = 256
_FIT_CONTEXT_HI = 1280


class StageTimer:
    """Iteration times of one instance configuration, memoised."""

    def __init__(self, latency_model, pp: int) -> None:
        self.latency = latency_model
        self.pp = pp
        self._prefill: dict[tuple[int, ...], tuple[float, float]] = {}
        self._decode: dict[int, tuple[float, float]] = {}

    def prefill_batch_s(self, prompt_lens: tuple[int, ...]) -> tuple[float, float]:
        """(seconds per stage, seconds of each stage-to-stage hand-off) for a prefill batch."""
        hit = self._prefill.get(prompt_lens)
        if hit is None:
            stage_s = self.latency.prefill_stage_s(prompt_lens)
            handoff_s = self.latency.stage_handoff_s(sum(prompt_lens)) if self.pp > 1 else 0.0
            hit = self._prefill[prompt_lens] = (stage_s, handoff_s)
        return hit

    def prefill_iteration_s(self, prompt_lens: tuple[int, ...]) -> float:
        """A prefill batch through every stage, one after the other (no overlap)."""
        stage_s, handoff_s = self.prefill_batch_s(prompt_lens)
        return self.pp * stage_s + (self.pp - 1) * handoff_s

    def decode_line(self, batch_size: int) -> tuple[float, float]:
        """(alpha_s, slope_s_per_token): a decode iteration through all stages takes
        alpha_s + slope_s_per_token * total_context for this batch size."""
        hit = self._decode.get(batch_size)
        if hit is None:
            lo = self.latency.decode_stage_s([_FIT_CONTEXT_LO] * batch_size)
            hi = self.latency.decode_stage_s([_FIT_CONTEXT_HI] * batch_size)
            slope = (hi - lo) / (batch_size * (_FIT_CONTEXT_HI - _FIT_CONTEXT_LO))
            alpha = lo - slope * batch_size * _FIT_CONTEXT_LO
            handoff = self.latency.stage_handoff_s(batch_size) if self.pp > 1 else 0.0
            hit = (self.pp * alpha + (self.pp - 1) * handoff, self.pp * max(slope, 0.0))
            self._decode[batch_size] = hit
        return hit

    def mixed_iteration_s(
        self, chunks: Sequence[tuple[int, int]], batch_size: int, total_context: int
    ) -> float:
        """A chunked-prefill iteration (chunks plus batch_size piggybacked decodes)
        through every stage. Decode contexts are passed as their mean, exact for the
        affine decode cost."""
        mean_ctx = total_context // batch_size if batch_size else 0
        stage_s = self.latency.mixed_stage_s(list(chunks), [mean_ctx] * batch_size)
        tokens = sum(new for new, _ in chunks) + batch_size
        handoff_s = self.latency.stage_handoff_s(tokens) if self.pp > 1 else 0.0
        return self.pp * stage_s + (self.pp - 1) * handoff_s


class ScaledTimer:
    """A timer whose times are another's multiplied by a speed of the moment they are
    asked for (`prefill_speed`, `decode_speed`, for a subclass to say): the same calls,
    so the simulators take one where they take the other."""

    __slots__ = ("timer", "pp")

    def __init__(self, timer) -> None:
        self.timer = timer
        self.pp = timer.pp

    def prefill_speed(self) -> float:
        """The multiplier on a prefill batch (or chunked iteration) starting now."""
        raise NotImplementedError

    def decode_speed(self) -> float:
        """The multiplier on decode steps from now."""
        raise NotImplementedError

    def prefill_batch_s(self, prompt_lens: tuple[int, ...]) -> tuple[float, float]:
        """(seconds per stage, seconds of each hand-off) for a prefill batch starting now."""
        stage_s, handoff_s = self.timer.prefill_batch_s(prompt_lens)
        speed = self.prefill_speed()
        return stage_s * speed, handoff_s * speed

    def prefill_iteration_s(self, prompt_lens: tuple[int, ...]) -> float:
        """A prefill batch starting now through every stage."""
        return self.timer.prefill_iteration_s(prompt_lens) * self.prefill_speed()

    def decode_line(self, batch_size: int) -> tuple[float, float]:
        """(alpha_s, slope_s_per_token) of decode steps from now (`StageTimer.decode_line`)."""
        alpha_s, slope_s = self.timer.decode_line(batch_size)
        speed = self.decode_speed()
        return alpha_s * speed, slope_s * speed

    def mixed_iteration_s(self, chunks: Sequence[tuple[int, int]], batch_size: int,
                          total_context: int) -> float:
        """A chunked-prefill iteration starting now, at prefill's speed (its chunks)."""
        return self.timer.mixed_iteration_s(chunks, batch_size, total_context) * self.prefill_speed()


@dataclass
class InstanceModel:
    """What a simulator needs of one instance: its timer, stages and KV memory."""

    timer: StageTimer
    kv_capacity_tokens: int
    pp: int = field(init=False)

    def __post_init__(self) -> None:
        self.pp = self.timer.pp
