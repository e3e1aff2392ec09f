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
from distserve.k8s import naming, router, workers
from distserve.k8s.client import ApiClient, ApiError

# Kinds the operator owns, in the order they are deleted (dependents first).
OWNED_KINDS = ("Pod", "Service", "ConfigMap", "Deployment")


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
    if is_subset(patch, current):
        return "unchanged"
    await api.patch(obj["kind"], meta.get("namespace"), meta["name"], patch)
    return "patched"


async def apply_objects(api: ApiClient, objects: list[dict[str, Any]]) -> dict[str, int]:
    """create_or_patch each object in order; counts of each outcome."""
    counts = {"created": 0, "patched": 0, "unchanged": 0}
    for obj in objects:
        counts[await create_or_patch(api, obj)] += 1
    return counts


async def read_router_instances(api: ApiClient, owner: naming.Owner) -> list[dict[str, Any]]:
    """The instances the router is told about now (empty when there is no router yet)."""
    found = await api.get("ConfigMap", owner.namespace, naming.router_name(owner))
    document = ((found or {}).get("data") or {}).get(router.ROUTER_CONFIG_FILE)
    if not document:
        return []
    try:
        return list(json.loads(document).get("instances", []))
    except (ValueError, AttributeError):
        return []


def route_instances(
    current: list[dict[str, Any]],
    add: list[dict[str, Any]] = (),  # type: ignore[assignment]
    draining: frozenset[str] = frozenset(),
    removed: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """The router's instance list: the current entries minus `removed` revisions, those
    of `draining` revisions marked, then the `add`ed endpoints (live)."""
    replaced = {e["revision"] for e in add}
    kept = [
        {**entry, "draining": bool(entry.get("draining")) or entry.get("revision") in draining}
        for entry in current
        if entry.get("revision") not in removed and entry.get("revision") not in replaced
    ]
    return kept + [{**e, "draining": False} for e in add]


async def apply_router(api: ApiClient, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                       instances: list[dict[str, Any]]) -> None:
    """The router's ConfigMap, Deployment and Service, as built."""
    config = router.build_router_config(owner, spec, instances)
    await apply_objects(api, [
        router.build_router_config_map_spec(owner, spec, config),
        router.build_router_deployment_spec(owner, spec, config),
        router.build_router_service_spec(owner, spec),
    ])


async def apply_revision(api: ApiClient, revision: naming.Revision, known_nodes: set[str]) -> dict[str, int]:
    """Start a revision next to whatever runs; the router learns of it at once."""
    counts = await apply_objects(api, workers.build_revision_objects(revision, known_nodes))
    current = await read_router_instances(api, revision.owner)
    fresh = workers.instance_endpoints(revision)
    await apply_router(api, revision.owner, revision.spec, route_instances(current, add=fresh))
    return counts


async def recreate_missing(api: ApiClient, revision: naming.Revision, known_nodes: set[str]) -> list[str]:
    """Create the revision's and the router's objects that are gone; what was created."""
    owner, spec = revision.owner, revision.spec
    current = await read_router_instances(api, owner)
    instances = current or route_instances([], add=workers.instance_endpoints(revision))
    config = router.build_router_config(owner, spec, instances)
    objects = [*workers.build_revision_objects(revision, known_nodes),
               router.build_router_config_map_spec(owner, spec, config),
               router.build_router_deployment_spec(owner, spec, config),
               router.build_router_service_spec(owner, spec)]
    created = []
    for obj in objects:
        meta = obj["metadata"]
        if await api.get(obj["kind"], meta.get("namespace"), meta["name"]) is None:
            await create_or_patch(api, obj)
            created.append(f"{obj['kind']} {meta['name']}")
    return created


async def mark_draining(api: ApiClient, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                        old_ids: set[str], since: str) -> int:
    """Tell the router to stop sending to the old revisions; label their pods draining."""
    current = await read_router_instances(api, owner)
    await apply_router(api, owner, spec, route_instances(current, draining=frozenset(old_ids)))
    count = 0
    for pod in await api.list("Pod", owner.namespace, {naming.DEPLOYMENT_LABEL: owner.name}):
        meta = pod["metadata"]
        if meta.get("labels", {}).get(naming.REVISION_LABEL) not in old_ids:
            continue
        await api.patch("Pod", owner.namespace, meta["name"], {"metadata": {
            "labels": {naming.DRAINING_LABEL: "true"},
            "annotations": {naming.DRAINING_SINCE_ANNOTATION: since}}})
        count += 1
    return count


async def delete_revisions(api: ApiClient, owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                           old_ids: set[str]) -> int:
    """Delete the old revisions' objects and drop them from the router's list."""
    current = await read_router_instances(api, owner)
    await apply_router(api, owner, spec, route_instances(current, removed=frozenset(old_ids)))
    count = 0
    for old_id in sorted(old_ids):
        labels = {naming.DEPLOYMENT_LABEL: owner.name, naming.REVISION_LABEL: old_id}
        # NOTE: PodGroups exist (and the operator may list them) only with gang scheduling.
        kinds = OWNED_KINDS + (("PodGroup",) if spec.engine.gang_scheduling.enabled else ())
        count += await delete_labelled(api, owner.namespace, labels, kinds)
    return count


async def delete_labelled(api: ApiClient, namespace: str, labels: dict[str, str],
                          kinds: tuple[str, ...] = OWNED_KINDS) -> int:
    """Delete every object of `kinds` carrying the labels; how many were deleted."""
    count = 0
    for kind in kinds:
        for obj in await api.list(kind, namespace, labels):
            count += await api.delete(kind, namespace, obj["metadata"]["name"])
    return count


async def revisions_present(api: ApiClient, owner: naming.Owner) -> set[str]:
    """Every revision id that an owned object or a router entry still names."""
    labels = {naming.DEPLOYMENT_LABEL: owner.name}
    found = {entry.get("revision") for entry in await read_router_instances(api, owner)}
    for kind in OWNED_KINDS:
        for obj in await api.list(kind, owner.namespace, labels):
            found.add(obj["metadata"].get("labels", {}).get(naming.REVISION_LABEL))
    return {rid for rid in found if rid}


async def revisions_running(api: ApiClient, owner: naming.Owner) -> dict[str, list[dict[str, Any]]]:
    """Revision id -> its pods, for every revision of the resource that has pods."""
    revision_to_pods: dict[str, list[dict[str, Any]]] = {}
    for pod in await api.list("Pod", owner.namespace, {naming.DEPLOYMENT_LABEL: owner.name}):
        revision_id = pod["metadata"].get("labels", {}).get(naming.REVISION_LABEL)
        if revision_id:
            revision_to_pods.setdefault(revision_id, []).append(pod)
    return revision_to_pods
