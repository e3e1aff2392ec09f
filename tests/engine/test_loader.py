"""Checkpoint discovery and GGUF specifics."""

from __future__ import annotations

import shutil

import pytest
import torch

from distserve_engine import config as engine_config
from distserve_engine.config import EngineConfig
from distserve_engine.loader import resolve_checkpoint, unpermute_rotary
from distserve_engine.model_config import ModelConfig


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's convert script does to Q/K rows (convert_hf_to_gguf.py)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(6 * 8, 5)
    for heads in (1, 3, 6):
        assert torch.equal(unpermute_rotary(llama_cpp_permute(w, heads), heads), w)


def test_smollm2_gguf_config(smollm2_dir):
    from distserve_engine.loader import load_model_config

    ckpt = resolve_checkpoint(str(smollm2_dir))
    assert ckpt.is_gguf and resolve_checkpoint(str(ckpt.gguf_path)).gguf_path == ckpt.gguf_path
    config = load_model_config(ckpt)
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == ("LlamaForCausalLM", 30, 9, 3, 64, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.weights_dtype == "quantized"  # Q4_1 matrices


def test_llama3_rope_scaling_from_transformers_5_config():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 8,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
    config = ModelConfig.from_hf(hf)
    assert config.rope_theta == 500000.0 and config.rope_scaling["rope_type"] == "llama3"
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from distserve_engine.models.layers import _scale_inv_freq

    hf_config = LlamaConfig(hidden_size=2048, num_attention_heads=16,
                            rope_parameters=hf["rope_parameters"])
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    torch.testing.assert_close(_scale_inv_freq(base, config.rope_scaling).float(), expected.float())


@pytest.mark.parametrize(("weights_dtype", "cpu_has_bf16", "expected"), [
    ("bfloat16", True, torch.bfloat16), ("float16", True, torch.bfloat16),
    ("quantized", True, torch.bfloat16), ("float32", True, torch.float32),
    (None, True, torch.float32), ("bfloat16", False, torch.float32),
    ("quantized", False, torch.float32),
])
def test_auto_dtype_on_the_cpu_is_bfloat16_for_half_weights_where_the_cpu_multiplies_it(
        weights_dtype, cpu_has_bf16, expected, monkeypatch):
    monkeypatch.setattr(engine_config, "cpu_multiplies_bfloat16", lambda: cpu_has_bf16)
    assert EngineConfig(model="m").torch_dtype(weights_dtype) == expected
    assert EngineConfig(model="m", dtype="float32").torch_dtype(weights_dtype) == torch.float32
    assert EngineConfig(model="m", device="cuda").torch_dtype(weights_dtype) == torch.bfloat16


def test_a_runner_of_a_bfloat16_checkpoint_runs_in_bfloat16_where_the_cpu_multiplies_it(
        tiny_llama_dir, tmp_path):
    from transformers import LlamaForCausalLM

    from distserve_engine.loader import load_model_config
    from distserve_engine.runner import ModelRunner

    assert load_model_config(resolve_checkpoint(str(tiny_llama_dir))).weights_dtype == "float32"
    half = tmp_path / "half"
    LlamaForCausalLM.from_pretrained(tiny_llama_dir).to(torch.bfloat16).save_pretrained(half)
    for name in tiny_llama_dir.iterdir():
        if not (half / name.name).exists():
            shutil.copy(name, half / name.name)
    assert load_model_config(resolve_checkpoint(str(half))).weights_dtype == "bfloat16"
    expected = torch.bfloat16 if engine_config.cpu_multiplies_bfloat16() else torch.float32
    runner = ModelRunner(EngineConfig(model=str(half), kv_cache_bytes=1 << 20))
    assert runner.dtype == expected and runner.kv_cache.k.dtype == expected
    assert ModelRunner(EngineConfig(model=str(tiny_llama_dir), kv_cache_bytes=1 << 20)).dtype \
        == torch.float32
