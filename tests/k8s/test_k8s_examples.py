"""The DistServeDeployment files a user applies, checked as the API server would (the CRD's
OpenAPI schema) and as the operator does (the spec models)."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from distserve import spec as specs
from distserve.crd import build_crd

ROOT = Path(__file__).resolve().parents[2]
CR_FILES = sorted([*ROOT.glob("examples/*.yaml"), *ROOT.glob("e2e/*.yaml")])
EVERY_OPTION = {
    "model": {"name": "meta-llama/Llama-2-7b-hf", "source": {"huggingFace": {
        "revision": "main", "tokenSecret": {"name": "hf-token"},
        "allowPatterns": ["*.json", "*.safetensors", "tokenizer.model"],
        "cache": {"claimName": "hf-cache"}}}},
    "slo": {"ttftSeconds": 1, "tpotSeconds": 0.1},
    "engine": {
        "resources": {"requests": {"cpu": 8, "memory": "64Gi"}, "limits": {"memory": "128Gi"}},
        "nodeSelector": {"pool": "a100"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm",
                         "effect": "NoSchedule"}],
        "imagePullSecrets": [{"name": "regcred"}],
        "priorityClassName": "inference", "serviceAccountName": "llm",
        "annotations": {"team": "search"}, "labels": {"cost-center": "42"},
        "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
        "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True}],
        "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        "securityContext": {"runAsUser": 2000}, "containerSecurityContext": {"capabilities": {
            "drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}},
        "startupTimeoutSeconds": 3600, "shmSize": "8Gi",
        "prefill": {"priorityClassName": "inference-high"},
        "decode": {"resources": {"requests": {"cpu": 4}}},
        "router": {"nodeSelector": {"pool": "cpu"}, "startupTimeoutSeconds": 120},
        "gangScheduling": {"enabled": True, "schedulerName": "coscheduler",
                           "scheduleTimeoutSeconds": 300},
    },
    "router": {"apiKeySecret": {"name": "llm-api-keys", "key": "keys"}},
    "networkPolicy": {
        "enabled": True,
        "apiFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
                     "podSelector": {"matchExpressions": [
                         {"key": "app", "operator": "In", "values": ["envoy"]}]}},
                    {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.9.0/24"]}}],
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}],
    },
}


def crd_schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def manifest(spec: dict) -> dict:
    return {"apiVersion": "distserve.io/v1alpha1", "kind": "DistServeDeployment",
            "metadata": {"name": "llm"}, "spec": spec}


def crd_errors(doc: dict) -> list[list]:
    """Where the CRD's schema refuses the resource (OpenAPI v3.0 is draft 4 here)."""
    return [list(e.absolute_path) for e in jsonschema.Draft4Validator(crd_schema()).iter_errors(doc)]


@pytest.mark.parametrize("path", CR_FILES, ids=lambda p: p.name)
def test_every_shipped_resource_is_accepted_by_the_crd_and_the_models(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == specs.KIND]
    assert docs, f"{path} holds no {specs.KIND}"
    for doc in docs:
        assert crd_errors(doc) == []
        specs.parse_manifest(doc)


def test_the_cluster_example_names_where_its_weights_come_from():
    doc = yaml.safe_load((ROOT / "examples" / "distserve.yaml").read_text())
    assert specs.parse_manifest(doc).spec.model.source is not None


def test_a_resource_with_every_pod_option_is_accepted():
    doc = manifest(EVERY_OPTION)
    assert crd_errors(doc) == []
    spec = specs.parse_manifest(doc).spec
    engine = spec.engine
    assert engine.options_for("prefill").priority_class_name == "inference-high"
    assert engine.options_for("decode").resources.requests == {"cpu": 4, "memory": "64Gi"}
    assert spec.router.api_key_secret.key == "keys"
    assert spec.network_policy.api_from[1].ip_block.except_ == ["10.20.9.0/24"]


@pytest.mark.parametrize(("peer", "says"), [
    ({}, "set podSelector, namespaceSelector or ipBlock"),
    ({"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}, "ipBlock cannot be combined"),
    ({"ipBlock": {"cidr": "10.0.0.0/33"}}, "cidr"),
    ({"podSelector": {"matchExpressions": [{"key": "app", "operator": "In"}]}}, "values"),
])
def test_a_peer_the_api_server_would_refuse_is_refused_naming_it(peer, says):
    doc = manifest({**EVERY_OPTION, "networkPolicy": {"apiFrom": [peer]}})
    with pytest.raises(specs.SpecError, match="spec.networkPolicy.apiFrom.0") as caught:
        specs.parse_manifest(doc)
    assert says in str(caught.value)


@pytest.mark.parametrize(("where", "value"), [
    (("engine", "startupTimeoutSeconds"), "soon"),
    (("engine", "tolerations"), {"key": "x"}),
    (("engine", "prefill", "nodeSelector"), {"pool": 1}),
    (("engine", "gangScheduling", "enabled"), "maybe"),
    (("model", "source", "huggingFace", "revision"), 7),
    (("router", "apiKeySecret", "name"), "Not_A_Secret"),
    (("networkPolicy", "enabled"), "yes"),
    (("networkPolicy", "enabled"), 1),
    (("networkPolicy", "apiFrom", 0, "podSelector", "matchExpressions", 0, "operator"), "Near"),
    (("networkPolicy", "metricsFrom"), {"namespaceSelector": {}}),
    (("networkPolicy", "apiFrom"), []),
])
def test_the_crd_refuses_a_wrong_type_naming_the_field(where, value):
    doc = manifest(copy.deepcopy(EVERY_OPTION))
    parent = doc["spec"]
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = value
    errors = crd_errors(doc)
    assert errors and all(e[:len(where) + 1] == ["spec", *where] for e in errors)
    with pytest.raises(specs.SpecError):
        specs.parse_manifest(doc)
