"""OPT (the paper's evaluation models) for batched serving.

Differs from Llama in learned positions (offset by 2), LayerNorm with bias, ReLU MLP,
biased projections, optional post-norm (`do_layer_norm_before=False`, OPT-350m) and an
optional projection between the embedding width and the hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distserve_engine.attention import AttentionMetadata, paged_attention
from distserve_engine.kv_cache import KVCache
from distserve_engine.model_config import ModelConfig
from distserve_engine.models.base import CausalLM, Loader, copy_into
from distserve_engine.models.layers import ColumnParallelLinear, RowParallelLinear
from distserve_engine.parallel import ParallelState

# OPT's learned position table has two extra leading rows (a fairseq padding legacy).
POSITION_OFFSET = 2
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


class OPTDecoderLayer(nn.Module):
    """Attention then ReLU MLP, pre- or post-norm, each with a residual."""

    def __init__(self, c: ModelConfig, state: ParallelState) -> None:
        super().__init__()
        self.num_heads = c.num_heads // state.tp
        self.head_dim = c.head_dim
        self.is_pre_norm = c.do_layer_norm_before
        self.act = ACTIVATIONS[c.activation]
        h = c.hidden_size
        self.qkv_proj = ColumnParallelLinear(h, [h, h, h], c.attention_bias, state)
        self.out_proj = RowParallelLinear(h, h, c.attention_bias, state)
        self.self_attn_layer_norm = nn.LayerNorm(h)
        self.fc1 = ColumnParallelLinear(h, [c.intermediate_size], c.attention_bias, state)
        self.fc2 = RowParallelLinear(c.intermediate_size, h, c.attention_bias, state)
        self.final_layer_norm = nn.LayerNorm(h)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden), or (len(rows), hidden) past the attention (see
        `CausalLM.forward`)."""
        h = self.self_attn_layer_norm(x) if self.is_pre_norm else x
        q, k, v = self.qkv_proj(h).split(self.qkv_proj.local_sizes, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)  # (T, H, D)
        attn = paged_attention(q.view(shape), k.view(shape), v.view(shape), k_cache, v_cache,
                               meta, self.head_dim**-0.5)  # (T, H*D)
        if rows is not None:
            attn, x = attn[rows], x[rows]
        x = x + self.out_proj(attn)
        if not self.is_pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.is_pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.is_pre_norm else self.final_layer_norm(x)


class OPTForCausalLM(CausalLM):
    """One rank's share of an OPT model."""

    def __init__(self, config: ModelConfig, state: ParallelState) -> None:
        super().__init__(config, state)
        c = config
        is_projected = c.word_embed_proj_dim != c.hidden_size
        if state.is_first_stage:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.word_embed_proj_dim)
            self.embed_positions = nn.Embedding(c.max_position + POSITION_OFFSET, c.hidden_size)
            self.project_in = nn.Linear(c.word_embed_proj_dim, c.hidden_size, bias=False) \
                if is_projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(c, state) for _ in self.layer_range)
        if state.is_last_stage:
            self.final_layer_norm = nn.LayerNorm(c.hidden_size) if c.do_layer_norm_before else None
            self.project_out = nn.Linear(c.hidden_size, c.word_embed_proj_dim, bias=False) \
                if is_projected else None
            self.lm_head = ColumnParallelLinear(c.word_embed_proj_dim, [self.padded_vocab],
                                                False, state)
        self.share_tied_head(self.embed_tokens if state.is_first_stage else None)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (T,) on the first stage, else hidden (T, hidden) -> hidden (T, hidden),
        or (len(rows), hidden) (see `CausalLM.forward`)."""
        if self.state.is_first_stage:
            embeds = self.embed_tokens(x)  # (T, word_embed_proj_dim)
            if self.project_in is not None:
                embeds = self.project_in(embeds)
            x = embeds + self.embed_positions(meta.positions + POSITION_OFFSET)  # (T, hidden)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, meta, *kv_cache.layer(i), rows if i == last else None)
        return x  # every stage has a layer (`check_parallel_fits`)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and projection; (B, hidden) -> (B, word_embed_proj_dim)."""
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        return hidden if self.project_out is None else self.project_out(hidden)

    def normalize_name(self, name: str) -> str:
        """Older OPT checkpoints drop the leading 'model.'."""
        return "model." + name if name.startswith("decoder.") else name

    def weight_loaders(self) -> dict[str, list[Loader]]:
        """HF name -> loaders for this rank's stage and tp slices."""
        out: dict[str, list[Loader]] = {}
        d = "model.decoder."
        if self.state.is_first_stage:
            out[d + "embed_tokens.weight"] = [copy_into(self.embed_tokens.weight)]
            out[d + "embed_positions.weight"] = [copy_into(self.embed_positions.weight)]
            if self.project_in is not None:
                out[d + "project_in.weight"] = [copy_into(self.project_in.weight)]
        if self.state.is_last_stage:
            if self.final_layer_norm is not None:
                out.update(_norm_loaders(d + "final_layer_norm.", self.final_layer_norm))
            if self.project_out is not None:
                out[d + "project_out.weight"] = [copy_into(self.project_out.weight)]
            head = d + "embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
            out.setdefault(head, []).append(self.lm_head_loader())
        for local, layer in enumerate(self.layers):
            out.update(_layer_loaders(f"{d}layers.{self.layer_range[local]}.", layer))
        return out


def _norm_loaders(prefix: str, norm: nn.LayerNorm) -> dict[str, list[Loader]]:
    return {prefix + "weight": [copy_into(norm.weight)], prefix + "bias": [copy_into(norm.bias)]}


def _layer_loaders(prefix: str, layer: OPTDecoderLayer) -> dict[str, list[Loader]]:
    out = _norm_loaders(prefix + "self_attn_layer_norm.", layer.self_attn_layer_norm)
    out.update(_norm_loaders(prefix + "final_layer_norm.", layer.final_layer_norm))
    for kind in ("weight", "bias"):
        is_bias = kind == "bias"
        for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{prefix}self_attn.{name}.{kind}"] = [
                lambda t, p=part, b=is_bias: layer.qkv_proj.load(t, p, is_bias=b)
            ]
        out[f"{prefix}self_attn.out_proj.{kind}"] = [
            lambda t, b=is_bias: layer.out_proj.load(t, is_bias=b)
        ]
        out[f"{prefix}fc1.{kind}"] = [lambda t, b=is_bias: layer.fc1.load(t, is_bias=b)]
        out[f"{prefix}fc2.{kind}"] = [lambda t, b=is_bias: layer.fc2.load(t, is_bias=b)]
    return out
