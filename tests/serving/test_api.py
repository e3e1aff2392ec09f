"""The OpenAI API as a client sees it: streaming, usage, errors, disconnects, metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from serving_helpers import ServerThread, make_settings, wait_until


def sse_docs(text: str) -> list:
    """The data payloads of an SSE body."""
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_completion_has_text_and_usage(deployment):
    url, _ = deployment
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello world", "max_tokens": 5,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    doc = r.json()
    assert doc["object"] == "text_completion"
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == 5
    assert doc["usage"]["total_tokens"] == doc["usage"]["prompt_tokens"] + 5


def test_chat_stream_ends_with_usage_and_done(deployment):
    url, _ = deployment
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    payloads = sse_docs(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_stream_without_usage_option_has_no_usage(deployment):
    url, _ = deployment
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a b", "max_tokens": 2, "stream": True},
                   timeout=60)
    chunks = [json.loads(p) for p in sse_docs(r.text)[:-1]]
    assert all("usage" not in c for c in chunks)


def test_models_lists_the_served_model(deployment):
    url, _ = deployment
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),  # numbers are JSON numbers
    ({"prompt": "x", "seed": True}, "seed"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x " * 2000}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "stop": 5}, "stop"),
])
def test_bad_input_is_400_naming_the_field(deployment, body, param):
    url, _ = deployment
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["message"].startswith(param)


def test_malformed_json_is_400(deployment):
    url, _ = deployment
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_unknown_model_is_404(deployment):
    url, _ = deployment
    r = httpx.post(f"{url}/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_client_disconnect_frees_kv(deployment):
    url, instances = deployment
    decode = instances["decode"]
    body = {"prompt": "hello world " * 5, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert wait_until(lambda: len(decode.batch) == 1)
    # The connection is closed: the request is cancelled and every KV block comes back.
    assert wait_until(lambda: len(decode.batch) == 0 and decode.admission.num_admitted == 0)
    for instance in instances.values():
        bm = instance.runner.block_manager
        assert wait_until(lambda bm=bm: bm.num_free_blocks == bm.num_blocks)


def test_metrics_use_vllm_and_distserve_names(deployment):
    url, _ = deployment
    httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
               timeout=60)
    text = httpx.get(f"{url}/metrics").text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:kv_cache_usage_perc",
                 "distserve_queue_time_seconds_count", "distserve_kv_transfer_bytes_total",
                 "distserve_kv_transfer_seconds_count", "distserve_slo_met_requests_total"):
        assert name in text, name
    assert 'role="decode"' in text and 'instance="prefill-0"' in text and 'deployment="test"' in text


def test_overload_is_429_with_retry_after(tiny_llama):
    from distserve_engine.server import assembly

    settings = make_settings(tiny_llama, max_waiting_requests=0)
    router, instances, runner = assembly.build_in_process(settings)
    app = assembly.build_frontend_app(settings, router, runner.tokenizer, runner.max_model_len)
    try:
        with ServerThread(app) as server:
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
            assert r.status_code == 429
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_exceeded"
    finally:
        for instance in instances:
            instance.stop()


def test_dead_decode_instance_errors_at_once_then_503(deployment):
    url, instances = deployment
    body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        instances["decode"].kill("injected fault")
        rest = [line for line in lines if line.startswith("data: ")]
    errors = [json.loads(line[6:])["error"] for line in rest if '"error"' in line]
    assert errors and errors[0]["message"].startswith("no healthy decode instance")
    assert "injected fault" not in errors[0]["message"]  # instance detail is logged, not sent
    assert rest[-1] == "data: [DONE]"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    # No instance can say when it is back: no Retry-After to be retried against forever.
    assert r.status_code == 503 and "Retry-After" not in r.headers
    assert httpx.get(f"{url}/health").status_code == 503

    def decode_series(name: str) -> float:
        text = httpx.get(f"{url}/metrics").text
        line = next(x for x in text.splitlines()
                    if x.startswith(name + "{") and 'instance="decode-0"' in x)
        return float(line.rsplit(" ", 1)[1])

    assert wait_until(lambda: decode_series("distserve_instance_healthy") == 0.0)
    assert decode_series("vllm:num_requests_running") == 0.0
    text = httpx.get(f"{url}/metrics").text
    error_line = next(x for x in text.splitlines()
                      if x.startswith("vllm:request_success_total") and 'reason="error"' in x)
    assert float(error_line.rsplit(" ", 1)[1]) == 1.0
