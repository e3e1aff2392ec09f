"""Attention over the paged KV cache for a batch of variable-length sequences.

The runner describes a batch once per step (`AttentionMetadata`: index tensors, the mask,
buffers the layers share); every layer then writes its new K/V into the cache by slot
and attends by one of these paths, chosen by what the batch is:

- a prefill whose context is only its own new tokens: on the CPU in float32, a C kernel
  (`native.py`) over the unpadded new K/V, each query over its own keys; otherwise SDPA
  over the new K/V, causal and without a mask (a right-padded query only reaches keys at
  or before it, so padding never reaches a real query), and with no padding copy when
  the lengths are equal;
- a decode step on the CPU in float32: a C kernel (`native.py`) reads each sequence's
  keys and values in place through the block table, nothing is gathered;
- a decode step on the CPU otherwise (other dtypes, no C compiler): each sequence's
  context is gathered block by block into two buffers every layer reuses, then one
  batched matmul per KV head scores it (grouped query heads share their KV head, nothing
  is repeated);
- a decode step on CUDA with FlashAttention installed: its kernel reads the cache
  through the block table (`flash_paged.py`), nothing is gathered;
- anything else (a cached prefix, CUDA without FlashAttention): gather, then SDPA with a
  length-aware mask.
No layer loops over tokens or sequences in Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from distserve_engine import flash_paged, native


@dataclass
class AttentionMetadata:
    """Index tensors describing one batch: B sequences, T new tokens in total."""

    positions: torch.Tensor  # (T,) position of each new token in its sequence
    slot_mapping: torch.Tensor  # (T,) cache slot (block_id * block_size + offset) of each
    block_tables: torch.Tensor  # (B, max_blocks) block ids, padded with 0
    context_lens: torch.Tensor  # (B,) tokens in each sequence's context after this step
    query_index: torch.Tensor | None  # (B, Qmax) flat token index per padded query;
    # None when every sequence adds the same number of tokens (T = B * Qmax, no padding)
    output_index: torch.Tensor | None  # (T,) flat (B*Qmax) index of each real token
    attn_mask: torch.Tensor | None  # (B, 1, Qmax, K) True where a query may attend a key;
    # None when the context is new: causal alone is right and lets SDPA skip half the work
    logits_index: torch.Tensor  # (B,) flat index of each sequence's last new token
    is_context_new: bool  # every key is a new token of this batch: skip the cache gather
    num_queries: int  # Qmax: the most new tokens of one sequence (1 in a decode step)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # per-step scratch the
    # layers share (the gathered context, the decode bias); never read across steps

    @property
    def batch(self) -> int:
        """B: the number of sequences."""
        return self.logits_index.shape[0]


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
    tables = torch.tensor(pad_block_tables(block_tables, 0))  # (B, nb)
    slots = tables.gather(1, q_pos // block_size) * block_size + q_pos % block_size
    is_context_new = all(s == 0 for s in starts)
    first_index = torch.cumsum(lens_t, 0) - lens_t  # (B,) flat index of each seq's first token
    is_uniform = min(num_new) == q_max
    query_index = output_index = mask = None
    if not is_uniform:
        query_index = torch.where(is_valid, first_index[:, None] + steps, 0).to(device)
        output_index = is_valid.flatten().nonzero().squeeze(1).to(device)
    if not is_context_new:
        num_keys = tables.shape[1] * block_size
        mask = (torch.arange(num_keys)[None, None, :] <= q_pos[:, :, None])[:, None].to(device)
    return AttentionMetadata(
        positions=(q_pos if is_uniform else q_pos[is_valid]).flatten().to(device),
        slot_mapping=(slots if is_uniform else slots[is_valid]).flatten().to(device),
        block_tables=tables.to(device),
        context_lens=(starts_t + lens_t).to(device),
        query_index=query_index,
        output_index=output_index,
        attn_mask=mask,
        logits_index=(first_index + lens_t - 1).to(device),
        is_context_new=is_context_new,
        num_queries=q_max,
    )


def pad_block_tables(block_tables: list[list[int]], pad_id: int) -> list[list[int]]:
    """Block tables as rows of equal length, the short ones padded with pad_id."""
    width = max(len(t) for t in block_tables)
    return [t + [pad_id] * (width - len(t)) for t in block_tables]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' k/v (T, Hkv, D) into the caches (NB, bs, Hkv, D) by slot."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """q (T, H, D), k/v (T, Hkv, D), caches (NB, bs, Hkv, D) -> output (T, H*D).

    Writes k/v into the cache at meta.slot_mapping before attending.
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_context_new:
        return _attend_new(q, k, v, meta, scale)
    if meta.num_queries == 1 and not q.is_cuda:
        kernel = None
        if k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype:
            kernel = native.for_dtype("paged_decode", q.dtype)
        if kernel is not None:
            out = _decode_native(kernel, q, k_cache, v_cache, meta, scale)
            if out is not None:
                return out
        return _decode_cpu(q, k_cache, v_cache, meta, scale)
    if meta.num_queries == 1 and flash_paged.can_use(q, k_cache):
        return flash_paged.decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    return _attend_gathered(q, k_cache, v_cache, meta, scale)


def _padded(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """(T, n, D) -> (B, Qmax, n, D): a view when no sequence is padded, else a copy."""
    if meta.query_index is None:
        return x.view(meta.batch, meta.num_queries, x.shape[1], x.shape[2])
    return x[meta.query_index]


def _unpadded(out: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """SDPA's (B, H, Qmax, D) -> (T, H*D) over the real queries."""
    batch, num_heads, q_max, head_dim = out.shape
    out = out.transpose(1, 2).reshape(batch * q_max, num_heads * head_dim)  # (B*Qmax, H*D)
    return out if meta.output_index is None else out[meta.output_index]


def _sdpa(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
          mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """(B, Q, H, D), (B, K, Hkv, D) x2 -> (B, H, Q, D); causal when mask is None."""
    num_heads, num_kv_heads = queries.shape[2], keys.shape[2]
    is_gqa = num_heads != num_kv_heads
    if is_gqa and queries.is_cuda and mask is not None:
        # NOTE: CUDA's fused kernels take a mask or GQA but not both; expand KV heads instead
        # (expand and reshape, as repeat_interleave does, with no host sync: graph-safe).
        keys, values = (_repeat_kv_heads(t, num_heads // num_kv_heads) for t in (keys, values))
        is_gqa = False
    return F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=is_gqa,
    )  # (B, H, Q, D)


def _repeat_kv_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, K, Hkv, D) -> (B, K, Hkv * group, D), each KV head repeated for its query heads."""
    batch, num_keys, num_kv_heads, head_dim = x.shape
    expanded = x[:, :, :, None, :].expand(batch, num_keys, num_kv_heads, group, head_dim)
    return expanded.reshape(batch, num_keys, num_kv_heads * group, head_dim)


def _attend_new(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
    """A prefill over new tokens only: causal attention over the batch's own K/V (on the
    CPU the C kernel, unpadded: float32's, or bfloat16's on AMX's tiles where the CPU has
    them and the head is one it takes; else SDPA over the padded batch)."""
    num_tokens, num_heads, head_dim = q.shape
    kernel = native.for_dtype("prefill_attention", q.dtype) if (
        q.device.type == "cpu" and head_dim % 8 == 0) else None
    if kernel is not None and k.stride(0) == v.stride(0) and all(
            t.stride(-1) == 1 and t.stride(-2) == head_dim for t in (q, k, v)):
        out = q.new_empty(num_tokens, num_heads * head_dim)
        lens = meta.context_lens  # int64, contiguous: a new context is the new tokens
        status = kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), lens.data_ptr(), lens.shape[0],
                        num_heads, k.shape[1], head_dim, q.stride(0), k.stride(0), scale,
                        out.data_ptr(), torch.get_num_threads())
        if status == -1:
            raise MemoryError(f"prefill attention: no scratch memory for {lens.shape[0]} "
                              f"sequences of up to {meta.num_queries} tokens")
        if status == 0:
            return out
        # -2: a head the kernel does not take (bfloat16's: head_dim a multiple of 32 up to 128)
    out = _sdpa(_padded(q, meta), _padded(k, meta), _padded(v, meta), None, scale)
    return _unpadded(out, meta)


def _attend_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Any batch: gather each sequence's padded context, SDPA with the length mask."""
    keys, values = gather_context(k_cache, v_cache, meta)  # (B, K, Hkv, D) each
    out = _sdpa(_padded(q, meta), keys, values, meta.attn_mask, scale)
    return _unpadded(out, meta)


def _decode_native(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One new token per sequence, float32 or bfloat16, by the C kernel over the paged
    cache; None where the kernel does not take this head size (bfloat16's over 512)."""
    batch, num_heads, head_dim = q.shape
    q = q.contiguous()  # q is a view of the fused qkv projection
    tables, lens = meta.block_tables, meta.context_lens  # int64, contiguous (build_metadata)
    out = q.new_empty(batch, num_heads * head_dim)
    status = kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                    lens.data_ptr(), batch, tables.shape[1], k_cache.shape[1], num_heads,
                    k_cache.shape[2], head_dim, scale, out.data_ptr(), torch.get_num_threads())
    if status == -2:
        return None
    if status != 0:
        raise MemoryError(f"paged decode attention: no scratch memory for {batch} sequences")
    return out


def _decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One new token per sequence: batched matmuls per KV head over the gathered context.

    NOTE: torch's CPU flash kernel spends ~15 us per (sequence, head) at a single query,
    which at batch 32 cost more than the context's whole matmuls; here one baddbmm and one
    bmm per KV head cover every sequence and its grouped query heads.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys, values = gather_context(k_cache, v_cache, meta)  # (B, K, Hkv, D) each
    bias = meta.buffers.get("decode_bias")
    if bias is None:  # (B, 1, K): 0 where a key is in the context, -inf past its end
        bias = torch.zeros(meta.attn_mask.shape[0], 1, meta.attn_mask.shape[-1], dtype=q.dtype)
        bias.masked_fill_(~meta.attn_mask[:, 0], float("-inf"))
        meta.buffers["decode_bias"] = bias
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (B, Hkv, G, D)
    out = q.new_empty(num_kv_heads, batch, num_heads // num_kv_heads, head_dim)  # (Hkv, B, G, D)
    for head in range(num_kv_heads):
        scores = torch.baddbmm(bias, grouped[:, head], keys[:, :, head].transpose(1, 2),
                               alpha=scale)  # (B, G, K)
        probs = scores.float().softmax(dim=-1).to(q.dtype)
        torch.bmm(probs, values[:, :, head], out=out[head])  # (B, G, D)
    return out.permute(1, 0, 2, 3).reshape(batch, num_heads * head_dim)  # (B, H*D)


def gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's context by block table, (B, K, Hkv, D) for K and for V.

    The two output buffers are allocated once per step and refilled by every layer.
    """
    batch, max_blocks = meta.block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    ids = meta.block_tables.flatten()  # (B*nb,)
    out = []
    for name, cache in (("k", k_cache), ("v", v_cache)):
        buffer = meta.buffers.get(name)
        if buffer is None:
            buffer = cache.new_empty(batch * max_blocks, block_size, num_kv_heads, head_dim)
            meta.buffers[name] = buffer
        torch.index_select(cache, 0, ids, out=buffer)  # (B*nb, bs, Hkv, D)
        out.append(buffer.view(batch, max_blocks * block_size, num_kv_heads, head_dim))
    return out[0], out[1]
