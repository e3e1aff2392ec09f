"""Preemption by recompute: a cache too small for every request at once still gives each
request the tokens it gets alone (greedy), on the decode and the colocated instance."""

from __future__ import annotations

import asyncio

from serving_helpers import wait_until
from test_instances import make_requests, make_runner, run_disaggregated

from distserve_engine.config import EngineConfig
from distserve_engine.generate import generate
from distserve_engine.instance.client import LocalInstanceClient
from distserve_engine.instance.colocated import ColocatedInstance
from distserve_engine.instance.decode import DecodeInstance
from distserve_engine.instance.prefill import PrefillInstance
from distserve_engine.metrics import ServingMetrics
from distserve_engine.router import Router
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.transfer import KVFetcher, inprocess

MAX_TOKENS = 16  # 4 prompts of a few tokens grow to ~20 tokens each: 8 blocks of 4 hold ~1.5


def small_cache_runner(path: str) -> ModelRunner:
    """The tiny model with 8 blocks of 4 tokens (the least that holds max_model_len 32)."""
    return ModelRunner(EngineConfig(model=path, num_blocks=8, block_size=4, max_model_len=32))


def expected_tokens(path: str, requests, params) -> list[list[int]]:
    reference = make_runner(path)
    return [s.output_token_ids
            for s in generate(reference, [r.prompt_token_ids for r in requests], params)]


def preemptions_exported(instance) -> float:
    """vllm:num_preemptions_total as the instance's own /metrics shows it."""
    metrics = ServingMetrics("d", instance.role, instance.name, "tiny")
    metrics.set_load(instance.load())
    value = metrics.registry.get_sample_value("vllm:num_preemptions_total",
                                              {**metrics.labels, "role": instance.role})
    return value or 0.0


def test_decode_instance_preempts_and_recomputes_to_the_same_tokens(tiny_llama):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prefill = PrefillInstance("p0", make_runner(tiny_llama), max_prefill_tokens=64).start()
    decode = DecodeInstance("d0", small_cache_runner(tiny_llama), KVFetcher(), 4).start()
    inprocess.register(prefill)
    try:
        requests = make_requests(decode.runner, params)
        router = Router([LocalInstanceClient(prefill)], [LocalInstanceClient(decode)])
        got = asyncio.run(run_disaggregated(router, requests))
        assert got == expected_tokens(tiny_llama, requests, params)
        assert decode.load().num_preemptions > 0
        assert preemptions_exported(decode) == decode.load().num_preemptions
        blocks = decode.runner.block_manager
        assert wait_until(lambda: blocks.num_free_blocks == blocks.num_blocks)
    finally:
        prefill.stop()
        decode.stop()
        inprocess.unregister(prefill)


def test_colocated_instance_preempts_and_recomputes_to_the_same_tokens(tiny_llama):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    colocated = ColocatedInstance("c0", small_cache_runner(tiny_llama), max_prefill_tokens=64,
                                  max_batch_size=4).start()
    try:
        requests = make_requests(colocated.runner, params)
        router = Router([], [], [LocalInstanceClient(colocated)])
        got = asyncio.run(run_disaggregated(router, requests))
        assert got == expected_tokens(tiny_llama, requests, params)
        assert colocated.load().num_preemptions > 0
        assert preemptions_exported(colocated) == colocated.load().num_preemptions
    finally:
        colocated.stop()

