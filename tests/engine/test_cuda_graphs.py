"""The CUDA-graph decode's buckets and padding, checked eagerly on the CPU."""

from __future__ import annotations

import torch
from test_correctness import make_prompts, tiny_runner

from distserve_engine.cuda_graphs import StaticDecode, block_buckets, bucket_for, graph_batch_sizes
from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence


def test_batch_and_block_buckets():
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert block_buckets(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 256, 257)] == [1, 4, 8, 16, 256, None]


def slots_of(cache: torch.Tensor) -> torch.Tensor:
    """A (L, NB, bs, Hkv, D) cache as (L, slot, Hkv * D): slot = block * bs + offset."""
    return cache.reshape(cache.shape[0], cache.shape[1] * cache.shape[2], -1)


@torch.inference_mode()
def test_padded_decode_step_gives_the_eager_rows_and_touches_only_the_scratch_block(tiny_llama_dir):
    runner = tiny_runner(tiny_llama_dir)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, p, params) for i, p in enumerate(make_prompts(384, [5, 40, 17], seed=4))]
    runner.prefill(seqs)
    scratch = runner.block_manager.free_block_ids[-1]  # a block no sequence owns
    static = StaticDecode(batch=8, num_blocks=6, block_size=runner.config.block_size,
                          scratch_block=scratch, device=torch.device("cpu"))
    for step_seqs in (seqs, seqs[1:]):  # the same static inputs refilled with fewer rows
        runner.block_manager.reserve(step_seqs, [s.num_tokens for s in step_seqs])
        meta = runner._metadata(step_seqs, [s.num_tokens - 1 for s in step_seqs], [1] * len(step_seqs))
        input_ids = torch.tensor([s.last_token_id for s in step_seqs])
        eager = runner.model(input_ids, meta, runner.kv_cache).clone()
        k_before, v_before = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
        static.fill(input_ids, meta)
        padded = runner.model(static.input_ids, static.meta, runner.kv_cache)
        torch.testing.assert_close(padded[: len(step_seqs)], eager)
        assert torch.isfinite(padded).all()
        # the real rows write their own slots again: the same K/V up to the last bits (a
        # batch of 8 rows may take another GEMM path than one of 3); nothing else but the
        # scratch block changes
        own = meta.slot_mapping
        for cache, before in ((runner.kv_cache.k, k_before), (runner.kv_cache.v, v_before)):
            torch.testing.assert_close(slots_of(cache)[:, own], slots_of(before)[:, own])
            changed = slots_of(cache) != slots_of(before)
            changed[:, own] = False
            changed_blocks = changed.any(-1).any(0).nonzero().flatten() // runner.config.block_size
            assert set(changed_blocks.tolist()) <= {scratch}
        for seq, token in zip(step_seqs, input_ids.tolist(), strict=True):
            seq.output_token_ids.append(token)
            seq.num_cached_tokens = seq.num_tokens - 1
