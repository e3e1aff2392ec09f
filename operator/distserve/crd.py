"""The CustomResourceDefinition of DistServeDeployment, derived from `distserve.spec`.

Kubernetes wants a structural OpenAPI v3 schema: no `$ref`, no `anyOf` with null, a
`type` on every node, booleans for `exclusiveMinimum`. Pydantic emits JSON Schema
2020-12, so this module rewrites one into the other. `scripts/gen_crds.py` writes the
result to `crds/`, and a test fails when the file and the models drift apart.
"""

from __future__ import annotations

from typing import Any

from distserve import spec

# Keys of JSON Schema that survive into the CRD as they are.
_KEPT = (
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "required",
    "minItems",
)

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "What the operator decided and observed.",
    "properties": {
        "phase": {
            "type": "string",
            "description": "Pending, Planning, AwaitingApproval, Applying, Ready or Degraded.",
        },
        "message": {"type": "string", "description": "Why the resource is in this phase."},
        "observedGeneration": {
            "type": "integer",
            "description": "The spec generation the status describes.",
        },
        "planId": {"type": "string", "description": "Id of the current plan."},
        "appliedPlanId": {"type": "string", "description": "Id of the plan the pods run."},
        "prefillInstances": {"type": "integer", "description": "Prefill instances planned."},
        "decodeInstances": {"type": "integer", "description": "Decode instances planned."},
        "predictedGoodputRps": {
            "type": "number",
            "description": "Predicted goodput of the plan in requests per second.",
        },
        "plan": {
            "type": "object",
            "description": "The plan document: parallelism, node assignment, predictions.",
            "x-kubernetes-preserve-unknown-fields": True,
        },
        "conditions": {
            "type": "array",
            "description": "Planned, Applied, Ready and Degraded conditions.",
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                },
            },
        },
    },
    "x-kubernetes-preserve-unknown-fields": True,
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefillInstances"},
    {"name": "Decode", "type": "integer", "jsonPath": ".status.decodeInstances"},
    {
        "name": "Goodput",
        "type": "number",
        "jsonPath": ".status.predictedGoodputRps",
        "description": "Predicted goodput (requests/s)",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline a `$ref`, keeping the referring node's own description and default."""
    if "$ref" not in node:
        return node
    target = defs[node["$ref"].split("/")[-1]]
    return {**target, **{k: v for k, v in node.items() if k != "$ref"}}


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one JSON Schema node into a structural OpenAPI v3 node."""
    node = _resolve(node, defs)
    nullable = False
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(node["anyOf"])
        if len(options) != 1:
            raise ValueError(f"cannot express a union in a CRD schema: {node}")
        inner = _resolve(options[0], defs)
        node = {**inner, **{k: v for k, v in node.items() if k != "anyOf"}}
    out = {k: node[k] for k in _KEPT if k in node}
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in node:
        out.update(minimum=node["exclusiveMinimum"], exclusiveMinimum=True)
    if "exclusiveMaximum" in node:
        out.update(maximum=node["exclusiveMaximum"], exclusiveMaximum=True)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("default") is None:
        out.pop("default", None)
    if node.get("type") == "object" or "properties" in node:
        out["type"] = "object"
        if "properties" in node:
            out["properties"] = {
                name: _structural(sub, defs) for name, sub in node["properties"].items()
            }
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra.get("type") in ("string", "integer", "number"):
            out["additionalProperties"] = {"type": extra["type"]}
        elif "properties" not in node:
            out["x-kubernetes-preserve-unknown-fields"] = True
    if node.get("type") == "array":
        out["items"] = _structural(node.get("items", {"type": "object"}), defs)
    if "type" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if nullable:
        out["nullable"] = True
    return out


def spec_schema() -> dict[str, Any]:
    """The structural schema of `.spec`, from the pydantic models."""
    raw = spec.DistServeDeploymentSpec.model_json_schema(by_alias=True)
    body = _structural(raw, raw.get("$defs", {}))
    body["description"] = (
        "A model served with prefill and decode on separate GPU instances, placed to "
        "maximise goodput within the TTFT and TPOT SLOs."
    )
    return body


def build_crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{spec.PLURAL}.{spec.API_GROUP}"},
        "spec": {
            "group": spec.API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": spec.KIND,
                "listKind": f"{spec.KIND}List",
                "plural": spec.PLURAL,
                "singular": spec.KIND.lower(),
                "shortNames": ["dsd"],
                "categories": ["all", "distserve"],
            },
            "versions": [
                {
                    "name": spec.API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "DistServeDeployment serves an LLM with "
                            "disaggregated prefill and decode.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": STATUS_SCHEMA,
                            },
                        }
                    },
                }
            ],
        },
    }
