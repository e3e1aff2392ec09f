"""The series the workload analyzer reads: arrivals with refusals, request lengths, the plan."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import ServerThread, make_settings

from distserve_engine.metrics import joint_buckets_tokens, length_buckets_tokens

PLAN = {"id": "abc123", "predicted_attainment": 0.93, "predicted_goodput_rps": 4.5,
        "prefill": "tp1pp1x1", "decode": "tp1pp1x1"}


def samples(text: str, name: str) -> dict[tuple, float]:
    """`name`'s samples: sorted label items -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for k, v in samples(text, name).items() if set(labels.items()) <= set(k)]
    assert len(found) == 1, (name, labels, samples(text, name))
    return found[0]


def test_length_buckets_are_ten_per_decade_up_to_the_context():
    assert length_buckets_tokens(2048)[:12] == (1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 20, 25)
    buckets = length_buckets_tokens(2048)
    assert buckets[-1] == 2048 and buckets[-2] == 2000
    ratios = [b / a for a, b in zip(buckets[7:-2], buckets[8:-1], strict=True)]
    assert max(ratios) <= 1.3  # a bucket spans at most ~25% of its bound
    with pytest.raises(ValueError, match="max_model_len"):
        length_buckets_tokens(-1)


def test_the_joint_histogram_classes_are_whole_length_buckets():
    assert joint_buckets_tokens(2048) == (20, 50, 100, 200, 500, 1000, 2000, 2048)
    assert joint_buckets_tokens(512)[-1] == 512 and joint_buckets_tokens(10) == (10,)
    for max_model_len in (10, 512, 2048, 131072):
        assert set(joint_buckets_tokens(max_model_len)) <= set(length_buckets_tokens(max_model_len))


@pytest.fixture
def planned(tiny_llama, tmp_path):
    """A deployment with a plan in its settings, refusing beyond 0 waiting when asked."""
    from distserve_engine.server import assembly

    def start(**overrides):
        settings = make_settings(tiny_llama, plan=PLAN, **overrides)
        router, instances, runner = assembly.build_in_process(settings)
        app = assembly.build_frontend_app(settings, router, runner.tokenizer, runner.max_model_len)
        started.append(instances)
        return ServerThread(app), router

    started: list = []
    yield start
    for instances in started:
        for instance in instances:
            instance.stop()


def test_router_counts_arrivals_lengths_and_exports_the_plan(planned):
    server, _ = planned()
    with server:
        text = httpx.get(f"{server.url}/metrics").text
        # Before any request the counters exist at 0 (a rate over a window sees the first one).
        assert value(text, "distserve_requests_arrived_total") == 0
        assert value(text, "vllm:request_prompt_tokens_count") == 0
        classes = {dict(k)["prompt_le"] for k in
                   samples(text, "distserve_request_generation_tokens_by_prompt_count")}
        assert {"20", "50", "+Inf"} <= classes
        for prompt_len, max_tokens in ((7, 3), (40, 9)):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": [5] * prompt_len, "max_tokens": max_tokens, "ignore_eos": True})
            assert r.status_code == 200
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 0})  # 400: no arrival
        text = httpx.get(f"{server.url}/metrics").text
    assert value(text, "distserve_requests_arrived_total") == 2
    assert value(text, "vllm:request_prompt_tokens_sum") == 47
    assert value(text, "vllm:request_generation_tokens_sum") == 12
    assert value(text, "vllm:request_prompt_tokens_bucket", le="8.0") == 1
    assert value(text, "vllm:request_prompt_tokens_bucket", le="40.0") == 2
    assert value(text, "vllm:request_generation_tokens_bucket", le="3.0") == 1
    # which prompt had which output: 7 tokens -> 3, 40 tokens -> 9
    joint = "distserve_request_generation_tokens_by_prompt_bucket"
    assert value(text, joint, prompt_le="20", le="20.0") == 1
    assert value(text, joint, prompt_le="50", le="20.0") == 1
    assert value(text, joint, prompt_le="100", le="+Inf") == 0
    assert value(text, "distserve_plan_info", plan_id="abc123", prefill="tp1pp1x1", decode="tp1pp1x1") == 1
    assert value(text, "distserve_plan_predicted_attainment", plan_id="abc123") == pytest.approx(0.93)
    assert value(text, "distserve_plan_predicted_goodput_rps", plan_id="abc123") == pytest.approx(4.5)


def test_refused_requests_are_arrivals(planned):
    server, _ = planned(max_waiting_requests=0)
    with server:
        for _ in range(3):
            assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 429
        text = httpx.get(f"{server.url}/metrics").text
    assert value(text, "distserve_requests_arrived_total") == 3
    assert value(text, "distserve_requests_rejected_total", status="429") == 3
    assert value(text, "vllm:request_prompt_tokens_count") == 0


def test_a_new_plan_in_the_settings_file_replaces_the_plan_series(planned, tiny_llama, tmp_path):
    from distserve_engine.server.peers import PeerWatcher

    server, router = planned()
    path = tmp_path / "serve.json"
    doc = make_settings(tiny_llama, plan=PLAN).to_dict()
    path.write_text(json.dumps(doc))
    watcher = PeerWatcher(path, router, lambda peers: {})
    doc["plan"] = {"id": "def456", "predicted_attainment": 0.9}
    doc["peers"] = {}
    path.write_text(json.dumps(doc))
    assert watcher.check()
    text = router.metrics.render().decode()
    assert [dict(k)["plan_id"] for k in samples(text, "distserve_plan_info")] == ["def456"]
    assert samples(text, "distserve_plan_predicted_goodput_rps") == {}


def test_settings_reject_a_plan_without_id(tiny_llama):
    with pytest.raises(ValueError, match="plan needs a non-empty string id"):
        make_settings(tiny_llama, plan={"predicted_attainment": 0.9})
