"""Names, labels and owner references of the objects the operator creates.

Every object is named from the DistServeDeployment's name and, for the objects of
one rollout, the revision id (the plan's placement and the engine settings hashed
together): two revisions never share an object, so a new plan can come up next to
the old one and the old one can be drained and deleted by label. Names stay within
the 63 characters of a DNS label (Service names and pod hostnames need it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from distserve import spec as specs
from distserve.plan import Plan

LABEL_PREFIX = "distserve.io"
DEPLOYMENT_LABEL = f"{LABEL_PREFIX}/deployment"
ROLE_LABEL = f"{LABEL_PREFIX}/role"
INSTANCE_LABEL = f"{LABEL_PREFIX}/instance"
STAGE_LABEL = f"{LABEL_PREFIX}/stage"
PLAN_LABEL = f"{LABEL_PREFIX}/plan-id"
REVISION_LABEL = f"{LABEL_PREFIX}/revision"
# NOTE: the router stops sending new requests to pods labelled draining; their
# in-flight requests finish before the operator deletes them.
DRAINING_LABEL = f"{LABEL_PREFIX}/draining"
DRAINING_SINCE_ANNOTATION = f"{LABEL_PREFIX}/draining-since"
APPROVAL_ANNOTATION = f"{LABEL_PREFIX}/approved-plan"
PLANNED_NODE_ANNOTATION = f"{LABEL_PREFIX}/planned-node"
GPU_IDS_ANNOTATION = f"{LABEL_PREFIX}/gpu-ids"
MANAGED_BY = "distserve-operator"
MAX_NAME = 63  # a DNS-1123 label: Service names and pod hostnames


@dataclass(frozen=True)
class Owner:
    """The DistServeDeployment that owns the objects."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Any) -> Owner:
        """The owner from a resource body (a kopf Body or a dict)."""
        meta = body["metadata"]
        return cls(meta["name"], meta.get("namespace") or "default", meta.get("uid", ""))


@dataclass(frozen=True)
class Revision:
    """One plan applied with one engine configuration: what a rollout is built from."""

    owner: Owner
    plan: Plan
    spec: specs.DistServeDeploymentSpec

    @property
    def engine_hash(self) -> str:
        """What the pods run (model and engine settings): instances of two revisions with
        the same hash and placement are the same instance."""
        return engine_hash(self.spec)

    @property
    def id(self) -> str:
        """Changes when the placement or anything the pods run with changes."""
        shape = {
            "plan": self.plan.plan_id,
            "model": self.spec.model.model_dump(mode="json"),
            "engine": self.spec.engine.model_dump(mode="json"),
        }
        digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()
        return digest[:8]


def engine_hash(spec: specs.DistServeDeploymentSpec) -> str:
    """A short digest of the spec's model and engine sections."""
    shape = {"model": spec.model.model_dump(mode="json"), "engine": spec.engine.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]


def instance_name(revision_id: str, role: str, index: int) -> str:
    """The name of a revision's `index`-th `role` instance: its engine's `--instance`, its
    key in `serve.json`'s parallel, its name in metrics, KV handles and the router's peers."""
    return f"{role}-{index}-{revision_id}"


def object_name(*parts: str) -> str:
    """Join parts with dashes; shorten the first part with a hash if over 63 characters."""
    name = "-".join(parts)
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    rest = "-".join(parts[1:])
    keep = MAX_NAME - len(rest) - len(digest) - 2
    return f"{parts[0][:keep].rstrip('-')}-{digest}-{rest}"


def router_name(owner: Owner) -> str:
    """The router Deployment and its ConfigMap."""
    return object_name(owner.name, "router")


def service_name(owner: Owner) -> str:
    """The OpenAI endpoint: the Service in front of the router, named as the resource."""
    return owner.name


def engine_config_name(revision: Revision) -> str:
    """The ConfigMap holding one revision's engine configuration."""
    return object_name(revision.owner.name, revision.id, "engine")


def instance_service_name(revision: Revision, role: str, index: int) -> str:
    """The headless Service of one instance (its workers' DNS subdomain)."""
    return object_name(revision.owner.name, revision.id, f"{role[0]}{index}")


def pod_name(revision: Revision, role: str, index: int, stage: int) -> str:
    """The pod running one segment (one pipeline stage) of one instance."""
    return object_name(revision.owner.name, revision.id, f"{role[0]}{index}", f"s{stage}")


def stage_hostname(stage: int) -> str:
    """A worker's hostname inside its instance's headless Service."""
    return f"s{stage}"


def owner_labels(owner: Owner) -> dict[str, str]:
    """Labels on everything the operator creates for one resource."""
    return {
        "app.kubernetes.io/name": "distserve",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        DEPLOYMENT_LABEL: owner.name,
    }


def revision_labels(revision: Revision) -> dict[str, str]:
    """Labels on the objects of one revision."""
    return {
        **owner_labels(revision.owner),
        PLAN_LABEL: revision.plan.plan_id,
        REVISION_LABEL: revision.id,
    }


def worker_labels(revision: Revision, role: str, index: int, stage: int | None) -> dict[str, str]:
    """Labels of one instance's Service (stage None) or of one of its pods."""
    labels = {
        **revision_labels(revision),
        "app.kubernetes.io/component": role,
        ROLE_LABEL: role,
        INSTANCE_LABEL: str(index),
    }
    if stage is not None:
        labels[STAGE_LABEL] = str(stage)
    return labels


def owner_references(owner: Owner) -> list[dict[str, Any]]:
    """Owner references that let the garbage collector delete a resource's objects."""
    return [
        {
            "apiVersion": f"{specs.API_GROUP}/{specs.API_VERSION}",
            "kind": specs.KIND,
            "name": owner.name,
            "uid": owner.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def object_meta(owner: Owner, name: str, labels: dict[str, str], **extra: Any) -> dict[str, Any]:
    """metadata of an owned object."""
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": owner_references(owner),
        **extra,
    }
