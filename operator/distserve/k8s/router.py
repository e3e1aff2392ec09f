"""Builders of the router: its Deployment, its Service (the OpenAI endpoint), its config.

The router outlives plans: it is named after the resource, not a revision. Which
instances it sends to is data, the ConfigMap `<name>-router`, which the operator
rewrites during a rollout: the new revision's instances are added as soon as they
exist, the old ones are marked draining once the new ones are Ready (the router sends
no new request to a draining instance; its in-flight requests finish), and removed when
they are deleted. `serve.json` is what the engine's router reads (its `peers`: the
instances not draining, with their nodes); `router.json` lists every instance with its
draining flag. The engine's router re-reads `serve.json` while it runs (kubelet
updates a ConfigMap volume in place), so a change of peers or SLOs does not roll the
router: its pods, and the requests they stream, stay. Only a change of what the pod
runs (the spec's engine section) rolls it, with maxUnavailable 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from distserve import spec as specs
from distserve.k8s import naming, pods, scraping, weights
from distserve.k8s.workers import (
    SHUTDOWN_TIMEOUT_S,
    TERMINATION_GRACE_S,
    build_env,
    build_lifecycle,
)
from distserve.local.settings import plan_settings, serve_settings
from distserve.plan import Plan, is_low_affinity
from distserve_engine.server.settings import PlanInfo, ServeSettings

ROUTER_CONFIG_DIR = "/etc/distserve/router"
ROUTER_SETTINGS_FILE = "serve.json"  # the engine's ServeSettings with `peers`
ROUTER_CONFIG_FILE = "router.json"  # every instance of every live revision, draining marked
ENGINE_HASH_ANNOTATION = "distserve.io/engine-hash"
API_KEY_ENV = "DISTSERVE_API_KEY"  # the engine's router reads its keys from it


def build_router_config(
    owner: naming.Owner, spec: specs.DistServeDeploymentSpec, instances: list[dict[str, Any]],
    plan: Plan | dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The full view: every instance of every live revision, draining ones marked
    (see `applying.route_instances`), and the plan being served (for the metrics, and
    its algorithm for the router's decode dispatch)."""
    config = {
        "deployment": owner.name,
        "model": spec.model.name,
        "port": spec.engine.port,
        "instances": instances,
    }
    if isinstance(plan, Plan):
        config["plan"] = {**dataclasses.asdict(plan_settings(plan)), "algorithm": plan.algorithm}
    elif plan is not None:  # the plan an earlier config already holds
        config["plan"] = plan
    return config


def router_peers(config: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Role -> `{"name", "url", "node"}` of the instances the router may send new requests to."""
    peers: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    for entry in config["instances"]:
        if not entry.get("draining"):
            peers[entry["role"]].append(
                {"name": entry["name"], "url": entry["url"], "node": entry.get("node") or None})
    return peers


def build_router_settings(spec: specs.DistServeDeploymentSpec, config: dict[str, Any]) -> ServeSettings:
    """The router's engine settings: the local launcher's, plus the live peers, the plan,
    and whether decode may leave a prefill's node (not under low node affinity, where
    KV crosses the network only from a node without decode instances)."""
    peers = router_peers(config)
    counts = {role: len(urls) for role, urls in peers.items()}
    settings = serve_settings(spec, counts, config["deployment"], weights.model_path(spec))
    plan_doc = dict(config.get("plan") or {})
    # NOTE: a plan of unknown algorithm (none yet, or a config written before it was
    # kept) follows the spec's nodeAffinity, as a fixed plan does.
    algorithm = plan_doc.pop("algorithm", "fixed")
    return dataclasses.replace(
        settings, peers=peers, plan=PlanInfo.from_dict(plan_doc) if plan_doc else None,
        can_decode_across_nodes=not is_low_affinity(algorithm, spec.cluster.node_affinity))


def build_router_config_map_spec(
    owner: naming.Owner, spec: specs.DistServeDeploymentSpec, config: dict[str, Any]
) -> dict[str, Any]:
    """The ConfigMap holding the router's `serve.json` and the full `router.json`."""
    meta = naming.object_meta(owner, naming.router_name(owner), _router_labels(owner))
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {
        ROUTER_SETTINGS_FILE: json.dumps(build_router_settings(spec, config).to_dict(), indent=2, sort_keys=True),
        ROUTER_CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)}}


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
    options = engine.options_for("router")
    container: dict[str, Any] = {
        "name": "router",
        "image": engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["python", "-m", "distserve_engine.server"],
        "args": [
            "--config", f"{ROUTER_CONFIG_DIR}/{ROUTER_SETTINGS_FILE}",
            "--role", "router",
            "--instance", naming.router_name(owner),
            "--host", "0.0.0.0",
            "--port", str(engine.port),
            "--shutdown-timeout-s", str(SHUTDOWN_TIMEOUT_S),
        ],
        "ports": [{"name": "http", "containerPort": engine.port}],
        "env": build_env(owner.name, engine.device) + build_api_key_env(spec),
        # The router needs no GPU: only CPU and memory.
        "resources": pods.build_resources(options, pods.ROUTER_REQUESTS),
        **pods.build_probes(options, pods.ROUTER_STARTUP_TIMEOUT_S),
        "lifecycle": build_lifecycle(),
        "volumeMounts": [{"name": "router-config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True},
                         *weights.weights_mounts(spec)],
    }
    return pods.harden_container(container, options, has_shm=False)


def build_api_key_env(spec: specs.DistServeDeploymentSpec) -> list[dict[str, Any]]:
    """DISTSERVE_API_KEY from the Secret key `spec.router.apiKeySecret` names (kubelet
    reads it; the operator never sees the keys). A missing Secret keeps the router from
    starting rather than serving an open API."""
    secret = spec.router.api_key_secret
    if secret is None:
        return []
    return [{"name": API_KEY_ENV,
             "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}]


def build_router_deployment_spec(
    owner: naming.Owner, spec: specs.DistServeDeploymentSpec, config: dict[str, Any]
) -> dict[str, Any]:
    """The router Deployment. Its pod template changes only with the spec's engine
    section: peers and SLOs reach running pods through the ConfigMap."""
    engine = spec.engine
    options = engine.options_for("router")
    pod_spec: dict[str, Any] = {
        "containers": [build_router_container(owner, spec)],
        "volumes": [{"name": "router-config",
                     "configMap": {"name": naming.router_name(owner)}},
                    *pods.scratch_volumes(None), *weights.weights_volumes(spec)],
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
    }
    download = weights.download_container(spec, options, is_router=True)
    if download is not None:
        download["resources"] = {"requests": dict(weights.DOWNLOAD_REQUESTS)}
        pod_spec["initContainers"] = [pods.harden_container(download, options, has_shm=False)]
    pod_spec = pods.apply_pod_options(pod_spec, options)
    labels, annotations = pods.pod_metadata(options, _router_labels(owner), {
        ENGINE_HASH_ANNOTATION: _hash({"engine": spec.engine.model_dump(mode="json"),
                                       "model": spec.model.model_dump(mode="json")}),
        **scraping.scrape_annotations(spec.engine.port)})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.object_meta(owner, naming.router_name(owner), _router_labels(owner)),
        "spec": {
            "replicas": engine.router_replicas,
            "selector": {"matchLabels": _router_selector(owner)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": labels, "annotations": annotations},
                         "spec": pod_spec},
        },
    }


def _hash(document: Any) -> str:
    """A short digest of a JSON document."""
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:10]


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
