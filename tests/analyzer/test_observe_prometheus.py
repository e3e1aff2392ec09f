"""The analyzer against a real Prometheus scraping a real router under generated load:
rate and lengths within 10% of what was sent, the plan, the refusals; Prometheus down
or garbage gives PrometheusError, not a crash."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import httpx
import numpy as np
import pytest
from fake_http import FakeServer, reply
from prometheus_process import PrometheusProcess, free_port

from distserve.analyzer.observe import observe
from distserve.analyzer.prometheus import PrometheusClient, PrometheusError
from distserve.analyzer.replan import observed_workload

PLAN = {"id": "plan-under-test", "predicted_attainment": 0.9, "predicted_goodput_rps": 6.0,
        "prefill": "tp1pp1x1", "decode": "tp1pp1x1"}
LABELS = {"deployment": "analyzed"}
RATE_RPS = 5.0
LOAD_S = 40.0
SEED = 7


@contextlib.contextmanager
def serving(model: str, **overrides):
    """Router + 1 prefill + 1 decode of the tiny model in this process, over HTTP."""
    from serving_helpers import ServerThread, make_settings

    from distserve_engine.server import assembly

    doc = {"deployment": LABELS["deployment"], "plan": PLAN, "max_waiting_requests": 512,
           "engine": {"model": model, "num_blocks": 256, "max_model_len": 512}}
    settings = make_settings(model, **{**doc, **overrides})
    router, instances, runner = assembly.build_in_process(settings)
    app = assembly.build_frontend_app(settings, router, runner.tokenizer, runner.max_model_len)
    try:
        with ServerThread(app) as server:
            yield server
    finally:
        for instance in instances:
            instance.stop()


def make_load(rate_rps: float, duration_s: float, seed: int) -> list[tuple[float, int, int]]:
    """(send at s, prompt tokens, output tokens): Poisson arrivals, log-normal lengths; the
    longer the prompt, the longer its output (half of it, give or take)."""
    rng = np.random.default_rng(seed)
    gaps_s = rng.exponential(1.0 / rate_rps, int(rate_rps * duration_s * 2))
    times_s = np.cumsum(gaps_s)
    times_s = times_s[times_s < duration_s]
    prompts = np.clip(np.rint(rng.lognormal(np.log(60), 0.5, len(times_s))), 4, 300).astype(int)
    outputs = np.clip(np.rint(prompts / 2 * rng.lognormal(0, 0.3, len(times_s))), 1, 150).astype(int)
    return list(zip(times_s.tolist(), prompts.tolist(), outputs.tolist(), strict=True))


async def send(url: str, load: list[tuple[float, int, int]]) -> list[int]:
    """Send every request at its time; the status codes."""
    async with httpx.AsyncClient(timeout=120) as client:
        start = time.monotonic()

        async def one(at_s: float, prompt: int, output: int) -> int:
            await asyncio.sleep(max(0.0, at_s - (time.monotonic() - start)))
            body = {"prompt": [7 + i % 200 for i in range(prompt)], "max_tokens": output,
                    "ignore_eos": True}
            return (await client.post(f"{url}/v1/completions", json=body)).status_code

        return await asyncio.gather(*(one(*request) for request in load))


def within(measured: float, sent: float, rel: float = 0.10) -> bool:
    return abs(measured - sent) <= rel * sent


@pytest.mark.slow
def test_rate_lengths_and_plan_match_what_was_sent(tiny_model, tmp_path):
    load = make_load(RATE_RPS, LOAD_S, SEED)
    prompts = np.array([p for _, p, _ in load])
    outputs = np.array([o for _, _, o in load])
    with serving(tiny_model) as server, PrometheusProcess([server.url.removeprefix("http://")], tmp_path) as prom:
        prom.wait_for_scrapes()
        started_s = time.time()
        statuses = asyncio.run(send(server.url, load))
        end_s = time.time() + 1.0
        time.sleep(end_s - time.time() + 2.5)  # the last scrape after end_s is in
        window_s = end_s - started_s + 1.0
        seen = asyncio.run(observe(PrometheusClient(prom.url), LABELS, window_s=window_s,
                                   end_s=end_s, subwindow_s=4.0))
    assert statuses.count(200) == len(load)
    sent_rate_rps = len(load) / window_s
    print(f"\nsent {len(load)} requests over {window_s:.1f} s ({sent_rate_rps:.2f} req/s); "
          f"analyzer: {seen.num_requests} requests, {seen.arrival_rate_rps:.2f} req/s, cv {seen.arrival_cv}")
    print(f"prompt mean sent {prompts.mean():.1f} analyzer {seen.prompt.mean_tokens:.1f} ({seen.prompt.family}); "
          f"p90 sent {np.percentile(prompts, 90):.0f} analyzer {seen.prompt.p90_tokens:.0f}")
    print(f"output mean sent {outputs.mean():.1f} analyzer {seen.output.mean_tokens:.1f} ({seen.output.family}); "
          f"p90 sent {np.percentile(outputs, 90):.0f} analyzer {seen.output.p90_tokens:.0f}")
    print(f"attainment {seen.attainment} ttft p90 {seen.ttft_p90_s} tpot p90 {seen.tpot_p90_s} "
          f"phases {seen.phases} plan {seen.plan_id}")
    assert within(seen.num_requests, len(load))
    assert within(seen.arrival_rate_rps, sent_rate_rps)
    assert within(seen.prompt.mean_tokens, prompts.mean())
    assert within(seen.output.mean_tokens, outputs.mean())
    assert within(seen.prompt.p90_tokens, np.percentile(prompts, 90))
    assert within(seen.output.p90_tokens, np.percentile(outputs, 90))
    assert within(sum(seen.prompt.bucket_counts), len(load))
    assert 0.5 < seen.arrival_cv < 1.6  # Poisson: 1
    assert seen.plan_id == PLAN["id"] and seen.num_refused == 0
    assert seen.attainment is not None and 0.0 <= seen.attainment <= 1.0
    assert seen.recent.attainment is not None and 0.0 <= seen.recent.attainment <= 1.0
    # the third before the last: the requests sent then
    third_s = window_s / 3
    sent_then = sum(1 for at_s, _, _ in load
                    if end_s - 2 * third_s <= started_s + at_s < end_s - third_s)
    print(f"previous third: sent {sent_then}, analyzer {seen.previous.num_requests}")
    assert abs(seen.previous.num_requests - sent_then) <= max(5, 0.15 * sent_then)  # 14 s of scrapes
    assert seen.previous.prompt is not None and seen.previous.joint is not None
    assert seen.ttft_p90_s is not None and seen.tpot_p90_s is not None
    assert {"prefill", "decode"} <= set(seen.phases)
    assert seen.phases["prefill"].queue_time_p90_s is not None
    assert seen.phases["decode"].kv_usage_mean is not None
    # which prompts had which outputs: per prompt class, the requests sent, and the mean
    # output the simulator's resampled workload gives that class's prompts (the joint's
    # cells are coarse, 1-2-5: within 15%), and what it gave them drawn independently
    classes = np.asarray(seen.joint.prompt_upper_tokens)
    sent_class = np.searchsorted(classes, prompts, side="left")
    paired = observed_workload(seen, 512).lengths
    independent = observed_workload(replace(seen, joint=None), 512).lengths
    for row, counts in enumerate(seen.joint.counts):
        mine = sent_class == row
        print(f"prompts <= {classes[row]:.0f}: sent {mine.sum()}, analyzer {sum(counts):.1f}", end="")
        assert abs(sum(counts) - mine.sum()) <= max(3.0, 0.10 * mine.sum())
        if mine.sum() < 30:
            print()
            continue
        means = [w.output_tokens[np.searchsorted(classes, w.prompt_tokens, side="left") == row].mean()
                 for w in (paired, independent)]
        print(f"; mean output sent {outputs[mine].mean():.1f}, resampled {means[0]:.1f}, "
              f"drawn independently {means[1]:.1f}")
        assert within(means[0], outputs[mine].mean(), 0.15)


@pytest.mark.slow
def test_refused_requests_count_as_arrivals_without_lengths(tiny_model, tmp_path):
    with serving(tiny_model, max_waiting_requests=0) as server, \
            PrometheusProcess([server.url.removeprefix("http://")], tmp_path) as prom:
        prom.wait_for_scrapes()
        started_s = time.time()
        statuses = asyncio.run(send(server.url, make_load(4.0, 8.0, SEED)))
        end_s = time.time() + 1.0
        time.sleep(end_s - time.time() + 2.5)
        seen = asyncio.run(observe(PrometheusClient(prom.url), LABELS,
                                   window_s=end_s - started_s + 1.0, end_s=end_s))
        other = asyncio.run(observe(PrometheusClient(prom.url), {"deployment": "another"},
                                    window_s=20.0, end_s=end_s))
    assert set(statuses) == {429}
    print(f"\nrefused {len(statuses)}; analyzer: {seen.num_requests} arrivals, {seen.num_refused} refused")
    assert within(seen.num_requests, len(statuses)) and within(seen.num_refused, len(statuses))
    assert seen.prompt is None and seen.output is None and seen.attainment is None
    assert seen.joint is None or seen.joint.total == 0
    assert other.num_requests == 0 and other.plan_id is None  # the selector is honoured


def test_observe_raises_when_prometheus_is_down():
    client = PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.3, retries=1, backoff_s=0.05)
    with pytest.raises(PrometheusError):
        asyncio.run(observe(client, LABELS, window_s=60))
    with pytest.raises(ValueError, match="window_s"):
        asyncio.run(observe(client, LABELS, window_s=0))
    with pytest.raises(ValueError, match="selector"):
        asyncio.run(observe(client, {}, window_s=60))


def garbage_for_range_queries(handler, _n) -> None:
    """Vector answers to instant queries, garbage to the range query."""
    if "query_range" in handler.path:
        reply(handler, 200, b"<html>maintenance</html>", "text/html")
    else:
        reply(handler, 200, b'{"status": "success", "data": {"resultType": "vector", "result": []}}')


# A garbage answer comes at once; its read timeout is generous so that a loaded machine
# cannot turn it into a timeout.
@pytest.mark.parametrize("behave, timeout_s, match", [
    (lambda h, n: (time.sleep(2), reply(h, 200, b"{}")), 0.3, "timed out"),
    (lambda h, n: reply(h, 200, b"not json"), 3.0, "not JSON"),
    (garbage_for_range_queries, 3.0, "not JSON"),
])
def test_observe_raises_when_prometheus_is_slow_or_answers_garbage(behave, timeout_s, match):
    server = FakeServer(behave)
    try:
        client = PrometheusClient(server.url, timeout_s=timeout_s, retries=1, backoff_s=0.05)
        with pytest.raises(PrometheusError, match=match):
            asyncio.run(observe(client, LABELS, window_s=60))
    finally:
        server.close()
