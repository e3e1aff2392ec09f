"""CUDA paths: fp16/bf16 weights, fused SDPA, KV transfer between GPU caches."""

from __future__ import annotations

import pytest
import torch
from test_correctness import make_prompts, tiny_runner
from test_kv_transfer import decode_to_end

from distserve_engine.generate import generate
from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_logits_close_to_cpu_fp32(tiny_llama_dir, dtype):
    gpu = tiny_runner(tiny_llama_dir, device="cuda", dtype=dtype)
    cpu = tiny_runner(tiny_llama_dir)
    assert gpu.kv_cache.k.is_cuda and gpu.kv_cache.k.dtype == getattr(torch, dtype)
    for prompt in make_prompts(384, [1, 30], seed=8):
        torch.testing.assert_close(gpu.score(prompt).cpu(), cpu.score(prompt), atol=0.5, rtol=0.05)


def test_fp32_cuda_greedy_matches_cpu(tiny_opt_dir):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = make_prompts(384, [5, 23], seed=9)
    gpu = generate(tiny_runner(tiny_opt_dir, device="cuda", dtype="float32"), prompts, params)
    cpu = generate(tiny_runner(tiny_opt_dir), prompts, params)
    assert [s.output_token_ids for s in gpu] == [s.output_token_ids for s in cpu]


def test_kv_moves_between_gpu_runners(tiny_llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = make_prompts(384, [11, 3], seed=10)
    single = generate(tiny_runner(tiny_llama_dir, device="cuda", dtype="bfloat16"), prompts, params)
    a = tiny_runner(tiny_llama_dir, device="cuda", dtype="bfloat16")
    b = tiny_runner(tiny_llama_dir, device="cuda", dtype="bfloat16")
    seqs = [Sequence(i, p, params) for i, p in enumerate(prompts)]
    a.prefill(seqs)
    moved = []
    for seq in seqs:
        copy = seq.detached()
        b.import_kv(copy, a.export_kv(seq))
        moved.append(copy)
    decode_to_end(b, moved)
    assert [s.output_token_ids for s in moved] == [s.output_token_ids for s in single]
