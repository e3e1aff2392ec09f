"""The spec's `replanning` section: when the analyzer looks, and how eagerly it moves.

A standalone model (camelCase in YAML, as the rest of the spec) that the spec embeds;
`decide.py` reads it. The defaults favour staying put: a shift must persist for
`holdSeconds` (and a cheaper plan be found by every decision over as long), a reshuffle
is followed by `cooldownSeconds` without another, and a cheaper plan must save
`minGain` of the GPUs (and more GPU-seconds over the cooldown than its weight loading
costs) before it is worth moving to.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from distserve.spec_base import SpecModel


class ReplanningSpec(SpecModel):
    """Replanning from observed traffic (the workload analyzer)."""

    enabled: bool = Field(default=False, description="Watch the traffic and replan on a shift.")
    prometheus_url: str | None = Field(
        default=None,
        description="Prometheus HTTP API the analyzer queries, e.g. http://prometheus:9090. "
        "Unset: no observation, so no decision.",
    )
    interval_seconds: float = Field(
        default=60, gt=0, description="Seconds between two observations (and decisions)."
    )
    window_seconds: float = Field(
        default=900, gt=0, description="Seconds of traffic one observation covers."
    )
    hold_seconds: float = Field(
        default=300, ge=0,
        description="A shift must persist this long before a replan, and a cheaper plan "
        "be found by every decision this long before a scale-down (a miss waits for neither).",
    )
    cooldown_seconds: float = Field(
        default=900, ge=0, description="No replan for this long after a reshuffle."
    )
    min_gain: float = Field(
        default=0.15, ge=0, lt=1,
        description="Share of the GPUs a cheaper plan must save to be worth a reshuffle.",
    )
    min_requests: int = Field(
        default=200, ge=1, description="Fewer requests in a window: no decision is made."
    )
    headroom: float = Field(
        default=1.2, ge=1,
        description="Plans are sized for the observed rate times this (room for the rate "
        "to grow until the next decision).",
    )
    reload_seconds: float = Field(
        default=180, ge=0,
        description="Seconds a moved instance serves nothing while its weights load: the "
        "cost a reshuffle must earn back.",
    )
    max_gpus: int | None = Field(
        default=None, ge=1, description="GPU budget of a replanned deployment; unset: the cluster."
    )
    advisory: bool = Field(
        default=False,
        description="Only recommend: the decision is recorded and reported, nothing moves.",
    )

    @model_validator(mode="after")
    def _window_covers_interval(self) -> ReplanningSpec:
        if self.window_seconds < self.interval_seconds:
            raise ValueError(
                f"windowSeconds ({self.window_seconds}) must be at least intervalSeconds "
                f"({self.interval_seconds}): traffic between two observations would go unseen"
            )
        return self
