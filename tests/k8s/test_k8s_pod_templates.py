"""Pods as a platform team gets them: valid Kubernetes (strict), Pod Security "restricted",
per-role options, default requests, /dev/shm, probes, gang scheduling."""

from __future__ import annotations

import kubernetes_validate
import pytest
from k8s_factories import NODES, make_plan, make_revision, make_spec
from pod_security import restricted_violations

from distserve.k8s import gang, pods, router, workers

KUBE_VERSION = "1.30.0"
KNOWN = set(NODES)
HF = {"name": "facebook/opt-13b", "source": {"huggingFace": {
    "tokenSecret": {"name": "hf-token"}, "cache": {"sizeLimit": "64Gi"}}}}
SOURCES = {
    "none": {"name": "facebook/opt-13b"},
    "pvc": {"name": "facebook/opt-13b", "source": {"persistentVolumeClaim": {
        "claimName": "models", "subPath": "opt-13b"}}},
    "huggingface": HF,
    "huggingface-claim": {"name": "facebook/opt-13b", "source": {"huggingFace": {
        "cache": {"claimName": "hf-cache"}}}},
    "image": {"name": "facebook/opt-13b", "source": {"image": {"path": "/weights/opt"}}},
    "hostpath": {"name": "facebook/opt-13b", "source": {"hostPath": {"path": "/mnt/opt-13b"}}},
}
FULL_ENGINE = {
    "resources": {"requests": {"cpu": 4}},
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
    "imagePullSecrets": [{"name": "regcred"}],
    "priorityClassName": "inference",
    "serviceAccountName": "llm",
    "annotations": {"team": "search"},
    "labels": {"cost-center": "42"},
    "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
    "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True}],
    "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
    "prefill": {"priorityClassName": "inference-high", "labels": {"tier": "prefill"},
                "resources": {"limits": {"memory": "200Gi"}}},
    "router": {"nodeSelector": {"pool": "cpu"}, "startupTimeoutSeconds": 120},
    "gangScheduling": {"enabled": True},
}


def build_all(spec, plan=None):
    """Every object of one revision plus the router's, as the operator applies them."""
    revision = make_revision(plan or make_plan(), spec)
    owner = revision.owner
    config = router.build_router_config(owner, spec, workers.instance_endpoints(revision))
    return revision, workers.build_revision_objects(revision, KNOWN) + [
        router.build_router_deployment_spec(owner, spec, config),
        router.build_router_service_spec(owner, spec),
        router.build_router_config_map_spec(owner, spec, config),
    ]


def pod_specs(objects):
    """(role, pod spec) of every worker pod and of the router's template."""
    found = [(o["metadata"]["labels"]["distserve.io/role"], o["spec"])
             for o in objects if o["kind"] == "Pod"]
    found += [("router", o["spec"]["template"]["spec"]) for o in objects if o["kind"] == "Deployment"]
    return found


def by_role(objects):
    return {role: spec for role, spec in pod_specs(objects)}


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("engine", [{}, FULL_ENGINE], ids=["defaults", "every-option"])
def test_every_built_object_is_strictly_valid_kubernetes(source, engine):
    plan = make_plan("low-affinity", prefill=(2, 2, 1), decode=(1, 2, 1))
    _, objects = build_all(make_spec(model=SOURCES[source], engine=engine), plan)
    kinds = sorted({o["kind"] for o in objects})
    expected = {"ConfigMap", "Deployment", "Pod", "Service"} | ({"PodGroup"} if engine else set())
    assert kinds == sorted(expected)
    for obj in objects:
        if obj["kind"] == "PodGroup":  # a scheduler-plugins CRD: not in the core schemas
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("source", sorted(set(SOURCES) - {"hostpath"}))
def test_engine_and_router_pods_pass_pod_security_restricted(source):
    _, objects = build_all(make_spec(model=SOURCES[source], engine=FULL_ENGINE))
    specs_ = pod_specs(objects)
    assert {role for role, _ in specs_} == {"prefill", "decode", "router"}
    for role, pod_spec in specs_:
        assert restricted_violations(pod_spec) == [], role


def test_a_hostpath_model_source_is_not_restricted_and_says_why():
    # hostPath volumes are refused by "baseline" and "restricted" alike: a namespace that
    # enforces either must take the weights from a claim, a download or the image.
    _, objects = build_all(make_spec(model=SOURCES["hostpath"]))
    for _, pod_spec in pod_specs(objects):
        assert restricted_violations(pod_spec) == [  # and nothing else
            "hostPath volume weights", "volume weights of type hostPath"]


def test_the_restricted_checker_catches_what_it_checks():
    _, objects = build_all(make_spec())
    pod_spec = by_role(objects)["prefill"]
    container = pod_spec["containers"][0]
    bad = {**pod_spec, "hostNetwork": True,
           "securityContext": {**pod_spec["securityContext"], "seccompProfile": {"type": "Unconfined"}},
           "containers": [{**container, "securityContext": {
               "privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}, "runAsNonRoot": False}}]}
    problems = restricted_violations(bad)
    assert "hostNetwork is true" in problems
    assert "container engine is privileged" in problems
    assert "container engine: allowPrivilegeEscalation is not false" in problems
    assert "container engine: capabilities do not drop ALL" in problems
    assert "container engine: adds capabilities SYS_ADMIN" in problems
    assert "container engine: runAsNonRoot is not true" in problems
    assert "container engine: seccomp profile Unconfined (want RuntimeDefault)" in problems


def test_root_filesystem_is_read_only_with_writable_scratch():
    _, objects = build_all(make_spec())
    for role, pod_spec in pod_specs(objects):
        container = pod_spec["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/tmp"] == "tmp" and mounts[pods.SCRATCH_DIR] == "cache"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HOME"] == pods.SCRATCH_DIR
        assert env["HF_HOME"].startswith(pods.SCRATCH_DIR)
        assert pod_spec["automountServiceAccountToken"] is False
        assert ("/dev/shm" in mounts) == (role != "router")


def test_role_options_override_the_defaults_and_the_operator_keeps_its_labels():
    revision, objects = build_all(make_spec(engine={
        **FULL_ENGINE, "labels": {"cost-center": "42", "app.kubernetes.io/component": "mine"}}))
    roles = by_role(objects)
    assert roles["prefill"]["priorityClassName"] == "inference-high"
    assert roles["decode"]["priorityClassName"] == "inference"
    assert roles["router"]["nodeSelector"] == {"pool": "cpu"}
    assert roles["decode"]["nodeSelector"] == {"pool": "gpu"}
    for pod_spec in roles.values():
        assert pod_spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod_spec["serviceAccountName"] == "llm"
        assert {"name": "certs", "secret": {"secretName": "ca"}} in pod_spec["volumes"]
        container = pod_spec["containers"][0]
        assert {"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True} in container["volumeMounts"]
        assert container["env"][-1] == {"name": "NCCL_DEBUG", "value": "WARN"}
    assert roles["decode"]["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    pod = next(o for o in objects if o["kind"] == "Pod" and o["metadata"]["labels"]["distserve.io/role"] == "prefill")
    labels = pod["metadata"]["labels"]
    assert labels["tier"] == "prefill" and labels["cost-center"] == "42"
    assert labels["app.kubernetes.io/component"] == "prefill"  # the operator's label wins
    assert pod["metadata"]["annotations"]["team"] == "search"
    template = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]
    assert template["metadata"]["labels"]["cost-center"] == "42"
    assert "tier" not in template["metadata"]["labels"]


def _qos(pod_spec):
    """The pod's QoS class as the kubelet computes it (for cpu and memory)."""
    containers = pod_spec["containers"]
    amounts = [c.get("resources", {}) for c in containers]
    if not any(r.get(kind, {}).get(name) for r in amounts
               for kind in ("requests", "limits") for name in ("cpu", "memory")):
        return "BestEffort"
    is_guaranteed = all(r.get("limits", {}).get(n) and r.get("limits", {}).get(n) == r.get("requests", {}).get(n, r["limits"][n])
                        for r in amounts for n in ("cpu", "memory"))
    return "Guaranteed" if is_guaranteed else "Burstable"


def test_no_pod_is_best_effort_and_user_requests_replace_defaults():
    revision, objects = build_all(make_spec(engine=FULL_ENGINE, model=HF))
    for _, pod_spec in pod_specs(objects):
        assert _qos(pod_spec) != "BestEffort"
        for container in pod_spec.get("initContainers", []):
            assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    roles = by_role(objects)
    prefill = roles["prefill"]["containers"][0]["resources"]
    # cpu from the spec; memory: the user set only a limit, which becomes the request.
    assert prefill["requests"] == {"cpu": 4, "nvidia.com/gpu": 2}
    assert prefill["limits"] == {"memory": "200Gi", "nvidia.com/gpu": 2}
    decode = roles["decode"]["containers"][0]["resources"]
    assert decode["requests"]["memory"] == f"{(pods.shm_size_bytes(1, True) + pods.HOST_MEMORY_BYTES_PER_RANK) >> 20}Mi"
    assert roles["router"]["containers"][0]["resources"] == {"requests": {"cpu": 4, "memory": "2Gi"}}


def test_shm_is_memory_backed_and_sized_per_gpu_unless_set():
    plan = make_plan(prefill=(4, 1, 1), decode=(2, 1, 1))
    _, objects = build_all(make_spec(), plan)
    sizes = {role: next(v for v in s["volumes"] if v["name"] == "dshm")["emptyDir"]
             for role, s in pod_specs(objects) if role != "router"}
    assert sizes == {"prefill": {"medium": "Memory", "sizeLimit": "5120Mi"},
                     "decode": {"medium": "Memory", "sizeLimit": "3072Mi"}}
    _, objects = build_all(make_spec(engine={"shmSize": "16Gi"}), plan)
    assert {next(v for v in s["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
            for role, s in pod_specs(objects) if role != "router"} == {"16Gi"}


def test_probes_allow_a_long_load_and_restart_a_hung_engine():
    _, objects = build_all(make_spec(engine={"router": {"startupTimeoutSeconds": 120}}))
    for role, pod_spec in pod_specs(objects):
        container = pod_spec["containers"][0]
        startup, liveness = container["startupProbe"], container["livenessProbe"]
        allowed_s = startup["periodSeconds"] * startup["failureThreshold"]
        assert allowed_s >= (120 if role == "router" else 1800)
        assert startup["httpGet"]["path"] == liveness["httpGet"]["path"] == "/livez"
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert liveness["periodSeconds"] * liveness["failureThreshold"] <= 60


def test_gang_scheduling_groups_instances_of_several_pods():
    plan = make_plan("low-affinity", prefill=(2, 2, 1), decode=(1, 1, 2))
    revision, objects = build_all(make_spec(engine={"gangScheduling": {
        "enabled": True, "schedulerName": "coscheduler"}}), plan)
    groups = [o for o in objects if o["kind"] == "PodGroup"]
    assert [(g["apiVersion"], g["spec"]["minMember"]) for g in groups] == [
        ("scheduling.x-k8s.io/v1alpha1", 2)]
    worker_pods = [o for o in objects if o["kind"] == "Pod"]
    members = [p for p in worker_pods if p["metadata"]["labels"].get(gang.POD_GROUP_LABEL)]
    assert {p["metadata"]["labels"][gang.POD_GROUP_LABEL] for p in members} == {groups[0]["metadata"]["name"]}
    assert len(members) == 2 and all(p["metadata"]["labels"]["distserve.io/role"] == "prefill" for p in members)
    assert {p["spec"]["schedulerName"] for p in worker_pods} == {"coscheduler"}
    _, plain = build_all(make_spec(), plan)
    assert not [o for o in plain if o["kind"] == "PodGroup"]
    assert all("schedulerName" not in o["spec"] for o in plain if o["kind"] == "Pod")


class RecordingApi:
    """Just enough of the API client for deleting revisions: lists what it holds."""

    def __init__(self, objects):
        self.objects, self.deleted, self.listed = list(objects), [], []

    async def get(self, kind, namespace, name):
        return None

    async def list(self, kind, namespace, labels):
        self.listed.append(kind)
        return [o for o in self.objects if o["kind"] == kind
                and all(o["metadata"]["labels"].get(k) == v for k, v in labels.items())]

    async def delete(self, kind, namespace, name):
        self.deleted.append((kind, name))
        return 1

    async def create(self, obj):
        return obj

    async def patch(self, *args, **kwargs):
        return {}


@pytest.mark.parametrize("is_gang", [True, False])
def test_an_old_revisions_pod_groups_are_deleted_with_it(is_gang):
    import asyncio

    from distserve.k8s import applying

    spec = make_spec(engine={"gangScheduling": {"enabled": is_gang}})
    revision, objects = build_all(spec, make_plan(prefill=(2, 2, 1)))
    api = RecordingApi(objects)
    asyncio.run(applying.delete_revisions(api, revision.owner, spec, {revision.id}))
    deleted_kinds = {kind for kind, _ in api.deleted}
    assert ("PodGroup" in deleted_kinds) is is_gang
    assert ("PodGroup" in api.listed) is is_gang  # without gang scheduling, no RBAC to list them
    assert {"Pod", "Service", "ConfigMap"} <= deleted_kinds
