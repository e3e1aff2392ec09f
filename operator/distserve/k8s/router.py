"""Builders of the router: its Deployment, its Service (the OpenAI endpoint), its config.

The router outlives plans: it is named after the resource, not a revision. Which
instances it sends to is data, the ConfigMap `<name>-router` (`router.json`), which the
operator rewrites during a rollout: the new revision's instances are added as soon as
they exist, the old ones are marked draining once the new ones are Ready (the router
sends no new request to a draining instance but lets in-flight ones finish), and
removed when they are deleted. The router re-reads the mounted file when it changes, so
switching plans restarts no router pod and drops no connection.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from distserve import spec as specs
from distserve.k8s import naming
from distserve.k8s.workers import build_env

ROUTER_CONFIG_DIR = "/etc/distserve/router"
ROUTER_CONFIG_FILE = "router.json"


def build_router_config(
    owner: naming.Owner, spec: specs.DistServeDeploymentSpec, instances: list[dict[str, Any]]
) -> dict[str, Any]:
    """The router's view: every instance of every live revision, draining ones marked
    (see `applying.route_instances`)."""
    return {
        "deployment": owner.name,
        "model": spec.model.name,
        "port": spec.engine.port,
        "instances": instances,
    }


def build_router_config_map_spec(owner: naming.Owner, config: dict[str, Any]) -> dict[str, Any]:
    """The ConfigMap holding `router.json`."""
    meta = naming.object_meta(owner, naming.router_name(owner), _router_labels(owner))
    document = json.dumps(config, indent=2, sort_keys=True)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {ROUTER_CONFIG_FILE: document}}


def _router_labels(owner: naming.Owner) -> dict[str, str]:
    """Labels of the router's objects and pods."""
    return {**naming.owner_labels(owner), "app.kubernetes.io/component": "router",
            naming.ROLE_LABEL: "router"}


def _router_selector(owner: naming.Owner) -> dict[str, str]:
    """The labels that pick the router's pods."""
    return {naming.DEPLOYMENT_LABEL: owner.name, naming.ROLE_LABEL: "router"}


def build_router_container(owner: naming.Owner, spec: specs.DistServeDeploymentSpec) -> dict[str, Any]:
    """The router container: the OpenAI API in front of the instances."""
    engine = spec.engine
    extra = engine.resources or {}
    container: dict[str, Any] = {
        "name": "router",
        "image": engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["python", "-m", "distserve_engine.server"],
        "args": [
            "--role", "router",
            "--config", f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_FILE}",
            "--host", "0.0.0.0",
            "--port", str(engine.port),
        ],
        "ports": [{"name": "http", "containerPort": engine.port}],
        "env": build_env(owner.name, engine.device) + list(engine.env or []),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "volumeMounts": [{"name": "router-config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True}],
    }
    # The router needs no GPU: only the spec's CPU and memory figures apply.
    cpu_memory = {
        kind: {k: v for k, v in extra.get(kind, {}).items() if k in ("cpu", "memory")}
        for kind in ("requests", "limits")
    }
    cpu_memory = {k: v for k, v in cpu_memory.items() if v}
    if cpu_memory:
        container["resources"] = cpu_memory
    return container


def build_router_deployment_spec(owner: naming.Owner, spec: specs.DistServeDeploymentSpec) -> dict[str, Any]:
    """The router Deployment; rolling updates keep a router serving throughout."""
    labels = _router_labels(owner)
    engine = spec.engine
    pod_spec: dict[str, Any] = {
        "containers": [build_router_container(owner, spec)],
        "volumes": [{"name": "router-config",
                     "configMap": {"name": naming.router_name(owner)}}],
        "terminationGracePeriodSeconds": 60,
    }
    if engine.node_selector:
        pod_spec["nodeSelector"] = dict(engine.node_selector)
    if engine.tolerations:
        pod_spec["tolerations"] = list(engine.tolerations)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.object_meta(owner, naming.router_name(owner), labels),
        "spec": {
            "replicas": engine.router_replicas,
            "selector": {"matchLabels": _router_selector(owner)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": labels,
                                      "annotations": {"distserve.io/spec-hash": _engine_hash(spec)}},
                         "spec": pod_spec},
        },
    }


def _engine_hash(spec: specs.DistServeDeploymentSpec) -> str:
    """Changes the pod template (a rolling restart) only when the router's settings change."""
    engine = spec.engine.model_dump(mode="json")
    return hashlib.sha256(json.dumps(engine, sort_keys=True).encode()).hexdigest()[:10]


def build_router_service_spec(owner: naming.Owner, spec: specs.DistServeDeploymentSpec) -> dict[str, Any]:
    """The Service users send OpenAI requests to, named as the resource."""
    meta = naming.object_meta(owner, naming.service_name(owner), _router_labels(owner))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": spec.engine.service_type,
            "selector": _router_selector(owner),
            "ports": [{"name": "http", "port": spec.engine.port, "targetPort": "http"}],
        },
    }
