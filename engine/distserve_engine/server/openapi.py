"""The router's OpenAPI document: what each path takes and every answer it can give.

FastAPI would derive a document from the endpoint signatures, but the endpoints read raw
bytes (parsing runs off the event loop) and every error is OpenAI's, never FastAPI's 422;
so the request bodies, the error responses (400, 401, 404, 405, 413, 429 with
`Retry-After`, 503) and the text of `/metrics` are written here, from the same pydantic
models the server validates with. A test runs schemathesis against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from distserve_engine.server.protocol import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}
_CHOICES = {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"],
                                       "properties": {"index": {"type": "integer"}}}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0}
                         for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
COMPLETION_SCHEMA = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                   "created": {"type": "integer"}, "model": {"type": "string"},
                   "choices": _CHOICES, "usage": _USAGE},
}
_ERROR_DESCRIPTIONS = {
    400: "Bad input; `param` names the field.",
    401: "Missing or wrong API key (when the router has keys).",
    404: "Another model, or no such path.",
    405: "Method not allowed on this path.",
    413: "Request body over the router's limit.",
    429: "Overloaded: too many requests waiting or in flight, or the queue ahead cannot "
         "meet the TTFT SLO.",
    503: "No healthy instance of a phase, or an instance failed the request.",
}
GENERATION_ERRORS = (400, 401, 404, 405, 413, 429, 503)


def _error(status: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"description": _ERROR_DESCRIPTIONS[status],
                           "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    if status == 429:
        doc["headers"] = {"Retry-After": {"required": True, "description": "Seconds to wait.",
                                          "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
    return doc


def _generation(model: type, schemas: dict[str, Any]) -> dict[str, Any]:
    """requestBody and responses of a POST that generates."""
    doc = model.model_json_schema(ref_template=REF)
    schemas.update(doc.pop("$defs", {}))
    schemas[model.__name__] = doc
    ok = {"description": "The completion (JSON), or server-sent events when `stream` is true.",
          "content": {"application/json": {"schema": COMPLETION_SCHEMA},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": REF.format(model=model.__name__)}}}},
        "responses": {"200": ok, **{str(s): _error(s) for s in GENERATION_ERRORS}},
    }


def _other_responses(path: str) -> dict[str, Any]:
    """Responses of the GET paths."""
    errors = {str(s): _error(s) for s in (401, 405) if path.startswith(("/v1/", "/debug/"))}
    if path == "/metrics":
        ok = {"description": "Prometheus text exposition.",
              "content": {"text/plain": {"schema": {"type": "string"}}}}
        return {"200": ok, "405": _error(405)}
    if path == "/health":
        errors["503"] = _error(503)
    if path == "/debug/timelines":
        errors["400"] = _error(400)
    ok = {"description": "OK", "content": {"application/json": {"schema": {}}}}
    return {"200": ok, "405": _error(405), **errors}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The document served at /openapi.json (built once)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas: dict[str, Any] = {}
    bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            if method == "post" and path in bodies:
                op.update(_generation(bodies[path], schemas))
            else:
                op["responses"] = _other_responses(path)
    doc.setdefault("components", {})["schemas"] = schemas
    app.openapi_schema = doc
    return doc
