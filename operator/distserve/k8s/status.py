"""What the resource's `status` says: the plan in figures, the phase, the conditions.

The fields the CRD's printer columns read (phase, prefillInstances, decodeInstances,
predictedGoodputRps) sit at the top of `status`, next to the plan's other figures;
the whole plan document is kept in `status.plan` so that an approval or an operator
restart applies exactly the plan that was shown, without searching again.

Each plan document is stored once. `status.revisionPlans` names the plan of each live
revision by its id; the document of a plan live instances run that is not the shown
one (the plan before a replan, while its instances drain or await approval) is in
`status.priorPlans`, keyed by plan id. `store_plans_once` keeps it so on every write.

Conditions follow the Kubernetes convention: one entry per type, `lastTransitionTime`
moves only when `status` flips.
"""

from __future__ import annotations

import datetime
from typing import Any

from distserve.plan import Plan

PLANNED, APPLIED, READY, DEGRADED = "Planned", "Applied", "Ready", "Degraded"
RATE_SERVED = "RateServed"  # False: the cluster or GPU budget holds no plan for the rate
CONDITION_TYPES = (PLANNED, APPLIED, READY, DEGRADED, RATE_SERVED)

# Phases, in the order a healthy resource goes through them.
PLANNING = "Planning"
AWAITING_APPROVAL = "AwaitingApproval"
APPLYING = "Applying"
ROLLING_OUT = "RollingOut"
READY_PHASE = "Ready"
DEGRADED_PHASE = "Degraded"


TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def now_iso() -> str:
    """The current UTC time as Kubernetes writes it."""
    return to_iso(datetime.datetime.now(datetime.timezone.utc))


def to_iso(moment: datetime.datetime) -> str:
    """A UTC time as Kubernetes writes it (whole seconds)."""
    return moment.astimezone(datetime.timezone.utc).strftime(TIME_FORMAT)


def parse_iso(text: str) -> datetime.datetime:
    """A time written by `to_iso` (or the API server), timezone-aware."""
    return datetime.datetime.strptime(text, TIME_FORMAT).replace(tzinfo=datetime.timezone.utc)


def build_node_assignment(plan: Plan) -> dict[str, list[str]]:
    """Node name -> the segments it runs, e.g. {"gpu-0": ["prefill-0/s0 gpus 0,1"]}."""
    node_to_segments: dict[str, list[str]] = {}
    for s in sorted(plan.segments, key=lambda s: (s.node, s.role, s.instance, s.stage)):
        gpus = ",".join(str(g) for g in s.gpu_ids)
        node_to_segments.setdefault(s.node, []).append(
            f"{s.role}-{s.instance}/s{s.stage} gpus {gpus}"
        )
    return node_to_segments


def rate_condition(plan: Plan) -> tuple[str, bool, str, str]:
    """The RateServed condition: whether the plan serves workload.rateRps, else by how
    much the best plan that fits falls short and what limits it."""
    if plan.shortfall_rps > 0:
        return (RATE_SERVED, False, "ClusterTooSmall",
                f"the best plan within {plan.limited_by} serves {plan.goodput_rps:.2f} of "
                f"{plan.rate_rps} req/s: short by {plan.shortfall_rps:.2f} req/s")
    if plan.rate_rps:
        return RATE_SERVED, True, "RateServed", f"serves {plan.rate_rps} req/s within the SLOs"
    return RATE_SERVED, True, "NoRate", "no workload.rateRps to size the plan for"


def build_plan_status(plan: Plan) -> dict[str, Any]:
    """The plan's figures as status fields."""
    colocated = plan.baselines.get("colocated")
    latency = plan.latency
    return {
        "planId": plan.plan_id,
        "algorithm": plan.algorithm,
        "prefillInstances": plan.num_instances("prefill"),
        "decodeInstances": plan.num_instances("decode"),
        "prefill": {"tp": plan.prefill.tp, "pp": plan.prefill.pp,
                    "instances": plan.prefill.instances},
        "decode": {"tp": plan.decode.tp, "pp": plan.decode.pp,
                   "instances": plan.decode.instances},
        "numGpus": plan.num_gpus,
        "nodeAssignment": build_node_assignment(plan),
        "predictedGoodputRps": round(plan.goodput_rps, 4),
        "perGpuGoodputRps": round(plan.per_gpu_goodput_rps, 4),
        "attainment": round(plan.attainment, 4),
        "latency": _latency_status(latency) if latency else None,
        "colocatedGoodputRps": round(colocated.goodput_rps, 4) if colocated else None,
        "searchSeconds": round(plan.search_seconds, 3),
        "plan": plan.to_dict(),
    }


def _latency_status(latency: Any) -> dict[str, float]:
    """Latency percentiles in seconds, camelCase keys."""
    return {
        "ttftP50Seconds": round(latency.ttft_p50_s, 4),
        "ttftP90Seconds": round(latency.ttft_p90_s, 4),
        "ttftP99Seconds": round(latency.ttft_p99_s, 4),
        "tpotP50Seconds": round(latency.tpot_p50_s, 5),
        "tpotP90Seconds": round(latency.tpot_p90_s, 5),
        "tpotP99Seconds": round(latency.tpot_p99_s, 5),
    }


def stored_plan(status: dict[str, Any] | None) -> Plan | None:
    """The plan kept in the status, or None when there is none (or it cannot be read)."""
    doc = (status or {}).get("plan")
    if not doc:
        return None
    try:
        return Plan.from_dict(doc)
    except (KeyError, TypeError, ValueError):
        return None


def plan_documents(status: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Plan id -> document of every plan the status keeps: the shown one and the prior ones."""
    status = status or {}
    docs = {pid: doc for pid, doc in (status.get("priorPlans") or {}).items() if doc}
    shown = status.get("plan")
    if shown and shown.get("id"):
        docs[shown["id"]] = shown
    return docs


def store_plans_once(status: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`patch` with `priorPlans` completed, when it changes the shown plan or the revisions'
    plans: the documents of the plans a live revision names other than the shown one,
    each once (None for one no longer named: a merge patch removes it). A document the
    patch offers in `priorPlans` (a reshuffle's target) is kept only where it is named."""
    if not {"plan", "revisionPlans", "priorPlans"} & set(patch):
        return patch
    shown = patch["plan"] if "plan" in patch else status.get("plan")
    shown_id = (shown or {}).get("id")
    refs = {**(status.get("revisionPlans") or {}), **(patch.get("revisionPlans") or {})}
    named = {ref for ref in refs.values() if isinstance(ref, str)} - {shown_id}
    docs = {**plan_documents(status),
            **{pid: doc for pid, doc in (patch.get("priorPlans") or {}).items() if doc}}
    prior: dict[str, Any] = {pid: None for pid in status.get("priorPlans") or {}}
    prior.update({pid: docs[pid] for pid in named if pid in docs})
    out = {key: value for key, value in patch.items() if key != "priorPlans"}
    if prior:
        out["priorPlans"] = prior
    return out


def set_condition(
    conditions: list[dict[str, Any]] | None,
    kind: str,
    is_true: bool,
    reason: str,
    message: str,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """The conditions with `kind` set; other types are kept, order is CONDITION_TYPES."""
    by_type = {c["type"]: dict(c) for c in conditions or [] if "type" in c}
    status = "True" if is_true else "False"
    old = by_type.get(kind)
    moved = old is None or old.get("status") != status
    by_type[kind] = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": (now or now_iso()) if moved else old["lastTransitionTime"],
    }
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(by_type.values(), key=lambda c: order.get(c["type"], len(order)))


def condition(status: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """One condition of a status, or None."""
    found = [c for c in (status or {}).get("conditions") or [] if c.get("type") == kind]
    return found[0] if found else None
