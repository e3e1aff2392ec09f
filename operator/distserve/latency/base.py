"""The contract every latency model keeps, and the costs all of them share.

A latency model answers one question for the simulator: how many seconds one pipeline
stage of an instance (tp GPUs running num_layers / pp layers) spends on one iteration.
Whole-instance latency is the sum over stages plus the hand-offs between them; the
pipeline's throughput is set by its slowest stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from distserve.catalog import Accelerator, ModelArch

# The authors' simulator charges every iteration a Ray dispatch overhead of
# 2 ms + 0.0001 ms per token in the batch (a100-opt-profile.json, "formulas"). It is a
# property of the engine, not of the hardware, so both latency models add it.
DISPATCH_BASE_S = 2e-3
DISPATCH_PER_TOKEN_S = 1e-7

# A point-to-point send of a few MB between two GPUs costs a launch and a
# synchronisation on top of bytes / bandwidth (NCCL send/recv, measured ~10-20 us).
P2P_LATENCY_S = 15e-6


@runtime_checkable
class LatencyModel(Protocol):
    """Seconds a pipeline stage spends per iteration, for one (model, accelerator, tp, pp)."""

    model: ModelArch
    accelerator: Accelerator
    tp: int
    pp: int
    serving_mode: str  # "disaggregated" or "colocated": whose iterations it times
    source: str  # "profile" or "analytic"

    def prefill_stage_s(self, prompt_lens: Sequence[int]) -> float:
        """Seconds one stage spends on a prefill batch of these prompt lengths."""
        ...

    def decode_stage_s(self, context_lens: Sequence[int]) -> float:
        """Seconds one stage spends on one decode step; lengths include the new token."""
        ...

    def mixed_stage_s(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]
    ) -> float:
        """One colocated iteration: prefill chunks (new_tokens, tokens_already_in_context)
        batched with decode steps of these context lengths."""
        ...

    def stage_handoff_s(self, num_tokens: int) -> float:
        """Seconds to pass num_tokens activations from one pipeline stage to the next."""
        ...


def layers_per_stage(model: ModelArch, pp: int) -> int:
    """Layers on the fullest pipeline stage (the one that paces the pipeline)."""
    return math.ceil(model.num_layers / pp)


def dispatch_overhead_s(num_tokens: int) -> float:
    """The engine's per-iteration dispatch cost for a batch of num_tokens tokens."""
    return DISPATCH_BASE_S + DISPATCH_PER_TOKEN_S * num_tokens


def handoff_s(model: ModelArch, accelerator: Accelerator, num_tokens: int) -> float:
    """Activation hand-off between stages over the intra-node link (0 for no tokens)."""
    if num_tokens <= 0:
        return 0.0
    activation_bytes = num_tokens * model.hidden_size * model.dtype_bytes
    return P2P_LATENCY_S + activation_bytes / accelerator.intra_node_link_bytes_per_s


def check_parallelism(model: ModelArch, tp: int, pp: int) -> None:
    """Raise ValueError when tp or pp cannot split this model."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be at least 1, got tp={tp} pp={pp}")
    if pp > model.num_layers:
        raise ValueError(f"pp={pp} exceeds the {model.num_layers} layers of {model.name}")


class StageLatencyBase:
    """What every latency model shares: its (model, accelerator, tp, pp), the engine's
    dispatch overhead, and the hand-off between stages."""

    def __init__(
        self,
        model: ModelArch,
        accelerator: Accelerator,
        tp: int,
        pp: int,
        serving_mode: str = "disaggregated",
        *,
        enable_dispatch_overhead: bool = True,
    ) -> None:
        check_parallelism(model, tp, pp)
        self.model, self.accelerator, self.tp, self.pp = model, accelerator, tp, pp
        self.serving_mode = serving_mode
        self.enable_dispatch_overhead = enable_dispatch_overhead

    def _overhead_s(self, num_tokens: int) -> float:
        # NOTE: charged on every stage: it stalls the first stage, which paces the pipeline.
        return dispatch_overhead_s(num_tokens) if self.enable_dispatch_overhead else 0.0

    def stage_handoff_s(self, num_tokens: int) -> float:
        """Activation hand-off to the next stage over the intra-node link (0 with one stage)."""
        return handoff_s(self.model, self.accelerator, num_tokens) if self.pp > 1 else 0.0
