"""Bad input fails early with a ValueError naming what was wrong; the runner stays usable."""

from __future__ import annotations

import json
import shutil

import pytest
from test_correctness import tiny_runner

from distserve_engine.config import EngineConfig
from distserve_engine.errors import (
    CheckpointError,
    EngineError,
    KVBudgetError,
    OutOfBlocksError,
    PromptTooLongError,
    UnsupportedArchitectureError,
)
from distserve_engine.generate import generate
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence


def copy_checkpoint(src, dst, skip: tuple[str, ...] = ()):
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


def test_prompt_longer_than_context_then_runner_still_works(tiny_llama_dir):
    runner = tiny_runner(tiny_llama_dir, max_model_len=64)
    with pytest.raises(PromptTooLongError, match="65 tokens.*context of 64"):
        runner.prefill([Sequence(0, [5] * 65)])
    assert runner.block_manager.num_free_blocks == runner.num_blocks
    seq = generate(runner, [[5] * 60], SamplingParams(max_tokens=10, temperature=0))[0]
    assert seq.finish_reason == "length" and seq.num_tokens == 64


def test_bad_token_ids_and_empty_prompt(tiny_llama_dir):
    runner = tiny_runner(tiny_llama_dir)
    with pytest.raises(EngineError, match=r"token ids must be in \[0, 384\)"):
        runner.prefill([Sequence(0, [5, 384])])
    with pytest.raises(EngineError, match="empty"):
        runner.prefill([Sequence(0, [])])


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    folder = copy_checkpoint(tiny_llama_dir, tmp_path / "gpt9")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT9ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="GPT9ForCausalLM.*LlamaForCausalLM"):
        ModelRunner(EngineConfig(model=str(folder)))


@pytest.mark.parametrize("skip, message", [
    (("config.json",), "missing config.json"),
    (("model.safetensors",), r"missing \*.safetensors"),
    (("tokenizer.json", "tokenizer_config.json"), "missing tokenizer files"),
])
def test_checkpoint_folder_missing_files(tiny_llama_dir, tmp_path, skip, message):
    folder = copy_checkpoint(tiny_llama_dir, tmp_path / "partial", skip)
    with pytest.raises(CheckpointError, match=message):
        ModelRunner(EngineConfig(model=str(folder)))


def test_missing_path_and_missing_weight(tiny_llama_dir, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelRunner(EngineConfig(model=str(tmp_path / "nope")))
    from safetensors.torch import load_file, save_file

    folder = copy_checkpoint(tiny_llama_dir, tmp_path / "noweight")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing 1 weights: model.layers.1.mlp.down_proj"):
        ModelRunner(EngineConfig(model=str(folder)))


def test_memory_budget_too_small_for_one_sequence(tiny_llama_dir):
    # tiny llama: 2 layers * 2 KV heads * 16 dims * 2 (K, V) * 4 bytes = 512 bytes a token
    with pytest.raises(KVBudgetError, match="kv_cache_bytes.*512-token sequence needs 32 blocks"):
        ModelRunner(EngineConfig(model=str(tiny_llama_dir), kv_cache_bytes=100_000))
    runner = ModelRunner(EngineConfig(model=str(tiny_llama_dir), kv_cache_bytes=512 * 512 * 3))
    assert runner.num_blocks == 96 and runner.kv_bytes_per_token == 512


def test_bad_config_values_name_the_field():
    for kwargs, field in [({"device": "tpu"}, "device"), ({"dtype": "float16"}, "dtype"),
                          ({"block_size": 0}, "block_size"), ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
                          ({"prefill_warmup_tokens": -1}, "prefill_warmup_tokens")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="x", **kwargs)


def test_out_of_blocks_allocates_nothing(tiny_llama_dir):
    runner = tiny_runner(tiny_llama_dir)  # 64 blocks of 16 tokens
    seqs = [Sequence(i, [5] * 400) for i in range(3)]  # 25 blocks each
    assert runner.can_allocate(400) and not runner.can_allocate(64 * 16 + 1)
    with pytest.raises(OutOfBlocksError, match="75 blocks needed, 64 free"):
        runner.prefill(seqs)
    assert runner.block_manager.num_free_blocks == 64
    assert all(not s.block_table for s in seqs)
    runner.prefill(seqs[:2])
    assert runner.block_manager.num_free_blocks == 14
