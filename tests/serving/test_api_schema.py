"""schemathesis against the router's own OpenAPI document, on a real router over the tiny
model: generated requests, valid and invalid, get no server error and every answer
conforms to the document (status, content type, headers, body); invalid ones are refused.

One check is left out: `positive_data_acceptance` (a request the document allows must
succeed). What depends on the model (a prompt's length against the context, a token id
against the vocabulary, `model` against the served name) cannot be written in the
document, so a document-valid request may rightly get a 400 or 404 that names why.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.errors import Unsatisfiable
from serving_helpers import ServerThread, make_settings

schemathesis = pytest.importorskip("schemathesis")
checks = schemathesis.checks

MAX_EXAMPLES = 25  # per operation and generation mode; a bound, so the test stays short


@pytest.fixture(scope="module")
def router_url(tiny_llama):
    from distserve_engine.server import assembly

    # Generated prompts may be long and max_tokens large: a short context keeps them quick.
    settings_doc = make_settings(tiny_llama, max_waiting_requests=64,
                                 max_request_body_bytes=256 * 1024)
    router, instances, runner = assembly.build_in_process(settings_doc)
    app = assembly.build_frontend_app(settings_doc, router, runner.tokenizer, 128)
    with ServerThread(app) as server:
        yield server.url
    for instance in instances:
        instance.stop()


def operations(url: str) -> list:
    """The document's operations, loaded from the running router."""
    loaded = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in loaded.get_all_operations()]


def fuzz(operation, generation_mode, url: str, failures: list[str]) -> None:
    """MAX_EXAMPLES generated requests of one operation, each response checked."""
    from hypothesis import given

    @given(case=operation.as_strategy(generation_mode=generation_mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        try:
            case.call_and_validate(base_url=url, timeout=120,
                                   excluded_checks=[checks.positive_data_acceptance])
        except AssertionError as exc:  # schemathesis' failure groups are AssertionErrors
            failures.append(f"{operation.label}: {str(exc)[:800]}")
            raise

    try:
        check()
    except Unsatisfiable:  # negative mode: nothing in this operation can be made invalid
        assert generation_mode.value == "negative"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_router_conforms_to_its_openapi_document(router_url, mode):
    generation_mode = schemathesis.GenerationMode(mode)
    failures: list[str] = []
    ops = operations(router_url)
    assert {op.label for op in ops} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                        "GET /health", "GET /metrics"}
    for operation in ops:
        try:
            fuzz(operation, generation_mode, router_url, failures)
        except AssertionError:
            pass  # recorded; the other operations still run
    assert not failures, "\n\n".join(failures)
    if mode == "positive":  # some generated requests reached the model and were served
        timelines = httpx.get(f"{router_url}/debug/timelines").json()
        assert any(t["finish_reason"] in ("stop", "length") for t in timelines)
