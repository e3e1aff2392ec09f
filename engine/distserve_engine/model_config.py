"""The architecture of a checkpoint, read from an HF `config.json` or GGUF metadata.

One flat dataclass covers the Llama family and OPT; fields an architecture does not use
keep their defaults. Parsing fails with a `CheckpointError` naming the missing key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distserve_engine.errors import CheckpointError

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCH_TO_HF = {"llama": "LlamaForCausalLM"}


@dataclass
class ModelConfig:
    """Shapes and constants of one decoder-only transformer."""

    architecture: str  # HF name, e.g. "LlamaForCausalLM", "OPTForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position: int  # context length the model was trained for
    head_dim: int = 0  # 0 means hidden_size // num_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # OPT only
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 0  # 0 means hidden_size
    activation: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    # The dtype the weight matrices are stored in ("float32", "float16", "bfloat16", or
    # "quantized" for a GGUF's block formats); None where the checkpoint does not say.
    weights_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.word_embed_proj_dim == 0:
            self.word_embed_proj_dim = self.hidden_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse an HF `config.json` dict."""
        architectures = hf.get("architectures") or [hf.get("model_type", "<none>")]
        arch = architectures[0]
        try:
            if arch == "OPTForCausalLM":
                return cls._from_hf_opt(hf)
            return cls._from_hf_llama_like(arch, hf)
        except KeyError as e:
            raise CheckpointError(f"config.json: missing key {e.args[0]!r} for {arch}") from e

    @classmethod
    def _from_hf_llama_like(cls, arch: str, hf: dict[str, Any]) -> ModelConfig:
        num_heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}  # transformers >= 5 folds rope_scaling in here
        scaling = hf.get("rope_scaling") or rope or None
        if scaling and (scaling.get("rope_type") or scaling.get("type") or "default") == "default":
            scaling = None  # the theta alone: no scaling, as a GGUF or an older config says
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            intermediate_size=hf["intermediate_size"],
            max_position=hf.get("max_position_embeddings", 2048),
            head_dim=hf.get("head_dim") or 0,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            activation=hf.get("hidden_act", "silu"),
            eos_token_ids=_as_list(hf.get("eos_token_id")),
            weights_dtype=_hf_dtype(hf),
        )

    @classmethod
    def _from_hf_opt(cls, hf: dict[str, Any]) -> ModelConfig:
        num_heads = hf["num_attention_heads"]
        return cls(
            architecture="OPTForCausalLM",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads,
            intermediate_size=hf["ffn_dim"],
            max_position=hf["max_position_embeddings"],
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            attention_bias=hf.get("enable_bias", True),
            do_layer_norm_before=hf.get("do_layer_norm_before", True),
            word_embed_proj_dim=hf.get("word_embed_proj_dim") or hf["hidden_size"],
            activation=hf.get("activation_function", "relu"),
            eos_token_ids=_as_list(hf.get("eos_token_id")),
            weights_dtype=_hf_dtype(hf),
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str],
                  weights_dtype: str | None = None) -> ModelConfig:
        """Parse GGUF metadata (key -> value) of a llama-architecture file
        (`weights_dtype`: as the file's tensor types say, `loader.gguf_weights_dtype`)."""
        gguf_arch = meta.get("general.architecture", "<none>")
        arch = GGUF_ARCH_TO_HF.get(gguf_arch, f"gguf:{gguf_arch}")
        p = f"{gguf_arch}."
        try:
            num_heads = int(meta[p + "attention.head_count"])
            hidden = int(meta[p + "embedding_length"])
            vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
            return cls(
                architecture=arch,
                vocab_size=int(vocab),
                hidden_size=hidden,
                num_layers=int(meta[p + "block_count"]),
                num_heads=num_heads,
                num_kv_heads=int(meta.get(p + "attention.head_count_kv", num_heads)),
                intermediate_size=int(meta[p + "feed_forward_length"]),
                max_position=int(meta.get(p + "context_length", 2048)),
                head_dim=int(meta.get(p + "attention.key_length", hidden // num_heads)),
                norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
                rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
                tie_word_embeddings="output.weight" not in tensor_names,
                eos_token_ids=_as_list(meta.get("tokenizer.ggml.eos_token_id")),
                weights_dtype=weights_dtype,
            )
        except KeyError as e:
            raise CheckpointError(f"GGUF metadata: missing key {e.args[0]!r}") from e


def _hf_dtype(hf: dict[str, Any]) -> str | None:
    """config.json's dtype (`torch_dtype`; `dtype` from transformers 5), where it is a name."""
    value = hf.get("torch_dtype") or hf.get("dtype")
    return value.removeprefix("torch.") if isinstance(value, str) else None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
