"""Reference implementations from `transformers` to compare the engine against."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(folder: Path):
    """transformers' model for an HF folder, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_model_from_gguf(gguf_path: Path):
    """transformers' Llama with weights dequantized by transformers' own GGUF reader."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    config = {k: v for k, v in meta["config"].items() if not k.startswith("_")}
    model = LlamaForCausalLM(LlamaConfig(**config))
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """(T, V) logits at every position."""
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, token_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation with transformers' own KV cache (no EOS stop)."""
    out = model(torch.tensor([token_ids]), use_cache=True)
    generated = []
    for _ in range(num_tokens):
        generated.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[generated[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return generated
