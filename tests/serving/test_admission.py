"""Admission: the limits hold under a burst, tickets come back, TTFT-predicted refusals."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import pytest
from fake_instances import GatedClient, WordTokenizer
from serving_helpers import ServerThread, wait_until

from distserve_engine.admission import (
    MIN_TTFT_SAMPLES,
    TTFT_WINDOW,
    AdmissionControl,
    Overloaded,
    TTFTModel,
)
from distserve_engine.router import Router
from distserve_engine.server.openai_app import Frontend, build_openai_app


class ThreadGate(GatedClient):
    """A gated client whose gate a test thread opens (the server runs in another thread)."""

    def __init__(self, name: str, role: str, gate: threading.Event | None) -> None:
        super().__init__(name, role)
        self.thread_gate = gate

    async def _wait(self) -> None:
        self.num_started += 1
        while self.thread_gate is not None and not self.thread_gate.is_set():
            await asyncio.sleep(0.01)


def burst(url: str, num_requests: int, stream: bool = False) -> list[httpx.Response]:
    """`num_requests` completions sent at once from as many threads; their responses."""
    responses: list[httpx.Response] = []
    lock = threading.Lock()
    client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=None))

    def send() -> None:
        body = {"prompt": "one two three", "max_tokens": 3, "stream": stream}
        r = client.post(f"{url}/v1/completions", json=body)
        with lock:
            responses.append(r)

    threads = [threading.Thread(target=send) for _ in range(num_requests)]
    for t in threads:
        t.start()
    return responses, threads


def serve_router(router: Router):
    return ServerThread(build_openai_app(Frontend(router, WordTokenizer(), "fake", 512), None))


@pytest.mark.parametrize("stream", [False, True])
def test_a_burst_gets_exactly_the_waiting_limit(stream):
    gate = threading.Event()
    prefill = ThreadGate("p0", "prefill", gate)
    router = Router([prefill], [ThreadGate("d0", "decode", None)], max_waiting_requests=16)
    with serve_router(router) as server:
        responses, threads = burst(server.url, 60, stream)
        assert wait_until(lambda: len(responses) >= 44 and prefill.num_started == 16)
        refused = [r for r in responses if r.status_code == 429]
        assert len(refused) == 44, [r.status_code for r in responses]
        assert all(r.headers["Retry-After"].isdigit() for r in refused)
        assert all(r.json()["error"]["type"] == "rate_limit_exceeded" for r in refused)
        assert router.admission.num_waiting == 16
        gate.set()
        for t in threads:
            t.join(60)
    assert sorted(r.status_code for r in responses) == [200] * 16 + [429] * 44
    assert (router.admission.num_waiting, router.admission.num_inflight) == (0, 0)


def test_in_flight_bound_holds_while_decodes_are_stuck():
    gate = threading.Event()
    decode = ThreadGate("d0", "decode", gate)
    router = Router([ThreadGate("p0", "prefill", None)], [decode], max_waiting_requests=100,
                    max_inflight_requests=5)
    with serve_router(router) as server:
        responses, threads = burst(server.url, 20)
        assert wait_until(lambda: len(responses) >= 15 and decode.num_started == 5)
        assert [r.status_code for r in responses] == [429] * 15
        assert "in flight" in responses[0].json()["error"]["message"]
        gate.set()
        for t in threads:
            t.join(60)
    assert [r.status_code for r in responses].count(200) == 5
    assert router.admission.num_inflight == 0


def test_default_in_flight_bound_follows_the_decode_batches():
    router = Router([GatedClient("p0", "prefill")], [GatedClient("d0", "decode"),
                    GatedClient("d1", "decode")], max_waiting_requests=10, max_decode_batch=4)
    tickets = []
    for _ in range(10 + 2 * 4 * 2):  # waiting + two batches of 4 on each decode instance
        tickets.append(router.admit(1))
        tickets[-1].first_token(0.1)  # out of waiting; still in flight
    with pytest.raises(Overloaded, match="in flight") as refused:
        router.admit(1)
    assert refused.value.status == 429
    for ticket in tickets:
        ticket.release()
        ticket.release()  # a second release changes nothing
    assert (router.admission.num_waiting, router.admission.num_inflight) == (0, 0)


def trained(ttft_slo_s: float = 1.0, seconds_per_token: float = 0.002,
            overhead_s: float = 0.05) -> AdmissionControl:
    """Admission whose TTFT model saw requests on the line overhead + rate * tokens."""
    control = AdmissionControl(10_000, ttft_slo_s=ttft_slo_s)
    for i in range(MIN_TTFT_SAMPLES + 4):
        tokens = 50 + 25 * i
        ticket = control.admit(tokens)
        ticket.first_token(overhead_s + seconds_per_token * tokens)
        ticket.release()
    control.admit_by_ttft = True
    return control


def test_ttft_model_recovers_the_queue_line():
    a_s, b_s = trained().ttft_model.line()
    assert a_s == pytest.approx(0.05) and b_s == pytest.approx(0.002)


def test_ttft_line_is_the_least_squares_line_of_the_last_window():
    """Long after the window first filled (its old samples gone, its sums refreshed), the
    line is the least-squares fit of the last TTFT_WINDOW samples alone."""
    rng = np.random.default_rng(7)
    model = TTFTModel()
    xs = rng.integers(0, 40_000, size=3 * TTFT_WINDOW + 37)
    # the line moves halfway: samples of the old one must have left the sums
    ys = np.where(np.arange(len(xs)) < 2 * TTFT_WINDOW, 0.3 + 2e-4 * xs, 0.1 + 5e-5 * xs)
    ys = ys + rng.normal(0.0, 0.05, size=len(xs))
    for x, y in zip(xs, ys, strict=True):
        model.observe(int(x), float(y))
    slope, intercept = np.polyfit(xs[-TTFT_WINDOW:], ys[-TTFT_WINDOW:], 1)
    a_s, b_s = model.line()
    assert b_s == pytest.approx(slope, rel=1e-9) and a_s == pytest.approx(intercept, rel=1e-9)
    assert b_s == pytest.approx(5e-5, rel=0.1)


def test_a_queue_that_would_miss_the_ttft_slo_is_refused_with_its_drain_time():
    control = trained()
    control.admit(400).release()  # 0.05 + 0.8 s: within the 1 s SLO
    with pytest.raises(Overloaded, match="TTFT SLO") as refused:
        control.admit(2000)  # 0.05 + 4 s predicted
    assert refused.value.status == 429
    assert refused.value.retry_after_s == 4  # ceil(4.05 - 1)
    assert (control.num_waiting, control.num_inflight) == (0, 0)


def test_no_refusal_on_ttft_before_the_model_has_seen_enough():
    control = AdmissionControl(100, ttft_slo_s=0.001, admit_by_ttft=True)
    assert control.admit(10**6).tokens_ahead == 10**6


def test_ttft_admission_needs_an_slo():
    with pytest.raises(ValueError, match="admit_by_ttft"):
        AdmissionControl(10, admit_by_ttft=True)


def test_tokens_ahead_count_admitted_requests_before_dispatch():
    control = AdmissionControl(100)
    tickets = [control.admit(100) for _ in range(5)]  # a burst, none dispatched yet
    assert control.admit(100).tokens_ahead == 600
    assert control.admit(100, num_prefill_instances=2).tokens_ahead == 300 + 100
    tickets[0].first_token(0.5)  # its prompt is no longer ahead of anyone
    assert control.admit(100).tokens_ahead == 700
