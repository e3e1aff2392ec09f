"""Model architectures: the shapes that decide a model's FLOPs, weight bytes and KV bytes.

A `ModelArch` holds only what the planner needs (layers, widths, heads, vocabulary),
never weights. The built-in entries cover the paper's OPT models, the Llama family and
SmolLM2-135M (the model the local launcher runs on a CPU); any other decoder-only model
comes in through its Hugging Face `config.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer's shape."""

    name: str  # Hugging Face id, e.g. "facebook/opt-66b"
    architecture: str  # "opt" (learned positions, tied embeddings) or "llama" (RoPE, SwiGLU)
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # < num_heads under grouped-query attention
    head_dim: int
    ffn_size: int
    vocab_size: int
    max_position: int
    dtype_bytes: int = 2  # served in fp16/bf16
    gated_ffn: bool = False  # SwiGLU: three FFN matrices instead of two
    tie_word_embeddings: bool = True  # the LM head shares the input embedding

    @property
    def q_size(self) -> int:
        """Width of the query projection (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of one of the key or value projections (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_gemm_params(self) -> int:
        """Parameters of one layer's matrices: Q, K, V, O projections and the FFN."""
        attn = self.hidden_size * (2 * self.q_size + 2 * self.kv_size)
        ffn = (3 if self.gated_ffn else 2) * self.hidden_size * self.ffn_size
        return attn + ffn

    @property
    def layer_params(self) -> int:
        """All parameters of one layer, biases and norms included."""
        h = self.hidden_size
        if self.architecture == "opt":
            # biases on every projection and both FFN matrices, two LayerNorms (weight+bias)
            small = 2 * self.q_size + 2 * self.kv_size + self.ffn_size + h + 4 * h
        else:
            small = 2 * h  # two RMSNorm weights, no biases
        return self.layer_gemm_params + small

    @property
    def embedding_params(self) -> int:
        """Token embedding, learned positions (OPT), final norm and an untied LM head."""
        params = self.vocab_size * self.hidden_size + 2 * self.hidden_size
        if self.architecture == "opt":
            params += (self.max_position + 2) * self.hidden_size  # OPT offsets positions by 2
        if not self.tie_word_embeddings:
            params += self.vocab_size * self.hidden_size
        return params

    @property
    def param_count(self) -> int:
        """Total parameters."""
        return self.num_layers * self.layer_params + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in the serving dtype."""
        return self.param_count * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def _opt(name: str, layers: int, hidden: int, heads: int) -> ModelArch:
    return ModelArch(
        name=name,
        architecture="opt",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        ffn_size=4 * hidden,
        vocab_size=50272,
        max_position=2048,
    )


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    max_position: int,
    tie: bool = False,
) -> ModelArch:
    return ModelArch(
        name=name,
        architecture="llama",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        ffn_size=ffn,
        vocab_size=vocab,
        max_position=max_position,
        gated_ffn=True,
        tie_word_embeddings=tie,
    )


BUILTIN_MODELS: tuple[ModelArch, ...] = (
    _opt("facebook/opt-13b", 40, 5120, 40),
    _opt("facebook/opt-66b", 64, 9216, 72),
    _opt("facebook/opt-175b", 96, 12288, 96),
    _llama("meta-llama/Llama-2-7b-hf", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("meta-llama/Llama-2-13b-hf", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("meta-llama/Llama-2-70b-hf", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("meta-llama/Meta-Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("meta-llama/Meta-Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, 8192),
    _llama("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 576, 9, 3, 1536, 49152, 8192, tie=True),
)

# Short names a user may type; matched case-insensitively like the full ids.
_ALIASES: dict[str, str] = {
    "opt-13b": "facebook/opt-13b",
    "opt-66b": "facebook/opt-66b",
    "opt-175b": "facebook/opt-175b",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "meta-llama/llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "meta-llama/llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "meta-llama/llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "meta-llama/llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "meta-llama/llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "huggingfacetb/smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}

_NAME_TO_MODEL: dict[str, ModelArch] = {m.name.lower(): m for m in BUILTIN_MODELS}
for _alias, _full in _ALIASES.items():
    _NAME_TO_MODEL[_alias] = _NAME_TO_MODEL[_full.lower()]


def known_models() -> list[str]:
    """Names `get_model` accepts besides config paths: full ids and short aliases."""
    return [m.name for m in BUILTIN_MODELS] + sorted(_ALIASES)


def get_model(name_or_path: str | Path | ModelArch) -> ModelArch:
    """A built-in model by id or alias (any case), or one read from a `config.json` path.

    Raises ValueError naming the known models when the name is neither.
    """
    if isinstance(name_or_path, ModelArch):
        return name_or_path
    key = str(name_or_path).strip()
    model = _NAME_TO_MODEL.get(key.lower())
    if model is not None:
        return model
    path = Path(key).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        model = model_from_hf_config(path)
        # NOTE: callers pass the model on by name (the planner's SearchContext); remember
        # it so that the name resolves too, here and in the worker processes forked later.
        _NAME_TO_MODEL.setdefault(model.name.lower(), model)
        return model
    raise ValueError(
        f"unknown model {key!r}: expected one of {', '.join(known_models())}, "
        "or a path to a Hugging Face config.json (or a folder holding one)"
    )


def model_from_hf_config(path: str | Path) -> ModelArch:
    """A `ModelArch` from a Hugging Face `config.json` (OPT, or Llama-style with GQA)."""
    path = Path(path)
    config = json.loads(path.read_text())
    name = config.get("_name_or_path") or path.parent.name or path.stem
    model_type = str(config.get("model_type", "")).lower()
    try:
        if model_type == "opt":
            return _opt_from_config(name, config)
        return _llama_from_config(name, config)
    except KeyError as err:
        raise ValueError(f"{path}: config.json lacks the field {err.args[0]!r}") from None


def _opt_from_config(name: str, config: dict) -> ModelArch:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return ModelArch(
        name=name,
        architecture="opt",
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        ffn_size=int(config["ffn_dim"]),
        vocab_size=int(config["vocab_size"]),
        max_position=int(config.get("max_position_embeddings", 2048)),
    )


def _llama_from_config(name: str, config: dict) -> ModelArch:
    """Llama, Mistral, Qwen2 and other RoPE + SwiGLU decoders share these fields."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return ModelArch(
        name=name,
        architecture="llama",
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        ffn_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        max_position=int(config.get("max_position_embeddings", 4096)),
        gated_ffn=True,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
