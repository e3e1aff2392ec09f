"""The engine computes what `transformers` computes with the same weights."""

from __future__ import annotations

import pytest
import torch
from reference import hf_greedy, hf_logits, hf_model, hf_model_from_gguf
from test_native import spy_on_kernel

from distserve_engine.config import EngineConfig
from distserve_engine.generate import generate
from distserve_engine.models.llama import LlamaForCausalLM
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def make_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random prompts avoiding the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def tiny_runner(folder, **kwargs) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(folder), num_blocks=64, **kwargs))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_opt_dir"])
def test_prefill_logits_match_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    runner, ref = tiny_runner(folder), hf_model(folder)
    for prompt in make_prompts(runner.model_config.vocab_size, [1, 7, 40]):
        torch.testing.assert_close(runner.score(prompt), hf_logits(ref, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_opt_dir"])
def test_batched_greedy_32_tokens_match_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    runner, ref = tiny_runner(folder), hf_model(folder)
    prompts = make_prompts(runner.model_config.vocab_size, [5, 17, 33], seed=1)
    seqs = generate(runner, prompts, GREEDY_32)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_token_ids == hf_greedy(ref, prompt, 32)
        assert seq.finish_reason == "length"
    assert runner.block_manager.num_free_blocks == runner.num_blocks


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_opt_dir"])
def test_a_prefill_runs_its_last_layer_past_attention_for_the_sampled_rows_alone(fixture,
                                                                                request):
    folder = request.getfixturevalue(fixture)
    runner, ref = tiny_runner(folder), hf_model(folder)
    prompts = make_prompts(runner.model_config.vocab_size, [9, 1, 30], seed=3)
    mlp_rows = []
    last_mlp_out = [m for m in runner.model.layers[-1].modules()
                    if m is not runner.model.layers[-1] and hasattr(m, "in_features")][-1]
    hook = last_mlp_out.register_forward_hook(lambda m, args, out: mlp_rows.append(len(args[0])))
    try:
        seqs = [Sequence(i, p, GREEDY_32) for i, p in enumerate(prompts)]
        runner.prefill(seqs)
    finally:
        hook.remove()
    assert mlp_rows == [len(prompts)]  # one row per sequence, not one per prompt token
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(runner.last_logits[row], hf_logits(ref, prompt)[-1],
                                   atol=1e-4, rtol=1e-4)
    # every prompt token's keys and values went into the cache: decoding goes on as
    # transformers does
    for _ in range(3):
        runner.decode(seqs)
    for seq in seqs:
        assert seq.output_token_ids == hf_greedy(ref, seq.prompt_token_ids, 4)


def test_decode_logits_match_transformers(tiny_llama_dir):
    runner, ref = tiny_runner(tiny_llama_dir), hf_model(tiny_llama_dir)
    prompts = make_prompts(runner.model_config.vocab_size, [3, 21], seed=2)
    seqs = generate(runner, prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    # the last decode step's logits are those of the full sequence minus its newest token
    for row, seq in enumerate(seqs):
        expected = hf_logits(ref, seq.token_ids[:-1])[-1]
        torch.testing.assert_close(runner.last_logits[row], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("dtype", "kernel_name"), [("float32", "llama_decode"),
                                                  ("bfloat16", "llama_decode_bf16")])
def test_a_decode_step_in_one_c_call_is_the_layers_one_by_one_bit_for_bit(
        tiny_llama_dir, monkeypatch, dtype, kernel_name):
    kernel, calls = spy_on_kernel(monkeypatch, kernel_name)
    if kernel is None:
        pytest.skip(f"{kernel_name}: the C kernels cannot be built here, or the CPU lacks AMX")
    fused_runner = tiny_runner(tiny_llama_dir, dtype=dtype)
    prompts = make_prompts(fused_runner.model_config.vocab_size, [3, 21, 9], seed=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fused = generate(fused_runner, prompts, params)
    assert len(calls) == 11  # every decode step (the first token comes from the prefill)
    monkeypatch.setattr(LlamaForCausalLM, "_decode_in_c", lambda *args: False)
    layered_runner = tiny_runner(tiny_llama_dir, dtype=dtype)
    layered = generate(layered_runner, prompts, params)
    assert [s.output_token_ids for s in fused] == [s.output_token_ids for s in layered]
    assert torch.equal(fused_runner.last_logits, layered_runner.last_logits)


def test_bf16_decode_steps_run_the_c_kernels_and_stay_close_to_transformers(tiny_llama_dir,
                                                                           monkeypatch):
    runner, ref = tiny_runner(tiny_llama_dir, dtype="bfloat16"), hf_model(tiny_llama_dir)
    monkeypatch.setattr(LlamaForCausalLM, "_decode_in_c", lambda *args: False)  # layer by layer
    kernel, calls = spy_on_kernel(monkeypatch, "paged_decode_bf16")
    if kernel is None:
        pytest.skip("the CPU engine's C kernels cannot be built here")
    prompts = make_prompts(runner.model_config.vocab_size, [3, 21], seed=2)
    seqs = generate(runner, prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(calls) == 7 * runner.model_config.num_layers  # each decode step, each layer
    for row, seq in enumerate(seqs):  # float32 transformers on the tokens bf16 chose
        expected = hf_logits(ref, seq.token_ids[:-1])[-1]
        torch.testing.assert_close(runner.last_logits[row].float(), expected, atol=0.5, rtol=0.05)


def test_bf16_cpu_close_to_fp32(tiny_llama_dir):
    fp32 = tiny_runner(tiny_llama_dir)
    bf16 = tiny_runner(tiny_llama_dir, dtype="bfloat16")
    assert bf16.kv_cache.k.dtype == torch.bfloat16
    prompt = make_prompts(fp32.model_config.vocab_size, [24], seed=3)[0]
    torch.testing.assert_close(bf16.score(prompt), fp32.score(prompt), atol=0.5, rtol=0.05)


@pytest.mark.slow  # ~2 minutes: transformers dequantizes the GGUF itself
def test_smollm2_gguf_matches_transformers(smollm2_dir, smollm2_runner):
    ref = hf_model_from_gguf(next(smollm2_dir.glob("*.gguf")))
    tok = smollm2_runner.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    torch.testing.assert_close(smollm2_runner.score(prompt), hf_logits(ref, prompt),
                               atol=2e-3, rtol=1e-3)
    seq = generate(smollm2_runner, [prompt], GREEDY_32)[0]
    assert seq.output_token_ids == hf_greedy(ref, prompt, 32)


def test_smollm2_tokenizer_and_chat(smollm2_runner):
    tok = smollm2_runner.tokenizer
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    seq = generate(smollm2_runner, [ids], SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in seq.output_text
    assert seq.finish_reason == "stop"  # ends its turn with <|im_end|>
