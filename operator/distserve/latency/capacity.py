"""How many KV-cache tokens an instance holds, and whether a model fits on it at all.

An instance of tp x pp GPUs keeps, on each GPU, its share of the fullest stage's
weights, a reserve for activations of the largest batch, and KV cache in what is left
of `memory_utilization` of the GPU's memory. A profile's measured `kv_capacity` row
wins when the profile was taken on the same accelerator.
"""

from __future__ import annotations

import math
from pathlib import Path

from distserve.catalog import Accelerator, ModelArch, get_accelerator, get_model
from distserve.latency.base import layers_per_stage
from distserve.latency.profile import LatencyProfile, default_profile, load_profile

# The activation reserve is sized for a prefill batch of this many tokens (vLLM's
# default max_num_batched_tokens), which is also the largest the planner batches.
ACTIVATION_RESERVE_TOKENS = 2048
# KV cache is allocated in blocks of this many tokens (PagedAttention).
KV_BLOCK_TOKENS = 16


def stage_weight_bytes_per_gpu(model: ModelArch, tp: int, pp: int) -> float:
    """Weight bytes on one GPU of the fullest stage (embeddings counted on it)."""
    stage_params = layers_per_stage(model, pp) * model.layer_params + model.embedding_params
    return stage_params * model.dtype_bytes / tp


def activation_reserve_bytes_per_gpu(model: ModelArch, tp: int) -> float:
    """Peak activation memory of a prefill batch of ACTIVATION_RESERVE_TOKENS tokens."""
    widths = 4 * model.hidden_size + 2 * (model.q_size + model.ffn_size) / tp
    logits = model.vocab_size / tp * 2  # fp32 logits for the batch's last tokens, generously
    return ACTIVATION_RESERVE_TOKENS * (widths + logits) * model.dtype_bytes


def kv_bytes_per_token_per_gpu(model: ModelArch, tp: int, pp: int) -> float:
    """KV bytes one token occupies on one GPU of the fullest stage."""
    kv_heads = math.ceil(model.num_kv_heads / tp)
    return 2 * layers_per_stage(model, pp) * kv_heads * model.head_dim * model.dtype_bytes


def _free_bytes_per_gpu(
    model: ModelArch, accelerator: Accelerator, tp: int, pp: int, memory_utilization: float
) -> float:
    budget = accelerator.memory_bytes * memory_utilization
    used = stage_weight_bytes_per_gpu(model, tp, pp) + activation_reserve_bytes_per_gpu(model, tp)
    return budget - used


def weights_fit(
    model: ModelArch | str,
    accelerator: Accelerator | str,
    tp: int,
    pp: int,
    *,
    memory_utilization: float = 0.9,
) -> bool:
    """Whether weights and the activation reserve fit with room for at least one KV block."""
    return kv_capacity_tokens(model, accelerator, tp, pp, memory_utilization=memory_utilization) > 0


def kv_capacity_tokens(
    model: ModelArch | str,
    accelerator: Accelerator | str,
    tp: int,
    pp: int,
    *,
    memory_utilization: float = 0.9,
    profile: LatencyProfile | None = None,
    profile_path: str | Path | None = None,
) -> int:
    """KV tokens an instance holds after weights and activations: 0 when they do not fit.

    Uses the profile's measured row (`profile`, else the file at `profile_path`, else the
    shipped A100 profile) when it has one for this model, accelerator, tp and pp;
    otherwise computes it, rounded down to whole KV blocks.
    """
    model, accelerator = get_model(model), get_accelerator(accelerator)
    if profile is None:
        profile = load_profile(profile_path) if profile_path else default_profile()
    if profile.accelerator_name == accelerator.name:
        measured = profile.kv_capacity_tokens(model, tp, pp)
        if measured is not None:
            return measured
    free_bytes = _free_bytes_per_gpu(model, accelerator, tp, pp, memory_utilization)
    if free_bytes <= 0:
        return 0
    tokens = int(free_bytes // kv_bytes_per_token_per_gpu(model, tp, pp))
    return tokens // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
