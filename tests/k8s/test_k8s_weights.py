"""Model weights on Kubernetes: each source becomes a read-only mount at the path the
engine's settings name; a download runs first; pods still loading show in a summary."""

from __future__ import annotations

import json

import pytest
from k8s_factories import NODES, make_owner, make_revision, make_spec

from distserve.k8s import health, router, weights, workers
from distserve.spec import SpecError

KNOWN = set(NODES)


def _worker(spec, role="prefill"):
    revision = make_revision(spec=spec)
    objects = workers.build_revision_objects(revision, KNOWN)
    pod = next(o for o in objects if o["kind"] == "Pod" and o["metadata"]["labels"]["distserve.io/role"] == role)
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    return pod, json.loads(config_map["data"]["serve.json"])["engine"]["model"]


def _router(spec):
    owner = make_owner()
    config = router.build_router_config(owner, spec, [])
    template = router.build_router_deployment_spec(owner, spec, config)["spec"]["template"]
    settings = json.loads(router.build_router_config_map_spec(owner, spec, config)["data"]["serve.json"])
    return template, settings["engine"]["model"]


def _mount_of(container, path):
    """The mount that holds `path` (the longest mountPath prefix)."""
    mounts = [m for m in container["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
    return max(mounts, key=lambda m: len(m["mountPath"]))


@pytest.mark.parametrize(("source", "volume", "model_path"), [
    ({"persistentVolumeClaim": {"claimName": "models", "subPath": "opt-13b"}},
     {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}, "/models/opt-13b"),
    ({"hostPath": {"path": "/mnt/weights/opt-13b"}},
     {"hostPath": {"path": "/mnt/weights/opt-13b"}}, "/models/opt-13b"),
    ({"huggingFace": {"revision": "refs/pr/7"}},
     {"emptyDir": {}}, "/models/hf/facebook--opt-13b/refs--pr--7"),
])
def test_a_volume_source_is_mounted_read_only_where_the_settings_point(source, volume, model_path):
    spec = make_spec(model={"name": "facebook/opt-13b", "source": source})
    worker_pod, worker_path = _worker(spec)
    template, router_path = _router(spec)
    for pod_spec, path in ((worker_pod["spec"], worker_path), (template["spec"], router_path)):
        assert path == model_path
        assert {"name": "weights", **volume} in pod_spec["volumes"]
        mount = _mount_of(pod_spec["containers"][0], path)
        assert mount["name"] == "weights" and mount["readOnly"] is True
    pod, _ = _worker(spec)
    mount = _mount_of(pod["spec"]["containers"][0], model_path)
    assert mount.get("subPath") == source.get("persistentVolumeClaim", {}).get("subPath")


def test_weights_in_the_image_need_no_volume_and_no_source_keeps_the_old_paths():
    spec = make_spec(model={"name": "facebook/opt-13b", "source": {"image": {"path": "/opt/weights"}}})
    pod, path = _worker(spec)
    assert path == "/opt/weights"
    assert "weights" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert _worker(make_spec())[1] == "/models/opt-13b"
    assert _worker(make_spec(model={"name": "HuggingFaceTB/SmolLM2-135M-Instruct"}))[1] == "/models/smollm2"


def test_a_hugging_face_download_runs_first_with_the_token_from_a_secret():
    spec = make_spec(model={"name": "facebook/opt-13b", "source": {"huggingFace": {
        "repo": "org/opt-13b-safetensors", "tokenSecret": {"name": "hf", "key": "hf_token"},
        "cache": {"claimName": "hf-cache"}}}})
    pod, path = _worker(spec)
    (init,) = pod["spec"]["initContainers"]
    assert init["command"] == ["python", "-m", "distserve_engine.download"]
    args = init["args"]
    assert args[:6] == ["--repo", "org/opt-13b-safetensors", "--revision", "main", "--dir", path]
    assert "*.safetensors" in args[args.index("--allow"):]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "hf_token"}}
    assert {"name": "weights", "mountPath": "/models/hf"} in init["volumeMounts"]  # writable
    assert {"name": "weights", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["spec"]["volumes"]
    template, _ = _router(spec)
    router_args = template["spec"]["initContainers"][0]["args"]
    assert "*.safetensors" not in router_args and "*.json" in router_args  # tokenizer only


@pytest.mark.parametrize(("model", "message"), [
    ({"name": "m", "source": {"image": {"path": "/w"}, "hostPath": {"path": "/w"}}},
     "spec.model.source: Value error, expected exactly one of persistentVolumeClaim, hostPath, huggingFace, image; got 2"),
    ({"name": "m", "source": {"persistentVolumeClaim": {"claimName": "m", "subPath": "../etc"}}},
     "spec.model.source.persistentVolumeClaim.subPath: Value error, subPath: expected a path inside the volume"),
    ({"name": "m", "source": {"hostPath": {"path": "relative"}}},
     "spec.model.source.hostPath.path: String should match pattern '^/'"),
    ({"name": "m", "source": {"huggingFace": {"cache": {"sizeLimit": "lots"}}}},
     "spec.model.source.huggingFace.cache.sizeLimit: Value error, cache.sizeLimit: expected a quantity"),
])
def test_a_bad_model_source_is_refused_naming_the_field(model, message):
    with pytest.raises(SpecError) as err:
        make_spec(model=model)
    assert message in str(err.value)


@pytest.mark.parametrize(("engine", "message"), [
    ({"resources": {"requests": {"nvidia.com/gpu": 1}}},
     "spec.engine.resources.requests: Value error, requests: nvidia.com/gpu comes from the plan"),
    ({"resources": {"requests": {"cpu": "two"}}},
     "requests.cpu: expected a quantity such as 2, 500m or 16Gi, got 'two'"),
    ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, "the name 'dshm' is the operator's"),
    ({"decode": {"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}},
     "spec.engine: Value error, volumeMounts: 'nope' names no volume of the pod"),
    ({"volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}, "/tmp is mounted by the operator"),
    ({"labels": {"distserve.io/role": "x"}}, "keys under distserve.io/ belong to the operator"),
    ({"tolerations": [{"operator": "Maybe"}]}, "spec.engine.tolerations.0.operator: Input should be 'Exists' or 'Equal'"),
    ({"router": {"startupTimeoutSeconds": 5}}, "spec.engine.router.startupTimeoutSeconds: Input should be greater than or equal to 30"),
    ({"shmSize": "big"}, "spec.engine.shmSize: Value error, expected a size such as 4Gi"),
    ({"prefill": {"resource": {}}}, "spec.engine.prefill.resource: Extra inputs are not permitted"),
])
def test_bad_pod_options_are_refused_naming_the_field(engine, message):
    with pytest.raises(SpecError) as err:
        make_spec(engine=engine)
    assert message in str(err.value)


def _pod_status(phase, init=None, main=None):
    status = {"phase": phase}
    if init is not None:
        status["initContainerStatuses"] = [{"name": "fetch-weights", "state": init}]
    if main is not None:
        status["containerStatuses"] = [{"name": "engine", **main}]
    return {"metadata": {"name": "p"}, "status": status}


def test_the_summary_counts_pods_downloading_and_loading_weights():
    pods = [
        _pod_status("Pending", init={"running": {}}),
        _pod_status("Running", init={"terminated": {"exitCode": 0}},
                    main={"state": {"running": {}}, "started": False}),
        _pod_status("Running", main={"state": {"running": {}}, "started": False}),
        _pod_status("Running", main={"state": {"running": {}}, "started": True}),  # serving
        _pod_status("Pending"),  # not scheduled yet: not loading
    ]
    assert weights.loading_summary(pods) == "1 downloading weights, 2 loading weights"
    assert weights.loading_summary(pods[3:]) == ""


def test_the_monitor_report_says_weights_are_loading_or_their_download_fails():
    pods = [_pod_status("Pending", init={"running": {}}),
            _pod_status("Running", main={"state": {"running": {}}, "started": False})]
    report = health.assess(pods, expected=2, router=None)
    assert report.summary == ("0/2 worker pods Ready, router 0/1 Ready "
                              "(1 downloading weights, 1 loading weights)")
    assert report.problems == ()
    failing = _pod_status("Pending", init={"waiting": {"reason": "CrashLoopBackOff"}})
    assert health.assess([failing], expected=1, router=None).problems == (
        "pod p init container fetch-weights CrashLoopBackOff",)
