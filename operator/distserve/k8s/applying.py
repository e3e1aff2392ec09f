"""Putting built objects into the cluster: create-or-patch by name, drain, delete.

Every write is idempotent: an object that already matches what was built is left
alone, so a restarted operator that re-applies a plan changes nothing that is right.
Pods are never patched beyond their labels and annotations (their spec is immutable);
a change of what a pod runs is a new revision with new pod names.
"""

from __future__ import annotations

import json
from typing import Any

from distserve import spec as specs
from distserve.k8s import naming, network, router
from distserve.k8s.client import ApiClient, ApiError
from distserve.plan import Plan

# Kinds the operator owns, in the order they are deleted (dependents first).
OWNED_KINDS = ("Pod", "Service", "ConfigMap", "Deployment")


def owned_kinds() -> tuple[str, ...]:
    """OWNED_KINDS, and NetworkPolicies where the operator manages them (its chart grants
    them; otherwise it may not even list them)."""
    return OWNED_KINDS + ((network.POLICY_KIND,) if network.settings().is_managed else ())


def is_subset(desired: Any, current: Any) -> bool:
    """Whether everything in `desired` is in `current` (scalars compared as text,
    since the API server returns quantities such as `2` as `"2"`)."""
    if isinstance(desired, dict):
        return isinstance(current, dict) and all(
            is_subset(v, current.get(k)) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (isinstance(current, list) and len(desired) == len(current)
                and all(is_subset(d, c) for d, c in zip(desired, current, strict=True)))
    return str(desired) == str(current)


def patch_of(obj: dict[str, Any]) -> dict[str, Any]:
    """What may be patched on an existing object of this kind."""
    meta = obj["metadata"]
    metadata = {k: meta[k] for k in ("labels", "annotations") if k in meta}
    if obj["kind"] == "Pod":
        return {"metadata": metadata}
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    return {"metadata": metadata, **body}


async def create_or_patch(api: ApiClient, obj: dict[str, Any]) -> str:
    """Make the object exist as built; returns "created", "patched" or "unchanged"."""
    meta = obj["metadata"]
    current = await api.get(obj["kind"], meta.get("namespace"), meta["name"])
    if current is None:
        try:
            await api.create(obj)
            return "created"
        except ApiError as exc:
            if exc.status != 409:
                raise
            current = await api.get(obj["kind"], meta.get("namespace"), meta["name"]) or {}
    patch = patch_of(obj)
    if is_subset(patch, current) and (obj["kind"] != network.POLICY_KIND
                                      or current.get("spec") == obj["spec"]):
        # NOTE: a NetworkPolicy's rules must match exactly: a rule that drops its `from`
        # (open to all again) is a subset of the restricted one it replaces.
        return "unchanged"
    await api.patch(obj["kind"], meta.get("namespace"), meta["name"], patch)
    return "patched"


async def apply_objects(api: ApiClient, objects: list[dict[str, Any]]) -> dict[str, int]:
    """create_or_patch each object in order; counts of each outcome."""
    counts = {"created": 0, "patched": 0, "unchanged": 0}
    for obj in objects:
        counts[await create_or_patch(api, obj)] += 1
    return counts


async def read_router_config(api: ApiClient, owner: naming.Owner) -> dict[str, Any] | None:
    """The router's full configuration now (None when there is no router yet)."""
    found = await api.get("ConfigMap", owner.namespace, naming.router_name(owner))
    document = ((found or {}).get("data") or {}).get(router.ROUTER_CONFIG_FILE)
    if not document:
        return None
    try:
        config = json.loads(document)
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


async def read_router_instances(api: ApiClient, owner: naming.Owner) -> list[dict[str, Any]]:
    """The instances the router is told about now (empty when there is no router yet)."""
    config = await read_router_config(api, owner) or {}
    instances = config.get("instances", [])
    return list(instances) if isinstance(instances, list) else []


def route_instances(
    current: list[dict[str, Any]],
    add: list[dict[str, Any]] = (),  # type: ignore[assignment]
    draining: frozenset[str] = frozenset(),
    serving: frozenset[str] = frozenset(),
    removed: frozenset[str] = frozenset(),
    removed_revisions: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """The router's instance list: the current entries minus the `removed` instance names
    and every entry of `removed_revisions`, the `draining` names marked and the `serving`
    names unmarked, then the `add`ed endpoints (live; they replace entries of their name)."""
    replaced = {e["name"] for e in add}
    kept = [
        {**entry, "draining": entry["name"] in draining
         or (bool(entry.get("draining")) and entry["name"] not in serving)}
        for entry in current
        if entry.get("name") not in removed | replaced
        and entry.get("revision") not in removed_revisions
    ]
    return kept + [{**e, "draining": False} for e in add]


async def apply_router(api: ApiClient, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                       instances: list[dict[str, Any]],
                       plan: Plan | dict[str, Any] | None = None) -> None:
    """The router's ConfigMap, Deployment and Service, as built (with the plan it serves,
    which its metrics export)."""
    config = router.build_router_config(owner, spec, instances, plan)
    await apply_objects(api, [
        router.build_router_config_map_spec(owner, spec, config),
        router.build_router_deployment_spec(owner, spec, config),
        router.build_router_service_spec(owner, spec),
    ])


async def refresh_router(api: ApiClient, owner: naming.Owner,
                         spec: specs.DistServeDeploymentSpec) -> None:
    """Re-apply an existing router with the spec as it is now (its API key, its pod
    options), same instances, same plan; nothing when there is no router yet."""
    config = await read_router_config(api, owner)
    if config is not None:
        instances = config.get("instances", [])
        await apply_router(api, owner, spec, list(instances) if isinstance(instances, list) else [],
                           config.get("plan"))


async def apply_network_policies(api: ApiClient, owner: naming.Owner,
                                 spec: specs.DistServeDeploymentSpec) -> int:
    """Make the deployment's NetworkPolicies as built, or delete them when the spec turned
    them off; nothing where the operator does not manage them. How many were applied."""
    found = network.settings()
    if not found.is_managed:
        return 0
    policies = network.build_network_policies(owner, spec, found)
    if policies:
        await apply_objects(api, policies)
    else:
        await delete_labelled(api, owner.namespace, {naming.DEPLOYMENT_LABEL: owner.name}, (network.POLICY_KIND,))
    return len(policies)


async def inventory(api: ApiClient, owner: naming.Owner) -> dict[str, dict[str, dict[str, Any]]]:
    """Kind -> name -> object, for every object of `owned_kinds()` the resource owns (one
    list per kind: the monitor reads this once a round instead of one GET per object)."""
    labels = {naming.DEPLOYMENT_LABEL: owner.name}
    return {kind: {o["metadata"]["name"]: o for o in await api.list(kind, owner.namespace, labels)}
            for kind in owned_kinds()}


def routed_in(found: dict[str, dict[str, dict[str, Any]]], owner: naming.Owner) -> list[dict[str, Any]]:
    """The router's instance list as the inventory holds it."""
    config_map = found.get("ConfigMap", {}).get(naming.router_name(owner)) or {}
    document = (config_map.get("data") or {}).get(router.ROUTER_CONFIG_FILE)
    try:
        return list(json.loads(document).get("instances", [])) if document else []
    except (ValueError, AttributeError):
        return []


async def create_missing(api: ApiClient, objects: list[dict[str, Any]],
                         found: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Create those of the objects the inventory lacks; `Kind name` of each one created."""
    created = []
    for obj in objects:
        meta = obj["metadata"]
        if obj["kind"] in found:
            is_missing = meta["name"] not in found[obj["kind"]]
        else:
            is_missing = await api.get(obj["kind"], meta.get("namespace"), meta["name"]) is None
        if is_missing and await create_or_patch(api, obj) == "created":
            created.append(f"{obj['kind']} {meta['name']}")
    return created


async def update_router(api: ApiClient, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                        plan: Plan | None = None, **change: Any) -> None:
    """Apply `route_instances(current, **change)` to the router, and `plan` as the one it
    serves (else the plan it already names)."""
    config = await read_router_config(api, owner) or {}
    instances = config.get("instances", [])
    current = list(instances) if isinstance(instances, list) else []
    await apply_router(api, owner, spec, route_instances(current, **change),
                       plan if plan is not None else config.get("plan"))


def instance_labels(owner: naming.Owner, revision_id: str, role: str, index: int) -> dict[str, str]:
    """The labels that pick one instance's Service, PodGroup and pods."""
    return {naming.DEPLOYMENT_LABEL: owner.name, naming.REVISION_LABEL: revision_id,
            naming.ROLE_LABEL: role, naming.INSTANCE_LABEL: str(index)}


async def label_draining(api: ApiClient, owner: naming.Owner, labels: dict[str, str], since: str) -> int:
    """Label the picked pods draining (for people and tools); how many."""
    pods = await api.list("Pod", owner.namespace, labels)
    for pod in pods:
        await api.patch("Pod", owner.namespace, pod["metadata"]["name"], {"metadata": {
            "labels": {naming.DRAINING_LABEL: "true"},
            "annotations": {naming.DRAINING_SINCE_ANNOTATION: since}}})
    return len(pods)


async def delete_revisions(api: ApiClient, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                           old_ids: set[str]) -> int:
    """Delete the old revisions' objects and drop them from the router's list."""
    await update_router(api, owner, spec, removed_revisions=frozenset(old_ids))
    count = 0
    for old_id in sorted(old_ids):
        labels = {naming.DEPLOYMENT_LABEL: owner.name, naming.REVISION_LABEL: old_id}
        # NOTE: PodGroups exist (and the operator may list them) only with gang scheduling.
        kinds = OWNED_KINDS + (("PodGroup",) if spec.engine.gang_scheduling.enabled else ())
        count += await delete_labelled(api, owner.namespace, labels, kinds)
    return count


async def delete_labelled(api: ApiClient, namespace: str, labels: dict[str, str],
                          kinds: tuple[str, ...] | None = None) -> int:
    """Delete every object of `kinds` (default: `owned_kinds()`) carrying the labels; how
    many were deleted."""
    count = 0
    for kind in owned_kinds() if kinds is None else kinds:
        for obj in await api.list(kind, namespace, labels):
            count += await api.delete(kind, namespace, obj["metadata"]["name"])
    return count


def revisions_present(found: dict[str, dict[str, dict[str, Any]]], owner: naming.Owner) -> set[str]:
    """Every revision id that an owned object or a router entry still names."""
    ids = {entry.get("revision") for entry in routed_in(found, owner)}
    for objects in found.values():
        ids |= {o["metadata"].get("labels", {}).get(naming.REVISION_LABEL) for o in objects.values()}
    return {rid for rid in ids if rid}
