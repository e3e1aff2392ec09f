"""Small factories for simulator tests: a fake latency model, instances, traces."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distserve.simulator import InstanceModel, StageTimer, Trace


@dataclass
class FakeLatency:
    """A latency model with round numbers: prefill linear in tokens, decode affine."""

    pp: int = 1
    prefill_base_s: float = 0.0
    prefill_s_per_token: float = 1e-4
    decode_base_s: float = 0.02
    decode_s_per_token: float = 1e-6
    handoff_s: float = 0.0

    def prefill_stage_s(self, prompt_lens) -> float:
        return (self.prefill_base_s + self.prefill_s_per_token * sum(prompt_lens)) / self.pp

    def decode_stage_s(self, context_lens) -> float:
        if not context_lens:
            return 0.0
        return (self.decode_base_s + self.decode_s_per_token * sum(context_lens)) / self.pp

    def mixed_stage_s(self, prefill_chunks, decode_context_lens) -> float:
        new = sum(n for n, _ in prefill_chunks)
        return self.prefill_stage_s([new]) + self.decode_stage_s(decode_context_lens)

    def stage_handoff_s(self, num_tokens: int) -> float:
        return self.handoff_s


def make_instance(kv_capacity_tokens: int = 10**6, **latency) -> InstanceModel:
    """An instance of the fake latency model."""
    fake = FakeLatency(**latency)
    return InstanceModel(StageTimer(fake, fake.pp), kv_capacity_tokens)


def make_trace(
    num_requests: int, rate_rps: float, *, prompt_tokens: int | None = None,
    output_tokens: int | None = None, seed: int = 0,
) -> Trace:
    """Poisson arrivals; fixed lengths where given, else uniform random ones."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, num_requests))
    prompts = (np.full(num_requests, prompt_tokens) if prompt_tokens
               else rng.integers(32, 1024, num_requests))
    outputs = (np.full(num_requests, output_tokens) if output_tokens
               else rng.integers(2, 256, num_requests))
    return Trace(arrivals, prompts.astype(np.int64), outputs.astype(np.int64))
