"""CUDA paths: fp16/bf16 weights, fused SDPA, decode from CUDA graphs, FlashAttention's
paged decode, KV transfer between GPU caches and through pinned host staging."""

from __future__ import annotations

import pytest
import torch
from test_correctness import make_prompts, tiny_runner
from test_kv_transfer import decode_to_end

from distserve_engine import flash_paged
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


@pytest.mark.parametrize("batch", [3, 5])  # padded up to the graphs of 4 and 8
def test_graph_decode_matches_eager(tiny_llama_dir, batch):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = make_prompts(384, [3 + 7 * i for i in range(batch)], seed=11)
    # fp32, so that the padded batch's GEMMs cannot flip a greedy choice by rounding
    graphed = tiny_runner(tiny_llama_dir, device="cuda", dtype="float32")
    eager = tiny_runner(tiny_llama_dir, device="cuda", dtype="float32", enable_cuda_graphs=False)
    assert graphed.decode_graphs is not None and eager.decode_graphs is None
    with_graphs = generate(graphed, prompts, params)
    assert graphed.decode_graphs.key_to_graph  # the decode steps did replay graphs
    without = generate(eager, prompts, params)
    assert [s.output_token_ids for s in with_graphs] == [s.output_token_ids for s in without]
    torch.testing.assert_close(graphed.last_logits, eager.last_logits, atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(flash_paged.kernel() is None, reason="flash-attn is not installed")
def test_flash_paged_decode_matches_sdpa(tiny_llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = make_prompts(384, [300, 9], seed=12)  # the first spans two 256-token blocks
    kwargs = dict(device="cuda", dtype="bfloat16", block_size=256, enable_cuda_graphs=False)
    flash = tiny_runner(tiny_llama_dir, **kwargs)
    assert flash_paged.is_supported("cuda", torch.bfloat16, 256)
    seqs = generate(flash, prompts, params)
    sdpa = generate(tiny_runner(tiny_llama_dir, device="cuda", dtype="bfloat16",
                                enable_cuda_graphs=False), prompts, params)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in sdpa]


def test_kv_export_into_host_buffer_and_import_from_it(tiny_llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = make_prompts(384, [19, 4], seed=13)
    single = generate(tiny_runner(tiny_llama_dir, device="cuda", dtype="bfloat16"), prompts, params)
    a = tiny_runner(tiny_llama_dir, device="cuda", dtype="bfloat16")
    b = tiny_runner(tiny_llama_dir, device="cuda", dtype="bfloat16")
    seqs = [Sequence(i, p, params) for i, p in enumerate(prompts)]
    a.prefill(seqs)
    moved = []
    for seq in seqs:
        host = torch.empty(a.kv_cache.blob_nbytes(seq.num_cached_tokens), dtype=torch.uint8)
        blob = a.export_kv(seq, into=host)  # through pinned staging into pageable memory
        assert not blob.k.is_cuda and blob.k.data_ptr() == host.data_ptr()
        copy = seq.detached()
        b.import_kv(copy, blob)
        moved.append(copy)
    decode_to_end(b, moved)
    assert [s.output_token_ids for s in moved] == [s.output_token_ids for s in single]
