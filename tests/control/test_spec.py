"""The DistServeDeployment spec: what a user may write, what is refused, and the CRD."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from distserve.crd import build_crd
from distserve.spec import SpecError, load_manifest, parse_manifest, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "distservedeployments.distserve.io.yaml"


def make_manifest(**spec_overrides) -> dict:
    """A small valid manifest; keyword arguments replace parts of its spec."""
    spec = {
        "model": {"name": "facebook/opt-13b"},
        "slo": {"ttftSeconds": 0.25, "tpotSeconds": 0.1},
        "cluster": {"nodes": 1, "gpusPerNode": 8, "accelerator": "A100-80GB"},
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": "distserve.io/v1alpha1",
        "kind": "DistServeDeployment",
        "metadata": {"name": "opt-13b-chat"},
        "spec": spec,
    }


def crd_schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def validate_against_crd(doc: dict, schema: dict) -> None:
    """Check a resource as the API server would (OpenAPI v3.0 is JSON Schema draft 4 here)."""
    jsonschema.Draft4Validator(schema).validate(doc)


def test_defaults_fill_what_the_user_left_out():
    doc = parse_manifest(make_manifest())
    assert doc.spec.slo.attainment == 0.9
    assert doc.spec.slo.rule == "both"
    assert doc.spec.workload.dataset == "chatbot"
    assert doc.spec.cluster.node_affinity == "low"
    assert doc.spec.auto_apply is True
    assert doc.spec.placement is None
    assert doc.spec.router.admit_by_ttft is False  # the router refuses only past its bounds
    assert parse_manifest(make_manifest(router={"admitByTtft": True})).spec.router.admit_by_ttft


@pytest.mark.parametrize(
    ("overrides", "field", "expected"),
    [
        ({"slo": {"ttftSeconds": -1, "tpotSeconds": 0.1}}, "spec.slo.ttftSeconds", "greater than 0"),
        ({"slo": {"ttftSeconds": 1, "tpotSeconds": 0.1, "attainment": 1.5}}, "spec.slo.attainment", "less than or equal to 1"),
        ({"cluster": {"nodeAffinity": "medium"}}, "spec.cluster.nodeAffinity", "'low' or 'high'"),
        ({"placement": {"prefill": {"tp": 0}, "decode": {}}}, "spec.placement.prefill.tp", "greater than or equal to 1"),
        ({"slo": {"ttftSeconds": 1, "tpotSeconds": 0.1, "ttft": 2}}, "spec.slo.ttft", "Extra inputs"),
        ({"workload": {"arrival": "trace"}}, "spec.workload", "tracePath"),
        ({"router": {"admitByTtft": "sometimes"}}, "spec.router.admitByTtft", "valid boolean"),
    ],
)
def test_bad_values_name_the_field_and_what_was_expected(overrides, field, expected):
    with pytest.raises(SpecError) as err:
        parse_manifest(make_manifest(**overrides))
    assert field in str(err.value)
    assert expected in str(err.value)


def test_missing_slo_is_named():
    doc = make_manifest()
    del doc["spec"]["slo"]
    with pytest.raises(SpecError, match=r"spec\.slo: Field required"):
        parse_manifest(doc)


def test_operator_view_of_spec_uses_same_rules():
    with pytest.raises(SpecError, match=r"spec\.slo\.tpotSeconds"):
        parse_spec({"model": {"name": "x"}, "slo": {"ttftSeconds": 1, "tpotSeconds": "fast"}})


def test_load_manifest_reads_the_yaml_a_user_applies(tmp_path):
    path = tmp_path / "distserve.yaml"
    other = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "llm"}}
    path.write_text(yaml.safe_dump_all([other, make_manifest()]))
    assert load_manifest(path).metadata.name == "opt-13b-chat"


def test_load_manifest_errors_name_the_file(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_manifest(tmp_path / "missing.yaml")
    path = tmp_path / "bad.yaml"
    path.write_text("kind: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_manifest(path)


def test_crd_file_is_generated_from_the_models():
    on_disk = yaml.safe_load(CRD_FILE.read_text())
    assert on_disk == build_crd(), "crds/ drifted from spec.py: run python scripts/gen_crds.py"


def test_crd_schema_accepts_valid_and_refuses_invalid_resources():
    schema = crd_schema()
    validate_against_crd(make_manifest(), schema)
    bad = make_manifest(slo={"ttftSeconds": "soon", "tpotSeconds": 0.1})
    with pytest.raises(jsonschema.ValidationError, match="soon"):
        validate_against_crd(bad, schema)
    bad = make_manifest(cluster={"nodeAffinity": "medium"})
    with pytest.raises(jsonschema.ValidationError, match="medium"):
        validate_against_crd(bad, schema)


def test_crd_schema_is_structural_and_documented():
    def walk(node: dict, path: str):
        assert "$ref" not in node and "anyOf" not in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        for name, sub in node.get("properties", {}).items():
            if path.startswith("spec"):
                assert sub.get("description"), f"{path}.{name} has no description"
            walk(sub, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], path + "[]")

    walk(crd_schema()["properties"]["spec"], "spec")


def test_every_example_is_a_valid_resource():
    schema = crd_schema()
    checked = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "DistServeDeployment":
                parse_manifest(copy.deepcopy(doc))
                validate_against_crd(doc, schema)
                checked.append(path.name)
    # The README's examples: the local default, the cluster example and the paper's settings.
    assert {"local.yaml", "distserve.yaml", "opt-13b-chatbot.yaml", "opt-66b-chatbot.yaml",
            "opt-66b-code.yaml", "opt-66b-summarization.yaml", "opt-175b-chatbot.yaml"} <= set(checked)


def test_relative_file_paths_are_read_from_the_spec_folder(tmp_path, monkeypatch):
    folder = tmp_path / "specs"
    folder.mkdir()
    doc = make_manifest(
        workload={"tracePath": "trace.jsonl", "arrival": "trace"},
        planner={"profilePath": "profiles/cpu.json"},
    )
    (folder / "spec.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)
    spec = load_manifest("specs/spec.yaml").spec
    assert Path(spec.workload.trace_path) == folder / "trace.jsonl"
    assert Path(spec.planner.profile_path) == folder / "profiles" / "cpu.json"
