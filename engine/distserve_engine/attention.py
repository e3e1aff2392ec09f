"""Attention over the paged KV cache for a batch of variable-length sequences.

The runner describes a batch once (`AttentionMetadata`, built with index tensors); each
layer then writes its new K/V into the cache by slot, gathers every sequence's context
by block table into a padded (B, K) view, and calls torch SDPA with a causal,
length-aware mask. No layer loops over tokens or sequences in Python. A prefill whose
context is only the batch's own tokens skips the gather and attends to the new K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Index tensors describing one batch: B sequences, T new tokens in total."""

    positions: torch.Tensor  # (T,) position of each new token in its sequence
    slot_mapping: torch.Tensor  # (T,) cache slot (block_id * block_size + offset) of each
    block_tables: torch.Tensor  # (B, max_blocks) block ids, padded with 0
    query_index: torch.Tensor | None  # (B, Qmax) flat token index per padded query; None: Q=1
    output_index: torch.Tensor | None  # (T,) flat (B*Qmax) index of each real token
    attn_mask: torch.Tensor | None  # (B, 1, Qmax, K) True where a query may attend a key;
    # None for a single new sequence: plain causal, which lets SDPA pick a flash kernel
    logits_index: torch.Tensor  # (B,) flat index of each sequence's last new token
    is_context_new: bool  # every key is a new token of this batch: skip the cache gather


def build_metadata(
    starts: list[int], num_new: list[int], block_tables: list[list[int]], block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Describe a batch where sequence i adds num_new[i] tokens after starts[i] cached ones."""
    starts_t = torch.tensor(starts, dtype=torch.long)  # (B,)
    lens_t = torch.tensor(num_new, dtype=torch.long)  # (B,)
    q_max = max(num_new)
    steps = torch.arange(q_max)[None, :]  # (1, Qmax)
    is_valid = steps < lens_t[:, None]  # (B, Qmax)
    q_pos = torch.where(is_valid, starts_t[:, None] + steps, 0)  # (B, Qmax); pads sit at 0
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables])  # (B, nb)
    slots = tables.gather(1, q_pos // block_size) * block_size + q_pos % block_size
    is_context_new = all(s == 0 for s in starts)
    num_keys = q_max if is_context_new else max_blocks * block_size
    mask = torch.arange(num_keys)[None, None, :] <= q_pos[:, :, None]  # (B, Qmax, K)
    first_index = torch.cumsum(lens_t, 0) - lens_t  # (B,) flat index of each seq's first token
    if q_max == 1:
        query_index = output_index = None
    else:
        query_index = torch.where(is_valid, first_index[:, None] + steps, 0).to(device)
        output_index = is_valid.flatten().nonzero().squeeze(1).to(device)
    return AttentionMetadata(
        positions=q_pos[is_valid].to(device),
        slot_mapping=slots[is_valid].to(device),
        block_tables=tables.to(device),
        query_index=query_index,
        output_index=output_index,
        attn_mask=None if is_context_new and len(starts) == 1 else mask[:, None].to(device),
        logits_index=(first_index + lens_t - 1).to(device),
        is_context_new=is_context_new,
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """q (T, H, D), k/v (T, Hkv, D), caches (NB, bs, Hkv, D) -> output (T, H*D).

    Writes k/v into the cache at meta.slot_mapping before attending.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    batch = meta.logits_index.shape[0]
    if meta.query_index is None:
        queries = q.view(batch, 1, num_heads, head_dim)  # (B, 1, H, D)
    else:
        queries = q[meta.query_index]  # (B, Qmax, H, D)
    if meta.is_context_new:
        index = meta.query_index if meta.query_index is not None else torch.arange(batch, device=q.device)[:, None]
        keys, values = k[index], v[index]  # (B, Qmax, Hkv, D)
    else:
        keys = _gather_context(k_cache, meta.block_tables)  # (B, K, Hkv, D)
        values = _gather_context(v_cache, meta.block_tables)  # (B, K, Hkv, D)
    is_gqa = num_heads != num_kv_heads
    if is_gqa and q.is_cuda:
        # NOTE: CUDA's fused kernels take a mask or GQA but not both; expand KV heads instead.
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=2)  # (B, K, H, D)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=2)
        is_gqa = False
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=meta.attn_mask, is_causal=meta.attn_mask is None, scale=scale,
        enable_gqa=is_gqa,
    )  # (B, H, Qmax, D)
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)  # (B*Qmax, H*D)
    return out if meta.output_index is None else out[meta.output_index]  # (T, H*D)


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    batch, max_blocks = block_tables.shape
    blocks = cache.index_select(0, block_tables.flatten())  # (B*nb, bs, Hkv, D)
    return blocks.view(batch, max_blocks * cache.shape[1], cache.shape[2], cache.shape[3])
