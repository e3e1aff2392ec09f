"""FlashAttention's paged decode: attention that reads the KV cache through the block table.

`flash_attn_with_kvcache` takes the cache in this engine's layout (num_blocks,
block_size, num_kv_heads, head_dim) with an int32 block table and each sequence's
context length, so a decode step reads every sequence's blocks where they lie instead of
gathering a padded (B, K) copy first. It needs CUDA, fp16 or bf16, flash-attn 2 installed,
and blocks of a multiple of 256 tokens (the page size its paged kernel takes); where any
of these is missing `attention.py` gathers and calls SDPA instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# flash-attn 2's paged KV kernel takes pages of a multiple of this many tokens.
PAGE_MULTIPLE = 256
HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def kernel() -> Callable | None:
    """flash_attn_with_kvcache, or None when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


def is_supported(device_type: str, dtype: torch.dtype, block_size: int) -> bool:
    """True when a cache of this device, dtype and block size can use the paged kernel."""
    return (device_type == "cuda" and dtype in HALF_DTYPES and block_size % PAGE_MULTIPLE == 0
            and kernel() is not None)


def can_use(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when this query and cache can go through the paged kernel."""
    return is_supported(q.device.type, q.dtype, k_cache.shape[1])


def kernel_inputs(block_tables: torch.Tensor, context_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table (B, nb) and context lengths (B,) as the kernel takes them: int32."""
    return block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, D), caches (NB, bs, Hkv, D) already holding the new tokens -> (B, H*D)."""
    tables, lens = kernel_inputs(block_tables, context_lens)
    out = kernel()(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=lens, block_table=tables,
                   softmax_scale=scale, causal=True)  # (B, 1, H, D)
    return out.reshape(q.shape[0], -1)
