"""Latency from profiled tables: the shape of the authors' `a100-opt-profile.json`.

A profile holds, per serving mode ("disaggregated", "colocated"), model and tensor-parallel
degree, fitted coefficients in milliseconds:

    prefill_ms = (a + b*S1 + c*S2) / pp + pp      S1 = sum of prompt lengths, S2 = sum of squares
    decode_ms  = (a + b*T + c*B) / pp             T = sum of context lengths, B = batch size

with separate decode coefficients below and above `large_batch_from`, and KV capacity
rows per (model, tp, pp). A profile is for one accelerator: the file's "accelerator"
field, else the accelerator its "about" text names, else the one the caller says.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from distserve.catalog import Accelerator, ModelArch, get_model
from distserve.catalog.accelerators import BUILTIN_ACCELERATORS
from distserve.latency.base import StageLatencyBase

# the file keeps its `engines` key, the name of the serving modes before they had one
SERVING_MODES = ("disaggregated", "colocated")
MS = 1e-3


@dataclass(frozen=True)
class PhaseFit:
    """Fitted coefficients (milliseconds) for one (serving mode, model, tp)."""

    prefill_abc: tuple[float, float, float]
    decode_small_batch_abc: tuple[float, float, float]
    decode_large_batch_abc: tuple[float, float, float]
    large_batch_from: int


@dataclass(frozen=True)
class LatencyProfile:
    """A loaded profile file: fits per (serving mode, model id lower-cased, tp) and KV rows."""

    accelerator_name: str | None
    key_to_fit: dict[tuple[str, str, int], PhaseFit]
    kv_key_to_tokens: dict[tuple[str, int, int], int] = field(default_factory=dict)
    source_path: str = ""

    def fit_for(self, serving_mode: str, model: ModelArch, tp: int) -> PhaseFit | None:
        """The fit for this point, or None when the profile did not measure it."""
        return self.key_to_fit.get((serving_mode, model.name.lower(), tp))

    def kv_capacity_tokens(self, model: ModelArch, tp: int, pp: int) -> int | None:
        """The measured KV capacity for this point, or None when absent."""
        return self.kv_key_to_tokens.get((model.name.lower(), tp, pp))

    def tps_for(self, serving_mode: str, model: ModelArch) -> list[int]:
        """Tensor-parallel degrees profiled for this serving mode and model."""
        name = model.name.lower()
        return sorted(tp for (e, m, tp) in self.key_to_fit if e == serving_mode and m == name)


def load_profile(path: str | Path) -> LatencyProfile:
    """Read a profile file of the `a100-opt-profile.json` shape; ValueError names the bad part."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read a latency profile: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("engines"), dict):
        raise ValueError(f"{path}: a latency profile needs an 'engines' object")
    key_to_fit: dict[tuple[str, str, int], PhaseFit] = {}
    for serving_mode, mode_doc in doc["engines"].items():
        for model_name, tp_to_fit in mode_doc.get("models", {}).items():
            for tp, fit in tp_to_fit.items():
                where = f"{path}: engines.{serving_mode}.models.{model_name}.{tp}"
                key_to_fit[(serving_mode, _model_key(model_name), int(tp))] = _parse_fit(fit, where)
    kv_rows = doc.get("kv_capacity", {}).get("rows", [])
    kv_key_to_tokens = {
        (_model_key(r["model"]), int(r["tp"]), int(r["pp"])): int(r["kv_capacity_tokens"])
        for r in kv_rows
    }
    return LatencyProfile(_accelerator_of(doc), key_to_fit, kv_key_to_tokens, str(path))


def _model_key(name: str) -> str:
    """Profile rows are matched by the catalog's id, so "opt-13b" and "facebook/opt-13b" agree."""
    try:
        return get_model(name).name.lower()
    except ValueError:
        return name.lower()


def _parse_fit(fit: dict, where: str) -> PhaseFit:
    try:
        return PhaseFit(
            prefill_abc=tuple(float(x) for x in fit["prefill_abc"]),
            decode_small_batch_abc=tuple(float(x) for x in fit["decode_small_batch_abc"]),
            decode_large_batch_abc=tuple(float(x) for x in fit["decode_large_batch_abc"]),
            large_batch_from=int(fit["large_batch_from"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"{where}: expected prefill_abc, decode_small_batch_abc, "
            f"decode_large_batch_abc (three numbers each) and large_batch_from: {err}"
        ) from None


def _accelerator_of(doc: dict) -> str | None:
    """The accelerator a profile was measured on, when the file says so."""
    if doc.get("accelerator"):
        return str(doc["accelerator"])
    about = str(doc.get("about", "")).lower()
    for accelerator in BUILTIN_ACCELERATORS:
        if accelerator.name.lower().split("-")[0] in about and accelerator.name != "CPU":
            return accelerator.name
    return None


@functools.cache
def default_profile() -> LatencyProfile:
    """The authors' A100 OPT profile shipped in `distserve/data/`."""
    ref = resources.files("distserve") / "data" / "a100-opt-profile.json"
    with resources.as_file(ref) as path:
        return load_profile(path)


class ProfileLatencyModel(StageLatencyBase):
    """Latency from a profile's fitted formulas, plus the engine's dispatch overhead."""

    source = "profile"

    def __init__(
        self,
        model: ModelArch,
        accelerator: Accelerator,
        tp: int,
        pp: int,
        fit: PhaseFit,
        serving_mode: str = "disaggregated",
        *,
        enable_dispatch_overhead: bool = True,
    ) -> None:
        super().__init__(
            model, accelerator, tp, pp, serving_mode, enable_dispatch_overhead=enable_dispatch_overhead
        )
        self.fit = fit

    def _prefill_ms(self, s1: float, s2: float) -> float:
        a, b, c = self.fit.prefill_abc
        return (a + b * s1 + c * s2) / self.pp + self.pp

    def _decode_abc(self, batch_size: int) -> tuple[float, float, float]:
        if batch_size < self.fit.large_batch_from:
            return self.fit.decode_small_batch_abc
        return self.fit.decode_large_batch_abc

    def prefill_stage_s(self, prompt_lens: Sequence[int]) -> float:
        """Seconds one stage spends on a prefill batch of these prompt lengths."""
        if not prompt_lens:
            return 0.0
        s1 = float(sum(prompt_lens))
        s2 = float(sum(n * n for n in prompt_lens))
        return self._prefill_ms(s1, s2) * MS + self._overhead_s(int(s1))

    def decode_stage_s(self, context_lens: Sequence[int]) -> float:
        """Seconds one stage spends on one decode step; lengths include the new token."""
        if not context_lens:
            return 0.0
        a, b, c = self._decode_abc(len(context_lens))
        ms = (a + b * sum(context_lens) + c * len(context_lens)) / self.pp
        return ms * MS + self._overhead_s(len(context_lens))

    def mixed_stage_s(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]
    ) -> float:
        """A colocated iteration: prefill chunks batched with decode steps.

        With a prefill in the batch the GEMMs run on every token, decode tokens included,
        at the prefill per-token cost; decodes add only their KV reads (the decode fit's
        per-context-token term). A chunk's attention covers new * (new + already) pairs.
        """
        if not prefill_chunks:
            return self.decode_stage_s(decode_context_lens)
        s1 = float(sum(new for new, _ in prefill_chunks) + len(decode_context_lens))
        s2 = float(sum(new * (new + done) for new, done in prefill_chunks))
        _, b_decode, _ = self._decode_abc(max(len(decode_context_lens), 1))
        kv_read_ms = b_decode * sum(decode_context_lens) / self.pp
        return (self._prefill_ms(s1, s2) + kv_read_ms) * MS + self._overhead_s(int(s1))
