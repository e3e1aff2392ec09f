"""The Llama family (Llama 2/3, SmolLM2, Mistral-style GQA) for batched serving.

Q, K and V are one fused column-parallel matmul, gate and up another; attention goes
through the paged cache (`attention.py`). Weights keep HF names and layout.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from distserve_engine import native
from distserve_engine.attention import AttentionMetadata, paged_attention
from distserve_engine.kv_cache import KVCache
from distserve_engine.model_config import ModelConfig
from distserve_engine.models.base import CausalLM, Loader, copy_into
from distserve_engine.models.layers import (
    PACKINGS,
    ColumnParallelLinear,
    RMSNorm,
    RopeTable,
    RotaryEmbedding,
    RowParallelLinear,
)
from distserve_engine.parallel import ParallelState


class LlamaAttention(nn.Module):
    """Multi-head attention with grouped KV heads and rotary positions."""

    def __init__(self, c: ModelConfig, state: ParallelState) -> None:
        super().__init__()
        self.num_heads = c.num_heads // state.tp  # local
        self.num_kv_heads = c.num_kv_heads // state.tp  # local
        self.head_dim = c.head_dim
        self.scale = c.head_dim**-0.5
        parts = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        self.qkv_proj = ColumnParallelLinear(c.hidden_size, parts, c.attention_bias, state)
        self.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, False, state)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rope: RopeTable,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden), or (len(rows), hidden): every row's keys and values
        go into the cache, the output projection runs for `rows` alone."""
        qkv = self.qkv_proj(x)  # (T, (H + 2 Hkv) * D)
        num_qk = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = qkv[:, :num_qk].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        RotaryEmbedding.rotate_(qk, rope)  # q's and k's heads at once, in place
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]  # (T, H, D), (T, Hkv, D)
        v = qkv[:, num_qk:].view(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # (T, H*D)
        return self.o_proj(out if rows is None else out[rows])


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, c: ModelConfig, state: ParallelState) -> None:
        super().__init__()
        size = c.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(c.hidden_size, [size, size], False, state)
        self.down_proj = RowParallelLinear(size, c.hidden_size, False, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden)."""
        gate_up = self.gate_up_proj(x)  # (T, 2 I/tp)
        kernel = native.for_dtype("swiglu", gate_up.dtype) if gate_up.device.type == "cpu" else None
        if kernel is not None and gate_up.is_contiguous():
            # NOTE: on one thread the results are packed into a contiguous (T, I/tp) at the
            # buffer's start: the GEMM reading the strided gate would copy it first (2.8 ms
            # a layer at a 2048-token prefill, a fresh 12 MiB and the copy)
            rows, width, threads = gate_up.shape[0], gate_up.shape[1] // 2, torch.get_num_threads()
            compact = threads == 1
            kernel(gate_up.data_ptr(), gate_up.stride(0), rows, width, compact, threads)
            hidden = gate_up.view(-1)[: rows * width].view(rows, width) if compact else gate_up[:, :width]
            return self.down_proj(hidden)  # silu(gate) * up
        gate, up = gate_up.chunk(2, dim=-1)  # (T, I/tp) each, views
        F.silu(gate, inplace=True)
        return self.down_proj(gate.mul_(up))  # a strided view: the GEMM reads it in place


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual."""

    def __init__(self, c: ModelConfig, state: ParallelState) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.self_attn = LlamaAttention(c, state)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = LlamaMLP(c, state)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rope: RopeTable,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden), or (len(rows), hidden) past the attention (see
        `CausalLM.forward`); adds to x in place (the residual stream is owned)."""
        attended = self.self_attn(self.input_layernorm(x), meta, rope, k_cache, v_cache, rows)
        if rows is not None:
            x = x[rows]  # a copy: the kept rows' residual stream
        x.add_(attended)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class LlamaForCausalLM(CausalLM):
    """One rank's share of a Llama model."""

    def __init__(self, config: ModelConfig, state: ParallelState) -> None:
        super().__init__(config, state)
        c = config
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, c.rope_scaling)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if state.is_first_stage else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, state) for _ in self.layer_range)
        if state.is_last_stage:
            self.norm = RMSNorm(c.hidden_size, c.norm_eps)
            self.lm_head = ColumnParallelLinear(c.hidden_size, [self.padded_vocab], False, state)
        self.share_tied_head(self.embed_tokens)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (T,) on the first stage, else hidden (T, hidden) -> hidden (T, hidden),
        or (len(rows), hidden) (see `CausalLM.forward`)."""
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x.clone()
        rope = self.rotary.table(meta.positions, hidden.dtype)  # once per step, not per layer
        if self._decode_in_c(hidden, meta, kv_cache, rope):  # never a prefill: rows is None
            return hidden
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, meta, rope, *kv_cache.layer(i), rows if i == last else None)
        return hidden  # every stage has a layer (`check_parallel_fits`)

    def _decode_in_c(self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                     rope: RopeTable) -> bool:
        """Run a decode step's layers by one C call (`native.llama_decode`, or its bfloat16
        twin on AMX: the same kernels the layers call, in the same order), updating hidden
        in place; False where it does not apply (CUDA, other dtypes, tp > 1, a prefill, more
        rows than a packed linear takes, a linear without its packed copy, shapes a
        bfloat16 kernel refuses) and the layers run one by one."""
        packing = PACKINGS.get(hidden.dtype)
        if (meta.is_context_new or meta.num_queries != 1 or packing is None
                or hidden.device.type != "cpu" or self.state.tp != 1
                or hidden.shape[0] > packing.max_rows or not self.layers):
            return False
        kernel = native.for_dtype("llama_decode", hidden.dtype)
        if kernel is None:
            return False
        weights = self._packed_decode_weights(hidden.dtype)
        k, v = kv_cache.k, kv_cache.v
        cos, signed_sin = rope
        if weights is None or not (k.is_contiguous() and v.is_contiguous()
                                   and cos.is_contiguous() and signed_sin.is_contiguous()):
            return False
        attention, c = self.layers[0].self_attn, self.config
        status = kernel(
            hidden.data_ptr(), hidden.shape[0], hidden.shape[1], len(self.layers), weights,
            c.norm_eps, k.data_ptr(), v.data_ptr(), k[0].numel(), meta.slot_mapping.data_ptr(),
            meta.block_tables.data_ptr(), meta.block_tables.shape[1], meta.context_lens.data_ptr(),
            k.shape[2], attention.num_heads, attention.num_kv_heads, attention.head_dim,
            self.layers[0].mlp.down_proj.in_features, cos.data_ptr(), signed_sin.data_ptr(),
            attention.scale, torch.get_num_threads())
        if status == -2:  # a kernel it runs would refuse these shapes: nothing was done
            return False
        if status != 0:
            raise MemoryError(f"decode step in C: no scratch memory for {hidden.shape[0]} sequences")
        return True

    def _packed_decode_weights(self, dtype: torch.dtype):
        """Per layer, the 7 pointers `native.llama_decode` reads (norms, packed linears,
        the qkv bias or NULL), made once; None where a linear has no packed copy of this
        dtype or o_proj has a bias."""
        if not hasattr(self, "_decode_weights"):
            pointers = []
            for layer in self.layers:
                attention, mlp = layer.self_attn, layer.mlp
                linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
                if any(getattr(m, "weight_packed", None) is None or m.weight_packed.dtype != dtype
                       for m in linears) or attention.o_proj.bias is not None:
                    self._decode_weights = None
                    return None
                bias = attention.qkv_proj.bias
                pointers += [layer.input_layernorm.weight.data_ptr(),
                             attention.qkv_proj.weight_packed.data_ptr(),
                             None if bias is None else bias.data_ptr(),
                             attention.o_proj.weight_packed.data_ptr(),
                             layer.post_attention_layernorm.weight.data_ptr(),
                             mlp.gate_up_proj.weight_packed.data_ptr(),
                             mlp.down_proj.weight_packed.data_ptr()]
            self._decode_weights = (ctypes.c_void_p * len(pointers))(*pointers)
        return self._decode_weights

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm; (B, hidden) -> (B, hidden)."""
        return self.norm(hidden)

    def weight_loaders(self) -> dict[str, list[Loader]]:
        """HF name -> loaders for this rank's stage and tp slices."""
        out: dict[str, list[Loader]] = {}
        if self.embed_tokens is not None:
            out["model.embed_tokens.weight"] = [copy_into(self.embed_tokens.weight)]
        if self.state.is_last_stage:
            out["model.norm.weight"] = [copy_into(self.norm.weight)]
            head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
            out.setdefault(head, []).append(self.lm_head_loader())
        for local, layer in enumerate(self.layers):
            prefix = f"model.layers.{self.layer_range[local]}."
            out.update(_layer_loaders(prefix, layer, self.config.attention_bias))
        return out


def _layer_loaders(prefix: str, layer: LlamaDecoderLayer, has_bias: bool) -> dict[str, list[Loader]]:
    attn, mlp = layer.self_attn, layer.mlp
    out: dict[str, list[Loader]] = {
        prefix + "input_layernorm.weight": [copy_into(layer.input_layernorm.weight)],
        prefix + "post_attention_layernorm.weight": [copy_into(layer.post_attention_layernorm.weight)],
        prefix + "self_attn.o_proj.weight": [attn.o_proj.load],
        prefix + "mlp.down_proj.weight": [mlp.down_proj.load],
    }
    for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
        out[f"{prefix}self_attn.{name}.weight"] = [lambda t, p=part: attn.qkv_proj.load(t, p)]
        if has_bias:
            out[f"{prefix}self_attn.{name}.bias"] = [
                lambda t, p=part: attn.qkv_proj.load(t, p, is_bias=True)
            ]
    for part, name in enumerate(("gate_proj", "up_proj")):
        out[f"{prefix}mlp.{name}.weight"] = [lambda t, p=part: mlp.gate_up_proj.load(t, p)]
    return out
