"""Latency models: seconds per iteration of a pipeline stage, for (model, accelerator, tp, pp).

`get_latency_model` picks the source: a profiled table where one covers the point
("profile"), the paper's Appendix A roofline model elsewhere ("analytic"). Also here:
KV capacity per instance and Lm, the prefill batch size that saturates the accelerator.
"""

from __future__ import annotations

from pathlib import Path

from distserve.catalog import Accelerator, ModelArch, get_accelerator, get_model
from distserve.latency.analytic import AnalyticLatencyModel
from distserve.latency.base import LatencyModel
from distserve.latency.capacity import kv_capacity_tokens, weights_fit
from distserve.latency.profile import (
    ENGINES,
    LatencyProfile,
    ProfileLatencyModel,
    default_profile,
    load_profile,
)

SOURCES = ("auto", "profile", "analytic")
# Lm is the shortest prompt after which doubling the batch raises prefill throughput
# (tokens per second) by less than this share: the GPU is compute bound from there.
SATURATION_GAIN = 0.15
SATURATION_STEP_TOKENS = 128
SATURATION_MAX_TOKENS = 16384


def get_latency_model(
    model: ModelArch | str,
    accelerator: Accelerator | str,
    tp: int,
    pp: int,
    *,
    engine: str = "disaggregated",
    source: str = "auto",
    profile_path: str | Path | None = None,
    enable_dispatch_overhead: bool = True,
) -> LatencyModel:
    """The latency model for this point.

    source "auto" uses the profile (the shipped A100 OPT one, or `profile_path`) when it
    covers (model, accelerator, tp) for this engine, the analytic model otherwise;
    "profile" raises ValueError when it does not; "analytic" never reads a profile.
    """
    model, accelerator = get_model(model), get_accelerator(accelerator)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    if source != "analytic":
        profile = load_profile(profile_path) if profile_path else default_profile()
        fit = None
        if profile.accelerator_name in (None, accelerator.name):
            fit = profile.fit_for(engine, model, tp)
        if fit is not None:
            return ProfileLatencyModel(
                model,
                accelerator,
                tp,
                pp,
                fit,
                engine,
                enable_dispatch_overhead=enable_dispatch_overhead,
            )
        if source == "profile":
            raise ValueError(_missing_point(profile, engine, model, accelerator, tp))
    return AnalyticLatencyModel(
        model, accelerator, tp, pp, engine, enable_dispatch_overhead=enable_dispatch_overhead
    )


def _missing_point(
    profile: LatencyProfile, engine: str, model: ModelArch, accelerator: Accelerator, tp: int
) -> str:
    where = profile.source_path or "the profile"
    if profile.accelerator_name not in (None, accelerator.name):
        return f"{where} was measured on {profile.accelerator_name}, not {accelerator.name}"
    tps = profile.tps_for(engine, model)
    if not tps:
        return f"{where} has no {engine} entry for {model.name}"
    return f"{where} has {model.name} ({engine}) at tp {tps}, not tp {tp}"


def prefill_saturation_tokens(latency_model: LatencyModel) -> int:
    """Lm: the shortest prompt (in steps of 128 tokens) that saturates the accelerator.

    It is the first length t whose prefill throughput is within SATURATION_GAIN of the
    throughput at 2t; the simulator fills prefill batches up to it.
    """
    tokens = SATURATION_STEP_TOKENS
    while tokens < SATURATION_MAX_TOKENS:
        rate = tokens / latency_model.prefill_stage_s([tokens])
        doubled_rate = 2 * tokens / latency_model.prefill_stage_s([2 * tokens])
        if doubled_rate < rate * (1 + SATURATION_GAIN):
            return tokens
        tokens += SATURATION_STEP_TOKENS
    return SATURATION_MAX_TOKENS


__all__ = [
    "AnalyticLatencyModel",
    "LatencyModel",
    "LatencyProfile",
    "ProfileLatencyModel",
    "default_profile",
    "get_latency_model",
    "kv_capacity_tokens",
    "load_profile",
    "prefill_saturation_tokens",
    "weights_fit",
]
