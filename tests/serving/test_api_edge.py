"""The API's edge as a client meets it: huge bodies, keys, unknown paths, refused fields,
and an OpenAPI document that says what the server does."""

from __future__ import annotations

import threading

import httpx
import pytest
from fake_instances import GatedClient, WordTokenizer
from serving_helpers import ServerThread, make_settings, wait_until

from distserve_engine.router import Router
from distserve_engine.server.openai_app import Frontend, build_openai_app

KEY = "sk-test-0123456789"


def fake_app(**kwargs):
    router = Router([GatedClient("p0", "prefill")], [GatedClient("d0", "decode")])
    return build_openai_app(Frontend(router, WordTokenizer(), "fake", 512), None, **kwargs)


@pytest.fixture
def fake_server():
    with ServerThread(fake_app(max_body_bytes=4096)) as server:
        yield server.url


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_health_answers_while_a_huge_prompt_is_tokenized(tiny_llama):
    from distserve_engine.server import assembly

    settings = make_settings(tiny_llama, max_request_body_bytes=32 * 1024 * 1024)
    router, instances, runner = assembly.build_in_process(settings)
    app = assembly.build_frontend_app(settings, router, runner.tokenizer, runner.max_model_len)
    frontend = app.state.frontend
    huge = {"prompt": "the quick brown fox jumps over the lazy dog " * 60_000}  # 2.6 MB
    result: dict[str, httpx.Response] = {}
    try:
        with ServerThread(app) as server:
            sender = threading.Thread(target=lambda: result.update(
                r=httpx.post(f"{server.url}/v1/completions", json=huge, timeout=600)))
            sender.start()
            assert wait_until(lambda: frontend.num_preparing == 1, timeout_s=60)
            health = httpx.get(f"{server.url}/health", timeout=30)
            # Answered while the prompt was still being tokenized: the loop was free.
            assert health.status_code == 200 and frontend.num_preparing == 1
            small = httpx.post(f"{server.url}/v1/completions", timeout=60,
                               json={"prompt": "hello", "max_tokens": 2, "ignore_eos": True})
            assert small.status_code == 200 and frontend.num_preparing == 1
            sender.join(600)
    finally:
        for instance in instances:
            instance.stop()
    assert_openai_error(result["r"], 400, "prompt")  # too long for the context, said so


def test_body_over_the_limit_is_413_before_or_while_read(fake_server):
    big = b'{"prompt": "' + b"x" * 8000 + b'"}'
    r = httpx.post(f"{fake_server}/v1/completions", content=big,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "body")

    def chunks():
        yield big[:3000]
        yield big[3000:]

    r = httpx.post(f"{fake_server}/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "body")
    ok = httpx.post(f"{fake_server}/v1/completions", json={"prompt": "x y", "max_tokens": 2})
    assert ok.status_code == 200


def test_api_keys_guard_v1_and_debug_only():
    with ServerThread(fake_app(api_keys=[KEY, "sk-second"])) as server:
        url = server.url
        body = {"prompt": "a b", "max_tokens": 2}
        error = assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 401)
        assert error["code"] == "invalid_api_key"
        wrong = httpx.post(f"{url}/v1/completions", json=body,
                           headers={"Authorization": "Bearer sk-wrong"})
        assert KEY not in assert_openai_error(wrong, 401)["message"]
        assert httpx.get(f"{url}/debug/timelines").status_code == 401
        for key in (KEY, "sk-second"):
            r = httpx.post(f"{url}/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        for path in ("/health", "/livez", "/metrics"):
            assert httpx.get(f"{url}{path}").status_code == 200, path


def test_unknown_path_wrong_method_and_bad_bytes_answer_in_openai_format(fake_server):
    assert_openai_error(httpx.get(f"{fake_server}/v1/nothing"), 404)
    r = httpx.get(f"{fake_server}/v1/completions")
    assert_openai_error(r, 405)
    assert "POST" in r.headers["allow"]
    r = httpx.post(f"{fake_server}/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                   headers={"content-type": "application/json"})
    assert "UTF-8" in assert_openai_error(r, 400, "body")["message"]
    assert_openai_error(httpx.get(f"{fake_server}/debug/timelines?limit=-1"), 400, "limit")


@pytest.mark.parametrize(("extra", "param"), [
    ({"best_of": 3}, "best_of"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"logprobs": 2}, "logprobs"),
    ({"prompt": 5}, "prompt"),  # not `prompt.str`
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_refused_fields_are_named(fake_server, extra, param):
    r = httpx.post(f"{fake_server}/v1/completions", json={"prompt": "x", **extra})
    assert_openai_error(r, 400, param)


def test_no_op_values_of_unsupported_fields_are_accepted(fake_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "best_of": 1, "tools": [],
            "response_format": {"type": "text"}, "frequency_penalty": 0.5}
    assert httpx.post(f"{fake_server}/v1/chat/completions", json=body).status_code == 200
    bad_role = {"messages": [{"role": "robot", "content": "hi"}]}
    assert_openai_error(httpx.post(f"{fake_server}/v1/chat/completions", json=bad_role), 400,
                        "messages.0.role")


def test_openapi_document_says_400_and_text_metrics(fake_server):
    doc = httpx.get(f"{fake_server}/openapi.json").json()
    statuses = {s for ops in doc["paths"].values() for op in ops.values() for s in op["responses"]}
    assert "422" not in statuses and {"400", "401", "413", "429", "503"} <= statuses
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/CompletionRequest")
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["required"]
