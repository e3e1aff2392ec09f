"""Builders of the prefill and decode workers: pods, per-instance Services, engine config.

One pod runs one segment (one pipeline stage of one instance) and takes the segment's
`tp` GPUs on one node. The plan names that node; how hard the pod is held to it follows
the plan's node affinity:

- low affinity (Algorithm 2): the prefill and decode segments of the same stage must
  share a node so KV moves over NVLink only. The pod *requires* its planned node; when
  the plan's node names are not real nodes (the shape came from the spec), pods of one
  planned node require each other's company instead (pod affinity on the hostname).
- high affinity (Algorithm 1): the network between nodes is fast, so the planned node is
  only *preferred* and the scheduler may spread the segments.

The builders are pure: (revision, segment) -> dict, ready for the API.
"""

from __future__ import annotations

import json
from typing import Any

from distserve.k8s import gang, naming, pods, scraping, weights
from distserve.k8s.nodes import GPU_RESOURCE, is_cpu_spec
from distserve.local.settings import instance_counts, instance_parallel, serve_settings
from distserve.plan import SegmentPlacement, is_low_affinity
from distserve_engine.server.settings import ServeSettings

CONFIG_DIR = "/etc/distserve"
SETTINGS_FILE = "serve.json"  # the engine's ServeSettings document (`--config`)
PLAN_FILE = "plan.json"  # the plan and revision, for people and tools
MASTER_PORT = 29500  # torch.distributed rendezvous of an instance's stages
HOSTNAME_LABEL = "kubernetes.io/hostname"
PLANNED_NODE_LABEL = f"{naming.LABEL_PREFIX}/planned-node"
# NOTE: after SIGTERM the engine lets in-flight requests finish for SHUTDOWN_TIMEOUT_S
# (`--shutdown-timeout-s`); the preStop sleep first lets Service endpoints drop the pod;
# the grace period covers both with a margin. The router has stopped sending to a
# draining pod well before it is deleted.
PRESTOP_SLEEP_S = 5
SHUTDOWN_TIMEOUT_S = 90
TERMINATION_GRACE_S = PRESTOP_SLEEP_S + SHUTDOWN_TIMEOUT_S + 25


def instance_endpoints(revision: naming.Revision) -> list[dict[str, Any]]:
    """Where each instance of a revision listens: its stage-0 pod in its headless Service."""
    plan, owner = revision.plan, revision.owner
    port = revision.spec.engine.port
    endpoints = []
    key_to_nodes: dict[tuple[str, int], list[str]] = {}
    for segment in sorted(plan.segments, key=lambda s: s.stage):
        key_to_nodes.setdefault((segment.role, segment.instance), []).append(segment.node)
    for role in ("prefill", "decode"):
        for index in range(plan.num_instances(role)):
            phase = plan.phase_of(role, index)
            service = naming.instance_service_name(revision, role, index)
            host = f"{naming.stage_hostname(0)}.{service}.{owner.namespace}.svc"
            endpoints.append(
                {
                    "name": naming.instance_name(revision.id, role, index),
                    "role": role,
                    "instance": index,
                    "revision": revision.id,
                    "url": f"http://{host}:{port}",
                    "stages": phase.pp,
                    # Where its stages run, each node once in stage order: a decode
                    # instance with the same nodes as a prefill instance pulls KV over
                    # the nodes' fast links (Algorithm 2, whose prefill and decode may
                    # have different numbers of stages on each node).
                    "node": ",".join(dict.fromkeys(key_to_nodes.get((role, index), []))),
                }
            )
    return endpoints


def build_serve_settings(revision: naming.Revision) -> ServeSettings:
    """The engine's settings document (the local launcher's, with in-pod paths): every
    instance's tp and pp under its name, which its pods read (`instance/ranks.py`)."""
    plan, spec = revision.plan, revision.spec
    def name(role: str, index: int) -> str:
        return naming.instance_name(revision.id, role, index)

    return serve_settings(spec, instance_counts(spec, plan), revision.owner.name,
                          weights.model_path(spec), instance_parallel(spec, plan, name=name),
                          plan=plan)


def build_engine_config_map_spec(revision: naming.Revision) -> dict[str, Any]:
    """The ConfigMap of one revision: `serve.json` for the engine, `plan.json` for reference."""
    meta = naming.object_meta(
        revision.owner, naming.engine_config_name(revision), naming.revision_labels(revision)
    )
    plan_doc = {"revision": revision.id, "plan": revision.plan.to_dict(),
                "instances": instance_endpoints(revision)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {
        SETTINGS_FILE: json.dumps(build_serve_settings(revision).to_dict(), indent=2, sort_keys=True),
        PLAN_FILE: json.dumps(plan_doc, indent=2, sort_keys=True)}}


def build_instance_service_spec(revision: naming.Revision, role: str, index: int) -> dict[str, Any]:
    """A headless Service through which the segments of one instance find each other."""
    labels = naming.worker_labels(revision, role, index, None)
    selector = {k: labels[k] for k in (naming.REVISION_LABEL, naming.ROLE_LABEL, naming.INSTANCE_LABEL)}
    meta = naming.object_meta(revision.owner, naming.instance_service_name(revision, role, index), labels)
    port = revision.spec.engine.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            # NOTE: workers must resolve each other before they are Ready (NCCL rendezvous).
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    }


def build_affinity(revision: naming.Revision, segment: SegmentPlacement, known_nodes: set[str]) -> dict[str, Any] | None:
    """The pod's affinity to its planned node, per the plan's node affinity."""
    is_low = is_low_affinity(revision.plan.algorithm, revision.spec.cluster.node_affinity)
    if segment.node in known_nodes:
        term = {"matchExpressions": [
            {"key": HOSTNAME_LABEL, "operator": "In", "values": [segment.node]}]}
        if is_low:
            return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [term]}}}
        return {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": term}]}}
    if not is_low:
        return None
    together = {
        "labelSelector": {"matchLabels": {
            naming.REVISION_LABEL: revision.id, PLANNED_NODE_LABEL: segment.node}},
        "topologyKey": HOSTNAME_LABEL,
    }
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [together]}}


def build_resources(revision: naming.Revision, role: str, gpus: int) -> dict[str, Any]:
    """Container resources: the role's options, CPU and memory defaults for a pod of
    `gpus` GPUs (CPU ranks on the CPU), and the GPUs themselves."""
    is_gpu = not is_cpu_spec(revision.spec)
    defaults = pods.engine_requests(revision.spec, gpus, is_gpu)
    extended = {GPU_RESOURCE: gpus} if is_gpu else None
    return pods.build_resources(revision.spec.engine.options_for(role), defaults, extended)


def build_worker_container(revision: naming.Revision, segment: SegmentPlacement) -> dict[str, Any]:
    """The engine container of one segment; its arguments are the engine's contract."""
    engine = revision.spec.engine
    options = engine.options_for(segment.role)
    service = naming.instance_service_name(revision, segment.role, segment.instance)
    namespace = revision.owner.namespace
    own_url = f"http://{naming.stage_hostname(segment.stage)}.{service}.{namespace}.svc:{engine.port}"
    args = [
        "--config", f"{CONFIG_DIR}/{SETTINGS_FILE}",
        "--role", segment.role,
        "--instance", naming.instance_name(revision.id, segment.role, segment.instance),
        "--stage", str(segment.stage),
        "--host", "0.0.0.0",
        "--port", str(engine.port),
        "--advertise-url", own_url,
        "--shutdown-timeout-s", str(SHUTDOWN_TIMEOUT_S),
    ]
    container = {
        "name": "engine",
        "image": engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["python", "-m", "distserve_engine.server"],
        "args": args,
        "ports": [{"name": "http", "containerPort": engine.port}],
        "env": (build_env(revision.owner.name, engine.device, revision.id)
                + build_rendezvous_env(revision, segment)),
        "resources": build_resources(revision, segment.role, len(segment.gpu_ids)),
        **pods.build_probes(options, pods.ENGINE_STARTUP_TIMEOUT_S),
        "lifecycle": build_lifecycle(),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         *weights.weights_mounts(revision.spec)],
    }
    return pods.harden_container(container, options, has_shm=True)


def build_lifecycle() -> dict[str, Any]:
    """A preStop pause so endpoints and peers stop sending before SIGTERM."""
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}}


def _field_ref(path: str) -> dict[str, Any]:
    """An environment value taken from the pod's own fields (the downward API)."""
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def build_env(deployment: str, device: str, revision_id: str | None = None) -> list[dict[str, Any]]:
    """Environment every engine container gets (the router has no revision)."""
    env = [
        {"name": "DISTSERVE_DEPLOYMENT", "value": deployment},
        {"name": "DISTSERVE_DEVICE", "value": device},
        {"name": "POD_NAME", **_field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", **_field_ref("metadata.namespace")},
        {"name": "NODE_NAME", **_field_ref("spec.nodeName")},
    ]
    if revision_id is not None:
        env.insert(1, {"name": "DISTSERVE_REVISION", "value": revision_id})
    return env


def build_rendezvous_env(revision: naming.Revision, segment: SegmentPlacement) -> list[dict[str, Any]]:
    """Where the torch.distributed rendezvous of this pod's instance listens (its stage
    0), in torch's own variables; the pod's stage is an argument (`--stage`), its tp and
    pp are in `serve.json` under the instance's name."""
    service = naming.instance_service_name(revision, segment.role, segment.instance)
    master = f"{naming.stage_hostname(0)}.{service}.{revision.owner.namespace}.svc"
    return [
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
    ]


def build_worker_pod_spec(revision: naming.Revision, segment: SegmentPlacement, known_nodes: set[str]) -> dict[str, Any]:
    """The pod of one segment, pinned per the plan. `known_nodes`: the cluster's node names."""
    role, index, stage = segment.role, segment.instance, segment.stage
    options = revision.spec.engine.options_for(role)
    group_labels, group_fields = gang.pod_fields(revision, role, index)
    labels = {**naming.worker_labels(revision, role, index, stage),
              PLANNED_NODE_LABEL: segment.node, **group_labels}
    # NOTE: the GPU ids are the plan's, for people reading the pod: the device plugin
    # chooses which of the node's GPUs the pod gets (it asks for `tp` of them); only
    # `distserve up` pins processes to these ids (CUDA_VISIBLE_DEVICES).
    annotations = {
        naming.PLANNED_NODE_ANNOTATION: segment.node,
        naming.GPU_IDS_ANNOTATION: ",".join(str(g) for g in segment.gpu_ids),
        **scraping.scrape_annotations(revision.spec.engine.port),
    }
    labels, annotations = pods.pod_metadata(options, labels, annotations)
    name = naming.pod_name(revision, role, index, stage)
    meta = naming.object_meta(revision.owner, name, labels, annotations=annotations)
    is_gpu = not is_cpu_spec(revision.spec)
    pod_spec: dict[str, Any] = {
        "hostname": naming.stage_hostname(stage),
        "subdomain": naming.instance_service_name(revision, role, index),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "containers": [build_worker_container(revision, segment)],
        "volumes": [
            {"name": "config", "configMap": {"name": naming.engine_config_name(revision)}},
            *pods.scratch_volumes(pods.shm_size(revision.spec, len(segment.gpu_ids), is_gpu)),
            *weights.weights_volumes(revision.spec),
        ],
        **group_fields,
    }
    download = weights.download_container(revision.spec, options)
    if download is not None:
        download["resources"] = {"requests": dict(weights.DOWNLOAD_REQUESTS)}
        pod_spec["initContainers"] = [pods.harden_container(download, options, has_shm=False)]
    affinity = build_affinity(revision, segment, known_nodes)
    if affinity:
        pod_spec["affinity"] = affinity
    # Pods on tainted GPU nodes: the GPU operator's usual taint is tolerated.
    gpu_toleration = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    pod_spec = pods.apply_pod_options(pod_spec, options, gpu_toleration if is_gpu else None)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_instance_objects(revision: naming.Revision, role: str, index: int,
                           known_nodes: set[str]) -> list[dict[str, Any]]:
    """One instance's objects: its Service (and PodGroup), then its pods."""
    groups = [g for g in gang.build_pod_groups(revision)
              if g["metadata"]["name"] == gang.pod_group_name(revision, role, index)]
    worker_pods = [build_worker_pod_spec(revision, s, known_nodes)
                   for s in revision.plan.segments_of(role, index)]  # type: ignore[arg-type]
    return [build_instance_service_spec(revision, role, index), *groups, *worker_pods]


def build_revision_objects(revision: naming.Revision, known_nodes: set[str]) -> list[dict[str, Any]]:
    """Everything one revision runs on: config first, then Services (and PodGroups), then pods."""
    plan = revision.plan
    services = [
        build_instance_service_spec(revision, role, index)
        for role in ("prefill", "decode") for index in range(plan.num_instances(role))
    ]
    worker_pods = [build_worker_pod_spec(revision, s, known_nodes) for s in plan.segments]
    return [build_engine_config_map_spec(revision), *services, *gang.build_pod_groups(revision),
            *worker_pods]
