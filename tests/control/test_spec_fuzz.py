"""Spec parsing and the CRD schema under generated input (hypothesis): any document gets
a parsed spec or one SpecError naming fields, never a crash; what the parser accepts the
CRD accepts too (so `distserve up` takes no file the cluster would refuse)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distserve.crd import build_crd
from distserve.spec import SpecError, parse_manifest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
CRD_VALIDATOR = jsonschema.Draft4Validator(
    build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
ERROR_LINE = re.compile(r"^[\w-]+(\.[\w-]+)*: .+")  # `spec.slo.ttftSeconds: ...`
# NOTE: keys are names; a key that is empty or all punctuation gets an error line with an
# empty path (spec.py's formatting), which these tests leave aside.
KEYS = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,9}", fullmatch=True)
JSON_SCALARS = (st.none() | st.booleans() | st.integers(-10**9, 10**9)
                | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(KEYS, inner, max_size=3), max_leaves=6)


def manifests() -> list[dict]:
    """The shipped examples that are DistServeDeployments."""
    docs = []
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "DistServeDeployment":
                docs.append(doc)
    return docs


SEEDS = manifests()


def paths(doc, prefix=()) -> list[tuple]:
    """Every key path of a nested document."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += paths(value, (*prefix, key))
    return out


@st.composite
def mutated_manifests(draw) -> dict:
    """An example manifest with a few values replaced, dropped or added."""
    doc = copy.deepcopy(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths(doc)))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "drop", "add"]))
        if action == "drop":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(KEYS)] = draw(JSON_VALUES)
        else:
            parent[path[-1]] = draw(JSON_VALUES)
        if not paths(doc):
            break
    return doc


def without_nulls(doc):
    """The document as the API server validates it: a null field is pruned first unless
    its schema says `nullable`; pruning those too changes no verdict, as a null and an
    absent optional field are both valid."""
    if isinstance(doc, dict):
        return {k: without_nulls(v) for k, v in doc.items() if v is not None}
    if isinstance(doc, list):
        return [without_nulls(v) for v in doc]
    return doc


def test_seeds_are_the_examples():
    assert len(SEEDS) >= 5 and all(parse_manifest(copy.deepcopy(d)) for d in SEEDS)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(doc=mutated_manifests())
def test_any_document_parses_or_names_its_fields(doc):
    try:
        parsed = parse_manifest(copy.deepcopy(doc))
    except SpecError as exc:
        lines = str(exc).splitlines()
        assert lines and all(ERROR_LINE.match(line) for line in lines), str(exc)
        return
    # what parses is whole: written back out as the cluster would store it, it parses the same
    assert parse_manifest(parsed.model_dump(mode="json", by_alias=True)) == parsed


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(doc=mutated_manifests())
def test_what_the_parser_accepts_the_crd_accepts(doc):
    try:
        parse_manifest(copy.deepcopy(doc))
    except SpecError:
        return
    errors = sorted(CRD_VALIDATOR.iter_errors(without_nulls(doc)), key=str)
    assert not errors, f"parsed, yet the CRD refuses: {errors[0].message} at {list(errors[0].path)}"


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(doc=JSON_VALUES)
def test_a_document_that_is_no_manifest_is_a_spec_error(doc):
    try:
        parse_manifest(doc)
    except SpecError:
        return
    raise AssertionError(f"accepted {doc!r}")
