"""Each instance keeps its runner's batches timed, in the lengths the latency profile
times (prefill: tokens computed per sequence; decode: each context with the new token),
and serves them at GET /debug/iterations."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from fastapi.testclient import TestClient
from test_instances import make_requests, make_runner, run_disaggregated

from distserve_engine.instance.client import LocalInstanceClient
from distserve_engine.instance.colocated import ColocatedInstance
from distserve_engine.instance.decode import DecodeInstance
from distserve_engine.instance.iterations import Iteration
from distserve_engine.instance.prefill import PrefillInstance
from distserve_engine.router import Router
from distserve_engine.sampling import SamplingParams
from distserve_engine.server.instance_app import build_instance_app
from distserve_engine.transfer import KVFetcher, inprocess

MAX_TOKENS = 6


def expected_decode_lens(requests) -> Counter:
    """A request of P prompt tokens gets its first token from the prefill, then decodes
    MAX_TOKENS - 1 steps whose contexts (with the new token) are P + 1 ... P + MAX_TOKENS - 1."""
    return Counter(len(r.prompt_token_ids) + k for r in requests for k in range(1, MAX_TOKENS))


def kinds_and_lens(items: list[Iteration], kind: str) -> Counter:
    return Counter(n for item in items if item.kind == kind for n in item.lens)


def test_prefill_and_decode_instances_keep_every_batch_in_the_profiles_terms(tiny_llama):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prefill = PrefillInstance("p0", make_runner(tiny_llama), max_prefill_tokens=16).start()
    decode = DecodeInstance("d0", make_runner(tiny_llama), KVFetcher(), max_batch_size=4).start()
    inprocess.register(prefill)
    try:
        requests = make_requests(decode.runner, params)
        router = Router([LocalInstanceClient(prefill)], [LocalInstanceClient(decode)])
        asyncio.run(run_disaggregated(router, requests))
        prefilled, decoded = prefill.iterations.recent(), decode.iterations.recent()
        assert {i.kind for i in prefilled} == {"prefill"} and {i.kind for i in decoded} == {"decode"}
        assert kinds_and_lens(prefilled, "prefill") == Counter(len(r.prompt_token_ids) for r in requests)
        assert all(sum(i.lens) <= 16 for i in prefilled)  # batches within Lm
        assert kinds_and_lens(decoded, "decode") == expected_decode_lens(requests)
        assert max(len(i.lens) for i in decoded) > 1  # requests were decoded together
        assert all(i.busy_s == i.seconds + i.overhead_s for i in prefilled + decoded)
        starts = [i.started_s for i in decoded]
        assert starts == sorted(starts)

        served = TestClient(build_instance_app(decode)).get("/debug/iterations", params={"limit": 3})
        assert served.status_code == 200
        assert [Iteration.from_dict(doc) for doc in served.json()] == decoded[-3:]
        bad = TestClient(build_instance_app(decode)).get("/debug/iterations", params={"limit": 0})
        assert bad.status_code == 422
    finally:
        prefill.stop()
        decode.stop()
        inprocess.unregister(prefill)


def test_a_colocated_instance_keeps_its_prefills_and_its_decode_steps_apart(tiny_llama):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    colocated = ColocatedInstance("c0", make_runner(tiny_llama), max_prefill_tokens=64,
                                  max_batch_size=4).start()
    try:
        requests = make_requests(colocated.runner, params)
        asyncio.run(run_disaggregated(Router([], [], [LocalInstanceClient(colocated)]), requests))
        items = colocated.iterations.recent()
        assert kinds_and_lens(items, "prefill") == Counter(len(r.prompt_token_ids) for r in requests)
        assert kinds_and_lens(items, "decode") == expected_decode_lens(requests)
    finally:
        colocated.stop()


def test_the_overhead_before_a_call_counts_from_the_last_call_or_the_wake_up():
    from distserve_engine.instance.iterations import IterationLog

    now = [0.0]
    log = IterationLog(clock=lambda: now[0])

    def runner_call(seconds: float):
        return lambda: now.__setitem__(0, now[0] + seconds)

    now[0] = 1.0  # the engine thread started, then scheduled for 1 s
    log.run("decode", [5], runner_call(0.5))
    now[0] += 0.2  # busy elsewhere on the engine thread (an import, emitting tokens)
    log.run("decode", [6], runner_call(0.5))
    now[0] += 3.0  # waiting for work, then woken
    log.woke()
    now[0] += 0.1  # scheduling after the wake-up
    log.run("decode", [7], runner_call(0.5))
    first, busy, woken = log.recent()
    assert [i.seconds for i in (first, busy, woken)] == pytest.approx([0.5, 0.5, 0.5])
    assert [i.overhead_s for i in (first, busy, woken)] == pytest.approx([1.0, 0.2, 0.1])
    assert busy.busy_s == pytest.approx(0.7)
    assert Iteration.from_dict(busy.to_dict()) == busy


def test_a_call_keeps_the_engine_threads_cpu_time_beside_its_wall_time():
    from distserve_engine.instance.iterations import IterationLog

    now, cpu = [0.0], [0.0]
    log = IterationLog(clock=lambda: now[0], cpu_clock=lambda: cpu[0])

    def runner_call(seconds: float, on_core_s: float):
        def call():
            now[0] += seconds
            cpu[0] += on_core_s  # the rest of the call the thread waited for its core
        return call

    log.run("prefill", [40], runner_call(0.5, 0.4))
    item, = log.recent()
    assert (item.seconds, item.cpu_s) == pytest.approx((0.5, 0.4))
    assert Iteration.from_dict(item.to_dict()) == item
    # measured for real: a call that computes holds its thread's CPU for about its time
    real = IterationLog()
    real.run("decode", [3], lambda: sum(i * i for i in range(200_000)))
    measured, = real.recent()
    assert 0 < measured.cpu_s <= measured.seconds * 1.05 + 1e-3


def test_an_iteration_document_names_what_is_wrong():
    good = {"kind": "decode", "started_s": 1.0, "seconds": 0.05, "lens": [12, 30]}
    assert Iteration.from_dict(good) == Iteration("decode", 1.0, 0.05, (12, 30))
    with pytest.raises(ValueError, match="kind must be one of"):
        Iteration.from_dict({**good, "kind": "mixed"})
    with pytest.raises(ValueError, match="needs kind, started_s, seconds and lens"):
        Iteration.from_dict({"kind": "decode"})
