"""The Helm chart rendered and linted with the Helm library, every manifest validated
offline against the Kubernetes schemas; the CRD, its chart copy and the resources."""

from __future__ import annotations

import copy
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_factories import make_plan, make_revision

from distserve import spec as specs
from distserve.k8s import router, workers

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "distserve"
CRD_FILE = "distservedeployments.distserve.io.yaml"
KUBE_VERSION = "1.30.0"


def render(values: dict | None = None) -> list[dict]:
    """Every document the chart renders (NOTES.txt aside)."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="distserve", namespace="distserve-system",
                                is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def crd_schema() -> dict:
    """The openAPIV3Schema of the DistServeDeployment CRD."""
    crd = yaml.safe_load((ROOT / "crds" / CRD_FILE).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_chart_lints_clean():
    report = helm.lint(CHART, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(("values", "expected"), [
    (None, ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]),
    ({"watchNamespaces": ["serving", "research"], "operator": {"verbose": True, "drainSeconds": 5}},
     ["ClusterRole", "ClusterRoleBinding", "Deployment", "Role", "Role", "RoleBinding",
      "RoleBinding", "ServiceAccount"]),
    ({"watchNamespaces": ["serving"], "rbac": {"readNodes": False, "gangScheduling": True}},
     ["Deployment", "Role", "RoleBinding", "ServiceAccount"]),
    ({"serviceAccount": {"create": False, "name": "existing"}, "nodeSelector": {"pool": "cpu"}},
     ["ClusterRole", "ClusterRoleBinding", "Deployment"]),
    ({"networkPolicy": {"enabled": False}},
     ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]),
    ({"networkPolicy": {"apiFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "metricsFrom": []}},
     ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]),
])
def test_every_rendered_manifest_is_valid_kubernetes(values, expected):
    docs = render(values)
    assert sorted(d["kind"] for d in docs) == expected
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_watched_namespaces_become_operator_arguments():
    deployment = next(d for d in render({"watchNamespaces": ["serving"]}) if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["distserve", "operator"]
    assert "--namespace=serving" in container["args"]
    assert deployment["spec"]["replicas"] == 1


def test_values_schema_refuses_bad_values():
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.values)
        for bad in ({"image": {"repository": "x", "pullPolicy": "Sometimes"}},
                    {"operator": {"drainSeconds": -1}},
                    {"watchNamespaces": ["Not_A_Namespace"]},
                    {"replicas": 3},
                    {"networkPolicy": {"enabled": "yes"}},
                    {"networkPolicy": {"metricsFrom": [{"podSelecter": {}}]}},
                    {"networkPolicy": {"apiFrom": [{}]}},
                    {"networkPolicy": {"apiFrom": [{"ipBlock": {"except": ["10.0.0.0/8"]}}]}}):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)


def test_rbac_is_least_privilege_and_covers_what_the_operator_does():
    role = next(d for d in render() if d["kind"] == "ClusterRole")
    granted = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    writes = {"create", "patch", "delete"}
    for group, resource in (("", "pods"), ("", "services"), ("", "configmaps"), ("apps", "deployments")):
        assert writes <= granted[(group, resource)]
    assert granted[("", "nodes")] == {"list"}
    assert {"patch"} <= granted[("distserve.io", "distservedeployments/status")]
    assert "delete" not in granted[("distserve.io", "distservedeployments")]
    assert ("", "secrets") not in granted


def test_chart_crd_is_a_copy_of_crds_and_valid():
    chart_copy = (CHART / "crds" / CRD_FILE).read_text()
    assert chart_copy == (ROOT / "crds" / CRD_FILE).read_text(), \
        "run: python scripts/sync_chart_crds.py"
    kubernetes_validate.validate(yaml.safe_load(chart_copy), KUBE_VERSION, strict=True)


def test_example_is_accepted_by_the_crd_schema_and_the_models():
    doc = yaml.safe_load((ROOT / "examples" / "distserve.yaml").read_text())
    jsonschema.Draft4Validator(crd_schema()).validate(doc)
    assert specs.parse_manifest(doc).spec.model.name == "facebook/opt-13b"


def test_crd_schema_refuses_a_bad_resource_naming_the_field():
    doc = yaml.safe_load((ROOT / "examples" / "distserve.yaml").read_text())
    bad = copy.deepcopy(doc)
    bad["spec"]["slo"]["ttftSeconds"] = "fast"
    errors = list(jsonschema.Draft4Validator(crd_schema()).iter_errors(bad))
    assert [list(e.absolute_path) for e in errors] == [["spec", "slo", "ttftSeconds"]]
    missing = copy.deepcopy(doc)
    del missing["spec"]["model"]
    assert list(jsonschema.Draft4Validator(crd_schema()).iter_errors(missing))


def test_built_objects_are_valid_kubernetes():
    revision = make_revision(make_plan("low-affinity", prefill=(2, 2, 1), decode=(1, 2, 1)))
    owner, spec = revision.owner, revision.spec
    config = router.build_router_config(owner, spec, workers.instance_endpoints(revision))
    objects = workers.build_revision_objects(revision, {"gpu-node-a", "gpu-node-b"}) + [
        router.build_router_deployment_spec(owner, spec, config),
        router.build_router_service_spec(owner, spec),
        router.build_router_config_map_spec(owner, spec, config),
    ]
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
