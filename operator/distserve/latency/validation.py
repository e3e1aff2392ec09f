"""How the analytic model is checked against a profile: a grid of batch shapes.

The grid covers what the simulator asks for: single prompts and batches up to 2048
prompt tokens for prefill; decode batches of 1 to 256 sequences with contexts of 128 to
2048 tokens, limited to what fits in the instance's KV cache. Errors are relative to the
profile, with the engine's dispatch overhead left out of both (it is the same constant
in each and would flatter the comparison).
"""

from __future__ import annotations

from dataclasses import dataclass

from distserve.catalog import get_accelerator, get_model
from distserve.latency.analytic import AnalyticLatencyModel
from distserve.latency.capacity import kv_capacity_tokens
from distserve.latency.profile import LatencyProfile, ProfileLatencyModel, default_profile

PREFILL_BATCHES: tuple[tuple[int, ...], ...] = (
    *((n,) for n in (32, 64, 128, 256, 512, 1024, 1536, 2048)),
    (128,) * 4,
    (256,) * 8,
    (64,) * 16,
    (32,) * 32,
    (512,) * 4,
    (1024,) * 2,
    (100, 300, 700),
)
DECODE_BATCH_SIZES = (1, 4, 16, 32, 64, 128, 256)
DECODE_CONTEXT_TOKENS = (128, 512, 1024, 2048)


@dataclass(frozen=True)
class PhaseError:
    """Relative error of the analytic model against a profile, over one phase's grid."""

    model_name: str
    tp: int
    phase: str  # "prefill" or "decode"
    max_error: float
    mean_error: float
    num_points: int


def decode_batches(model_name: str, tp: int) -> list[list[int]]:
    """Decode batches of the grid whose KV fits on an A100 instance of this tp."""
    capacity = kv_capacity_tokens(model_name, "A100-80GB", tp, 1)
    return [
        [context] * size
        for size in DECODE_BATCH_SIZES
        for context in DECODE_CONTEXT_TOKENS
        if size * context <= capacity
    ]


def compare_to_profile(
    serving_mode: str = "disaggregated", profile: LatencyProfile | None = None
) -> list[PhaseError]:
    """Analytic-vs-profile errors for every (model, tp) the profile has for this serving mode."""
    profile = profile or default_profile()
    accelerator = get_accelerator(profile.accelerator_name or "A100-80GB")
    errors = []
    for (fit_mode, model_name, tp), fit in sorted(profile.key_to_fit.items()):
        if fit_mode != serving_mode:
            continue
        model = get_model(model_name)
        measured = ProfileLatencyModel(
            model, accelerator, tp, 1, fit, serving_mode, enable_dispatch_overhead=False
        )
        analytic = AnalyticLatencyModel(
            model, accelerator, tp, 1, serving_mode, enable_dispatch_overhead=False
        )
        phase_to_pairs = {
            "prefill": [
                (analytic.prefill_stage_s(b), measured.prefill_stage_s(b)) for b in PREFILL_BATCHES
            ],
            "decode": [
                (analytic.decode_stage_s(b), measured.decode_stage_s(b))
                for b in decode_batches(model_name, tp)
            ],
        }
        for phase, pairs in phase_to_pairs.items():
            rel = [abs(a - m) / m for a, m in pairs]
            errors.append(
                PhaseError(model.name, tp, phase, max(rel), sum(rel) / len(rel), len(rel))
            )
    return errors
