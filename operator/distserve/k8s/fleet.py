"""The instances that run now, as the status keeps them, and what each one is.

After a reshuffle the instances may come from several revisions: the ones the new plan
shared with the old stay with their old names. The status keeps the set in one place:
`status.instances` lists `{"revision", "role", "index"}` of every live instance (created
or kept, not yet deleted), and `status.revisionPlans` the plan id of each revision named
there, its document in `status.plan` or `status.priorPlans` (each stored once, see
`status.py`), so that healing, draining and the next reshuffle need no search and no
other object. A status written before either existed means: every instance of the
applied plan, in `status.revision`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distserve import spec as specs
from distserve.k8s import naming, reshuffling, workers
from distserve.k8s import status as st
from distserve.plan import Plan


@dataclass(frozen=True)
class Member:
    """One live instance: the revision it was created in, and its place in that plan."""

    revision_id: str
    plan: Plan
    role: str
    index: int
    # The revision rebuilt with the current spec; None when the spec's engine or model has
    # changed since (the instance then runs something else and is on its way out).
    revision: naming.Revision | None

    @property
    def name(self) -> str:
        """The instance name (`naming.instance_name`, the router's peer name)."""
        return naming.instance_name(self.revision_id, self.role, self.index)

    @property
    def num_pods(self) -> int:
        """Its pipeline stages, one pod each."""
        return len(self.plan.segments_of(self.role, self.index))  # type: ignore[arg-type]

    def record(self) -> dict[str, Any]:
        """Its entry in `status.instances`."""
        return {"revision": self.revision_id, "role": self.role, "index": self.index}

    def footprint(self, engine_hash: str) -> reshuffling.Instance:
        """What the reshuffle planner compares: role, parallelism, GPUs, engine hash."""
        phase = self.plan.phase_of(self.role, self.index)  # type: ignore[arg-type]
        stages = tuple((s.node, tuple(s.gpu_ids))
                       for s in self.plan.segments_of(self.role, self.index))  # type: ignore[arg-type]
        if self.revision is None:
            engine_hash = f"stale-{self.revision_id}"
        return reshuffling.Instance(self.name, self.revision_id, self.role, self.index,
                                    phase.tp, phase.pp, stages, engine_hash)

    def objects(self, known_nodes: set[str]) -> list[dict[str, Any]]:
        """Its Service, PodGroup and pods as built now (none when it cannot be rebuilt)."""
        if self.revision is None:
            return []
        return workers.build_instance_objects(self.revision, self.role, self.index, known_nodes)

    def endpoint(self) -> dict[str, Any] | None:
        """Its router entry, live."""
        if self.revision is None:
            return None
        return next(e for e in workers.instance_endpoints(self.revision) if e["name"] == self.name)


def member(owner: naming.Owner, spec: specs.DistServeDeploymentSpec, revision_id: str,
           plan: Plan, role: str, index: int) -> Member:
    """A live instance, its revision rebuilt with `spec` when that gives the same id."""
    revision = naming.Revision(owner, plan, spec)
    return Member(revision_id, plan, role, index, revision if revision.id == revision_id else None)


def plan_members(revision: naming.Revision) -> list[Member]:
    """Every instance of a revision's plan."""
    plan = revision.plan
    return [Member(revision.id, plan, role, i, revision)
            for role in ("prefill", "decode") for i in range(plan.num_instances(role))]


def revision_plans(status: dict[str, Any]) -> dict[str, Plan]:
    """Revision id -> plan, for the revisions live instances come from."""
    found = {}
    docs = st.plan_documents(status)
    for revision_id, ref in (status.get("revisionPlans") or {}).items():
        # NOTE: a status an earlier operator wrote holds the document itself
        doc = ref if isinstance(ref, dict) else docs.get(ref) if ref else None
        plan = st.stored_plan({"plan": doc})
        if plan is not None:
            found[revision_id] = plan
    return found


def live_members(owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                 status: dict[str, Any]) -> list[Member]:
    """The live instances the status names (the applied plan's when it names none)."""
    plans = revision_plans(status)
    records = status.get("instances")
    if records is None:
        plan = st.stored_plan(status)
        revision_id = status.get("revision")
        if plan is None or not revision_id or status.get("appliedPlanId") != plan.plan_id:
            return []
        plans, records = {revision_id: plan}, [
            {"revision": revision_id, "role": role, "index": i}
            for role in ("prefill", "decode") for i in range(plan.num_instances(role))]
    return [member(owner, spec, r["revision"], plans[r["revision"]], r["role"], int(r["index"]))
            for r in records if r.get("revision") in plans]


def status_fields(members: list[Member], status: dict[str, Any],
                  also: dict[str, Plan]) -> dict[str, Any]:
    """`instances` and `revisionPlans` (revision id -> plan id) for these live instances,
    plus the plans `also` (a reshuffle's target) and the target of the reshuffle in
    `status`; revisions no one names any more are dropped (None: a merge patch removes
    the key). Their documents are offered in `priorPlans`; the status write keeps each
    once (`status.store_plans_once`)."""
    revision_to_plan: dict[str, Plan] = {}
    target = (status.get("reshuffle") or {}).get("revision")
    kept = revision_plans(status)
    if target in kept:
        revision_to_plan[target] = kept[target]
    revision_to_plan.update(also)
    revision_to_plan.update({m.revision_id: m.plan for m in members})
    refs: dict[str, Any] = {rid: None for rid in status.get("revisionPlans") or {}}
    refs.update({rid: plan.plan_id for rid, plan in revision_to_plan.items()})
    return {"instances": [m.record() for m in members], "revisionPlans": refs,
            "priorPlans": {plan.plan_id: plan.to_dict() for plan in revision_to_plan.values()}}
