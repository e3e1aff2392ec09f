"""KV leaves one runner and enters another: decoding there gives the same tokens."""

from __future__ import annotations

import pytest
import torch
from test_correctness import make_prompts, tiny_runner

from distserve_engine.errors import EngineError
from distserve_engine.generate import generate
from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence


def decode_to_end(runner, seqs: list[Sequence]) -> None:
    running = [s for s in seqs if not _finished(runner, s)]
    while running:
        runner.decode(running)
        running = [s for s in running if not _finished(runner, s)]


def _finished(runner, seq: Sequence) -> bool:
    runner.check_stop(seq)
    return seq.is_finished


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True),
])
def test_prefill_in_a_decode_in_b_matches_one_runner(tiny_llama_dir, params):
    prompts = make_prompts(384, [9, 30, 16], seed=4)
    single = [s.output_token_ids for s in generate(tiny_runner(tiny_llama_dir), prompts, params)]
    runner_a, runner_b = tiny_runner(tiny_llama_dir), tiny_runner(tiny_llama_dir)
    # occupy B's first blocks so the imported KV lands at different block ids
    filler = Sequence("filler", [5] * 40)
    runner_b.prefill([filler])
    seqs = [Sequence(i, p, params) for i, p in enumerate(prompts)]
    runner_a.prefill(seqs)
    moved = []
    for seq in seqs:
        blob = runner_a.export_kv(seq)
        assert blob.k.shape == (2, len(seq.prompt_token_ids), 2, 16) and blob.k.is_contiguous()
        assert blob.nbytes == 2 * blob.k.numel() * 4
        copy = seq.detached()
        runner_b.import_kv(copy, blob)
        assert set(copy.block_table).isdisjoint(seq.block_table)
        runner_a.free(seq)
        moved.append(copy)
    assert runner_a.block_manager.num_free_blocks == runner_a.num_blocks
    decode_to_end(runner_b, moved)
    assert [s.output_token_ids for s in moved] == single


def test_import_rejects_mismatched_blob_and_owned_blocks(tiny_llama_dir, tiny_opt_dir):
    llama, opt = tiny_runner(tiny_llama_dir), tiny_runner(tiny_opt_dir)
    seq = Sequence(0, [5, 6, 7])
    llama.prefill([seq])
    blob = llama.export_kv(seq)
    with pytest.raises(EngineError, match="blob shape"):
        opt.import_kv(seq.detached(), blob)
    with pytest.raises(EngineError, match="already holds blocks"):
        llama.import_kv(seq, blob)
    torch.testing.assert_close(llama.export_kv(seq).k, blob.k)
