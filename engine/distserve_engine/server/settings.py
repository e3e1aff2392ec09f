"""The serving settings document (`--config FILE`): JSON, written by the launcher or operator.

    {"deployment": "local", "model_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
     "engine": {"model": "/path", "device": "cpu", "max_model_len": 2048, ...},  # EngineConfig
     "max_prefill_tokens": 512, "max_decode_batch": 32, "max_waiting_requests": 128,
     "max_inflight_requests": 256, "admit_by_ttft": false, "max_request_body_bytes": 2097152,
     "default_max_tokens": 256, "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
     "instances": {"prefill": 1, "decode": 1, "colocated": 0},   # for --role all
     "peers": {"prefill": ["http://p0:8001"], "decode": [...]},  # for --role router
     "parallel": {"prefill": {"tp": 2, "pp": 1}},  # ranks per instance (default 1 x 1)
     "plan": {"id": "3f2a9c0d1e", "predicted_attainment": 0.93,   # optional: the plan
              "predicted_goodput_rps": 4.2,                         # served, for metrics
              "prefill": "tp2pp1x1", "decode": "tp1pp1x2"}}

A peer is `URL`, `NAME=URL` or `{"name", "url", "node", "draining"}`. A router reading
its peers from this file re-reads it while it runs (`server/peers.py`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from distserve_engine.config import EngineConfig


@dataclass(frozen=True)
class PlanInfo:
    """The plan a deployment serves under, with what the planner predicted for it."""

    id: str  # Plan.plan_id
    predicted_attainment: float | None = None  # SLO attainment at the predicted goodput
    predicted_goodput_rps: float | None = None
    prefill: str = ""  # the phase's shape, `tp<TP>pp<PP>x<instances>`
    decode: str = ""

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> PlanInfo:
        """Read `plan`; unknown keys or a missing id are an error naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(doc) - known)
        if unknown or not isinstance(doc.get("id"), str) or not doc["id"]:
            raise ValueError(f"serve settings: plan needs a non-empty string id and only keys "
                             f"{sorted(known)}; got {doc!r}")
        return cls(**doc)


@dataclass
class ServeSettings:
    """How one deployment serves: the engine, batching bounds, SLOs, peers."""

    engine: dict[str, Any]  # EngineConfig fields
    deployment: str = "distserve"
    model_name: str = "model"
    max_prefill_tokens: int = 512  # Lm: prefill batches fill up to this many tokens
    max_decode_batch: int = 64  # most sequences in one decode batch
    max_waiting_requests: int = 128  # router refuses (429) beyond this many waiting
    max_inflight_requests: int | None = None  # 429 beyond; None: waiting + 2 decode batches each
    admit_by_ttft: bool = False  # 429 at once when the queue ahead would miss the TTFT SLO
    max_request_body_bytes: int = 2 * 1024 * 1024  # 413 beyond
    default_max_tokens: int | None = 256  # chat output limit when the client gives none
    slo: dict[str, float] = field(default_factory=dict)  # ttft_s, tpot_s
    instances: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    peers: dict[str, list[Any]] = field(default_factory=dict)  # role -> instance peers
    parallel: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> {"tp", "pp"}
    plan: PlanInfo | None = None  # the plan served under (metrics only); None without a plan

    def __post_init__(self) -> None:
        if isinstance(self.plan, dict):
            self.plan = PlanInfo.from_dict(self.plan)
        if not isinstance(self.max_request_body_bytes, int) or self.max_request_body_bytes < 1:
            raise ValueError(f"serve settings: max_request_body_bytes must be an integer >= 1, "
                             f"got {self.max_request_body_bytes!r}")
        if self.admit_by_ttft and self.ttft_slo_s is None:
            raise ValueError("serve settings: admit_by_ttft needs slo.ttft_s")

    def engine_config(self) -> EngineConfig:
        """The EngineConfig of every instance."""
        return EngineConfig(**self.engine)

    @property
    def ttft_slo_s(self) -> float | None:
        return self.slo.get("ttft_s")

    @property
    def tpot_slo_s(self) -> float | None:
        return self.slo.get("tpot_s")

    def plan_metrics(self) -> dict[str, Any]:
        """The arguments of `ServingMetrics.set_plan` for this plan."""
        if self.plan is None:
            return {"plan_id": None}
        return {"plan_id": self.plan.id, "prefill": self.plan.prefill, "decode": self.plan.decode,
                "predicted_attainment": self.plan.predicted_attainment,
                "predicted_goodput_rps": self.plan.predicted_goodput_rps}

    def to_dict(self) -> dict[str, Any]:
        """The JSON document."""
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ServeSettings:
        """Read the document; unknown keys are an error naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"serve settings: unknown keys {unknown}; expected some of {sorted(known)}")
        return cls(**doc)

    @classmethod
    def load(cls, path: str | Path) -> ServeSettings:
        """Read a JSON settings file."""
        return cls.from_dict(json.loads(Path(path).read_text()))
