"""Checkpoint discovery and GGUF specifics."""

from __future__ import annotations

import torch

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
