"""What the operator itself exports to Prometheus (served on `distserve operator --metrics-port`).

Every series names the DistServeDeployment (`namespace`, `deployment`), so the planner
dashboard and the Degraded alert select them as they select the engine's series:
- `distserve_deployment_phase{phase}`: 1 for the resource's current phase, 0 for the
  others (set wherever the status's phase is written);
- `distserve_replan_decisions_total{action, reason}`: the replanner's decisions, `reason`
  a short category (the full text is in the status and the Event).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from distserve.k8s import naming
from distserve.k8s import status as st

PHASES = (st.PLANNING, st.AWAITING_APPROVAL, st.APPLYING, st.ROLLING_OUT, st.READY_PHASE,
          st.DEGRADED_PHASE)
LABELS = ("namespace", "deployment")

PHASE = Gauge("distserve_deployment_phase", "1 for the DistServeDeployment's current phase.",
              (*LABELS, "phase"))
DECISIONS = Counter("distserve_replan_decisions_total",
                    "Replanning decisions of the operator, by action and reason category.",
                    (*LABELS, "action", "reason"))


def set_phase(owner: naming.Owner, phase: str) -> None:
    """Mark `phase` as the resource's current one."""
    for known in {*PHASES, phase}:
        PHASE.labels(owner.namespace, owner.name, known).set(1.0 if known == phase else 0.0)


def count_decision(owner: naming.Owner, action: str, reason: str) -> None:
    """One replanning decision."""
    DECISIONS.labels(owner.namespace, owner.name, action, reason).inc()


def forget(owner: naming.Owner) -> None:
    """Drop a deleted resource's series."""
    for metric in (PHASE, DECISIONS):
        for labels in list(metric._metrics):  # noqa: SLF001 - prometheus_client has no listing API
            if labels[:2] == (owner.namespace, owner.name):
                metric.remove(*labels)
