"""The Prometheus client: answers from a real Prometheus; down, slow, erroring or garbage
servers raise PrometheusError within the deadline, and the async calls leave the loop free."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fake_http import FakeServer, reply
from prometheus_process import PrometheusProcess, free_port

from distserve.analyzer.prometheus import PrometheusClient, PrometheusError

SUCCESS = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
    {"metric": {"job": "x"}, "value": [1.0, "3"]}]}}).encode()


@pytest.fixture
def fake():
    servers = []

    def start(behave) -> FakeServer:
        servers.append(FakeServer(behave))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


# Local answers come at once; the read timeout is generous so that a loaded machine does
# not turn a garbage answer into a timeout (the slow case sets its own short timeout).
def quick(url: str, **kwargs) -> PrometheusClient:
    return PrometheusClient(url, **{"timeout_s": 3.0, "retries": 1, "backoff_s": 0.05, **kwargs})


def test_down_raises_after_bounded_retries():
    client = quick(f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(PrometheusError, match=r"unreachable.*after 2 attempts"):
        client.query("up")
    assert time.monotonic() - started < client.deadline_s
    with pytest.raises(PrometheusError, match="unreachable"):
        asyncio.run(client.aquery("up"))


def test_slow_raises_and_the_event_loop_keeps_running(fake):
    server = fake(lambda h, n: (time.sleep(3), reply(h, 200, SUCCESS)))
    client = quick(server.url, timeout_s=0.3)
    with pytest.raises(PrometheusError, match="timed out"):
        client.query("up")

    async def ticks_during_query() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(PrometheusError):
            await client.aquery("up")
        ticker.cancel()
        return ticks

    assert asyncio.run(ticks_during_query()) >= 5  # the loop ran while the query waited


def test_deadline_bounds_an_answer_that_trickles(fake):
    def trickle(handler, _n) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(60):  # each byte far within the socket timeout, the whole far beyond
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.1)

    # The read timeout (3 s) is 30 gaps long, so even a loaded machine never times out a
    # read; only the overall deadline (1 s) can end the call.
    client = quick(fake(trickle).url, timeout_s=3.0, retries=0, deadline_s=1.0)
    with pytest.raises(PrometheusError, match="no answer within 1.0 s"):
        asyncio.run(client.aquery("up"))


@pytest.mark.parametrize("status, body, match", [
    (200, b"<html>hello</html>", "not JSON"),
    (200, b'{"status": "error", "error": "boom"}', "not a successful Prometheus answer"),
    (200, b'[1, 2, 3]', "not a successful Prometheus answer"),
    (200, b'{"status": "success", "data": {"resultType": "matrix", "result": []}}', "expected a vector"),
    (200, b'{"status": "success", "data": {"resultType": "vector", "result": [{"value": 1}]}}', "malformed"),
    (400, b'{"status": "error", "errorType": "bad_data", "error": "parse error"}', "HTTP 400: bad_data"),
    (502, b"bad gateway", r"HTTP 502 \(after 2 attempts\)"),
])
def test_garbage_raises_naming_the_cause(fake, status, body, match):
    server = fake(lambda h, n: reply(h, status, body))
    with pytest.raises(PrometheusError, match=match):
        quick(server.url).query("up")
    assert server.calls == (2 if status >= 500 else 1)  # only a 5xx is asked again


def test_not_http_at_all_raises():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve_junk() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(1024)
            conn.sendall(b"\x00\x01 this is not HTTP\r\n\r\n")
            conn.close()

    threading.Thread(target=serve_junk, daemon=True).start()
    with pytest.raises(PrometheusError, match="broken HTTP answer"):
        quick(f"http://127.0.0.1:{listener.getsockname()[1]}").query("up")
    listener.close()


def test_a_failure_then_an_answer_is_retried(fake):
    server = fake(lambda h, n: reply(h, 503, b"starting") if n == 1 else reply(h, 200, SUCCESS))
    samples = quick(server.url).query("up")
    assert [(s.labels, s.value) for s in samples] == [({"job": "x"}, 3.0)]
    assert server.calls == 2


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="prometheus url"):
        PrometheusClient("localhost:9090")
    with pytest.raises(ValueError, match="timeout_s"):
        PrometheusClient("http://p:9090", timeout_s=0)
    with pytest.raises(ValueError, match="step_s"):
        PrometheusClient("http://p:9090").query_range("up", 10, 0, 1)


@pytest.mark.slow
def test_real_prometheus_answers_queries_and_refuses_bad_ones(tmp_path):
    with PrometheusProcess([], tmp_path) as prometheus:
        client = PrometheusClient(prometheus.url)
        assert client.query("1 + 1")[0].value == 2.0
        now = time.time()
        series = client.query_range("vector(7)", now - 10, now, 5)
        assert [v for _, v in series[0].points] == [7.0, 7.0, 7.0]
        with pytest.raises(PrometheusError, match="HTTP 400: bad_data"):
            client.query("sum(")
        assert asyncio.run(client.aquery("vector(3)"))[0].value == 3.0
