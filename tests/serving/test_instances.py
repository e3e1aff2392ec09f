"""Instances and router in one process: same tokens as one runner, back-pressure, dispatch."""

from __future__ import annotations

import asyncio

import pytest
from serving_helpers import wait_until

from distserve_engine.config import EngineConfig
from distserve_engine.generate import generate
from distserve_engine.instance.client import LocalInstanceClient
from distserve_engine.instance.colocated import ColocatedInstance
from distserve_engine.instance.decode import DecodeInstance
from distserve_engine.instance.prefill import PrefillInstance
from distserve_engine.request import ServeRequest
from distserve_engine.router import Router
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.transfer import KVFetcher, inprocess

PROMPTS = ["hello world", "the quick brown fox jumps", "a b c d e f g", "disaggregated prefill"]


def make_runner(path: str, num_blocks: int = 64) -> ModelRunner:
    return ModelRunner(EngineConfig(model=path, num_blocks=num_blocks))


def make_requests(runner, params, n=4) -> list[ServeRequest]:
    return [ServeRequest(f"r{i}", runner.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), params)
            for i in range(n)]


class RecordingFetcher(KVFetcher):
    """Records how many requests the decode instance had admitted at each pull."""

    def __init__(self) -> None:
        super().__init__()
        self.decode = None
        self.admitted_at_pull: list[int] = []

    def fetch(self, handle):
        self.admitted_at_pull.append(self.decode.admission.num_admitted)
        return super().fetch(handle)


async def run_disaggregated(router: Router, requests) -> list[list[int]]:
    async def one(req):
        tokens = []
        async for event in router.generate(req):
            assert event.error is None, event.error
            tokens += event.token_ids
        return tokens
    return await asyncio.gather(*(one(r) for r in requests))


@pytest.fixture
def pd(tiny_llama):
    fetcher = RecordingFetcher()
    prefill = PrefillInstance("p0", make_runner(tiny_llama), max_prefill_tokens=16).start()
    decode = DecodeInstance("d0", make_runner(tiny_llama), fetcher, max_batch_size=1).start()
    fetcher.decode = decode
    inprocess.register(prefill)
    yield prefill, decode, fetcher
    prefill.stop()
    decode.stop()
    inprocess.unregister(prefill)


def test_disaggregated_tokens_equal_one_runner_and_pulls_wait_for_room(tiny_llama, pd):
    prefill, decode, fetcher = pd
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = make_runner(tiny_llama)
    requests = make_requests(reference, params)
    expected = [s.output_token_ids for s in generate(reference, [r.prompt_token_ids for r in requests], params)]
    router = Router([LocalInstanceClient(prefill)], [LocalInstanceClient(decode)])
    got = asyncio.run(run_disaggregated(router, requests))
    assert got == expected
    # max_batch_size=1: a pull starts only when the batch is empty (back-pressure) ...
    assert fetcher.admitted_at_pull == [1] * len(requests)
    # ... and every KV block comes back on both sides (freed on their engine threads).
    for runner in (prefill.runner, decode.runner):
        assert wait_until(lambda r=runner: r.block_manager.num_free_blocks == r.num_blocks)


def test_colocated_tokens_equal_one_runner(tiny_llama):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    reference = make_runner(tiny_llama)
    requests = make_requests(reference, params)
    expected = [s.output_token_ids for s in generate(reference, [r.prompt_token_ids for r in requests], params)]
    colocated = ColocatedInstance("c0", make_runner(tiny_llama), max_prefill_tokens=16, max_batch_size=2).start()
    try:
        router = Router([], [], [LocalInstanceClient(colocated)])
        assert asyncio.run(run_disaggregated(router, requests)) == expected
    finally:
        colocated.stop()


def test_request_on_a_dead_prefill_instance_is_resumed_on_a_live_one(tiny_llama):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    fetcher = KVFetcher()
    dead = PrefillInstance("p-dead", make_runner(tiny_llama), 64).start()
    alive = PrefillInstance("p-alive", make_runner(tiny_llama), 64).start()
    decode = DecodeInstance("d0", make_runner(tiny_llama), fetcher, 4).start()
    for p in (dead, alive):
        inprocess.register(p)
    dead.kill("injected fault")
    router = Router([LocalInstanceClient(dead), LocalInstanceClient(alive)], [LocalInstanceClient(decode)])

    async def scenario():
        req = make_requests(alive.runner, params, 1)[0]
        events = [e async for e in router.generate(req)]  # first pick: the dead one (empty queue)
        ok = [e async for e in router.generate(ServeRequest("r-next", req.prompt_token_ids, params))]
        return events, ok

    try:
        events, ok = asyncio.run(scenario())
        assert all(e.error is None for e in events + ok)
        tokens = [t for e in events for t in e.token_ids]
        assert tokens == [t for e in ok for t in e.token_ids] and len(tokens) == 4
        assert not router.prefill[0].is_healthy
        first, second = list(router.timelines)
        assert (first.num_recoveries, first.prefill_instance) == (1, "p-alive")
        assert second.num_recoveries == 0
    finally:
        for instance in (dead, alive, decode):
            instance.stop()
            inprocess.unregister(instance)


