"""Latency models: seconds per iteration of a pipeline stage, for (model, accelerator, tp, pp).

One rule decides the source, per (model, accelerator), in `choose_source`:
- "auto": when a profile covers the (model, accelerator) in the disaggregated serving mode,
  everything about that model is timed from the profile and only its profiled
  tensor-parallel degrees are allowed (those profiled for the colocated mode too,
  when the profile has it: the baselines are then timed from the same table; a
  profile without colocated rows cannot time the baselines, and they are left out);
  otherwise (OPT-175B, Llama, H100, ...) the paper's Appendix A analytic model times
  every degree of both serving modes;
- "profile": as auto, but a model the profile does not cover is an error;
- "analytic": never reads a profile; any degree.
NOTE: a model is never timed by the profile at some degrees and by the analytic model
at others: the analytic model is ~20-40% off the profile at some points, so mixing the
two inside one search would bias which candidate wins and DistServe's gain over the
baselines. This is also how the authors' simulator works (profiled degrees only).

`get_latency_model` builds the model for one point under that rule. Also here: KV
capacity per instance and Lm, the prefill batch size that saturates the accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from distserve.catalog import Accelerator, ModelArch, get_accelerator, get_model
from distserve.latency.analytic import AnalyticLatencyModel
from distserve.latency.base import LatencyModel
from distserve.latency.capacity import kv_capacity_tokens, weights_fit
from distserve.latency.corrected import Correction, corrected
from distserve.latency.profile import (
    SERVING_MODES,
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


@dataclass(frozen=True)
class SourceChoice:
    """The latency source of one (model, accelerator) and the tp degrees it allows."""

    source: str  # "profile" or "analytic"
    tps: tuple[int, ...] | None  # the only tensor-parallel degrees allowed; None: any
    profile_path: str  # the profile read ("" for the analytic model)
    reason: str  # why this source, in words
    # the serving modes it times (a profile may lack colocated)
    serving_modes: tuple[str, ...] = SERVING_MODES

    def allows(self, tp: int) -> bool:
        """Whether instances of this tensor-parallel degree may be timed."""
        return self.tps is None or tp in self.tps

    def can_time(self, serving_mode: str) -> bool:
        """Whether this source times the serving mode ("disaggregated" or "colocated")."""
        return serving_mode in self.serving_modes

    def describe(self) -> str:
        """One line for a user: the source, the degrees and why."""
        if self.source == "profile":
            tps = ", ".join(map(str, self.tps or ()))
            return f"profile {Path(self.profile_path).name} (tp {tps} only): {self.reason}"
        return f"analytic (Appendix A): {self.reason}"


def choose_source(
    model: ModelArch | str,
    accelerator: Accelerator | str,
    source: str = "auto",
    profile_path: str | Path | None = None,
) -> SourceChoice:
    """The single rule (see the module docstring): which source times this model on
    this accelerator, and at which tp degrees. ValueError for an unknown source, or
    for "profile" when the profile does not cover the model on this accelerator."""
    model, accelerator = get_model(model), get_accelerator(accelerator)
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    if source == "analytic":
        return SourceChoice("analytic", None, "", "latencyModel: analytic")
    profile = load_profile(profile_path) if profile_path else default_profile()
    mode_to_tps: dict[str, set[int]] = {}
    if profile.accelerator_name in (None, accelerator.name):
        mode_to_tps = {m: set(profile.tps_for(m, model)) for m in SERVING_MODES}
        mode_to_tps = {m: tps for m, tps in mode_to_tps.items() if tps}
    tps = sorted(set.intersection(*mode_to_tps.values())) if mode_to_tps else []
    if tps and "disaggregated" in mode_to_tps:
        modes = tuple(mode_to_tps)
        return SourceChoice(
            "profile", tuple(tps), profile.source_path,
            f"it covers {model.name} on {accelerator.name} ({' and '.join(modes)})",
            modes,
        )
    missing = _missing_point(profile, SERVING_MODES[0], model, accelerator, None)
    if source == "profile":
        raise ValueError(missing)
    return SourceChoice("analytic", None, "", f"no profile covers it ({missing})")


def get_latency_model(
    model: ModelArch | str,
    accelerator: Accelerator | str,
    tp: int,
    pp: int,
    *,
    serving_mode: str = "disaggregated",
    source: str = "auto",
    profile_path: str | Path | None = None,
    enable_dispatch_overhead: bool = True,
) -> LatencyModel:
    """The latency model for this point, its source chosen by `choose_source`;
    serving_mode: whose iterations it times, "disaggregated" or "colocated".

    ValueError when the chosen source is the profile and tp is not a profiled degree
    (under "auto" too: set source "analytic" to time unprofiled degrees).
    """
    model, accelerator = get_model(model), get_accelerator(accelerator)
    if serving_mode not in SERVING_MODES:
        raise ValueError(f"serving_mode must be one of {', '.join(SERVING_MODES)}, "
                         f"got {serving_mode!r}")
    choice = choose_source(model, accelerator, source, profile_path)
    if choice.source == "analytic":
        return AnalyticLatencyModel(
            model, accelerator, tp, pp, serving_mode, enable_dispatch_overhead=enable_dispatch_overhead
        )
    profile = load_profile(profile_path) if profile_path else default_profile()
    fit = profile.fit_for(serving_mode, model, tp) if choice.allows(tp) else None
    if fit is None:
        raise ValueError(
            _missing_point(profile, serving_mode, model, accelerator, tp)
            + " (a profiled model is timed from its profile only, at its profiled "
            "degrees; latencyModel: analytic times any degree)"
        )
    return ProfileLatencyModel(
        model, accelerator, tp, pp, fit, serving_mode, enable_dispatch_overhead=enable_dispatch_overhead
    )


def _missing_point(
    profile: LatencyProfile, serving_mode: str, model: ModelArch, accelerator: Accelerator, tp: int | None
) -> str:
    where = profile.source_path or "the profile"
    if profile.accelerator_name not in (None, accelerator.name):
        return f"{where} was measured on {profile.accelerator_name}, not {accelerator.name}"
    tps = profile.tps_for(serving_mode, model)
    if not tps:
        return f"{where} has no {serving_mode} entry for {model.name}"
    if tp is None:
        return f"{where} has no tp of {model.name} common to its serving modes"
    return f"{where} has {model.name} ({serving_mode}) at tp {tps}, not tp {tp}"


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
    "Correction",
    "LatencyModel",
    "LatencyProfile",
    "ProfileLatencyModel",
    "SourceChoice",
    "choose_source",
    "corrected",
    "default_profile",
    "get_latency_model",
    "kv_capacity_tokens",
    "load_profile",
    "prefill_saturation_tokens",
    "weights_fit",
]
