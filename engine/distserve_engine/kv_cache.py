"""The paged KV cache tensors, their size from a memory budget, and export/import.

Layout: one K and one V tensor per instance, (num_layers, num_blocks, block_size,
num_kv_heads, head_dim). A block holds `block_size` consecutive tokens of one sequence
for every layer, so moving a sequence means moving whole blocks. `export` packs a
sequence's blocks into contiguous tensors; `import_` writes them into other block ids.
On CUDA both go between host and device through one pinned staging buffer, with
non-blocking copies, instead of pageable memory. A cache may hold scratch blocks beyond
`num_blocks` that no sequence owns (CUDA graphs' padding rows write there).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from distserve_engine.errors import KVBudgetError


@dataclass
class KVBlob:
    """One sequence's KV, contiguous and independent of any block ids."""

    k: torch.Tensor  # (num_layers, num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor  # (num_layers, num_tokens, num_kv_heads, head_dim)
    num_tokens: int

    @property
    def nbytes(self) -> int:
        """Bytes of K plus V."""
        return self.k.nbytes + self.v.nbytes


def kv_views(buffer: torch.Tensor, shape: list[int] | tuple[int, ...], dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as views of a uint8 buffer holding K then V, each of `shape` (L, n, Hkv, D)."""
    half = buffer.numel() // 2
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * dtype.itemsize != half:
        raise ValueError(f"KV buffer: {buffer.numel()} bytes do not hold K and V of {tuple(shape)} {dtype}")
    return buffer[:half].view(dtype).view(shape), buffer[half:].view(dtype).view(shape)


@dataclass
class KVCacheShape:
    """Per-rank shape of the cache: the layers and KV heads this rank holds."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K plus V for one block over all local layers."""
        elements = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        return elements * self.dtype.itemsize


def num_blocks_for_budget(shape: KVCacheShape, kv_cache_bytes: int, max_model_len: int) -> int:
    """Blocks that fit in the budget; KVBudgetError when one full sequence does not fit."""
    num_blocks = kv_cache_bytes // shape.bytes_per_block
    needed = -(-max_model_len // shape.block_size)
    if num_blocks < needed:
        raise KVBudgetError(
            f"kv_cache_bytes: {kv_cache_bytes} bytes hold {num_blocks} blocks of "
            f"{shape.bytes_per_block} bytes, but one {max_model_len}-token sequence needs "
            f"{needed} blocks ({needed * shape.bytes_per_block} bytes); raise the budget "
            f"or lower max_model_len"
        )
    return num_blocks


class KVCache:
    """K and V tensors of all local layers, paged into blocks."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, device: torch.device,
                 num_scratch_blocks: int = 0) -> None:
        self.shape = shape
        self.num_blocks = num_blocks  # blocks sequences may own; scratch ones come after
        self.scratch_block = num_blocks if num_scratch_blocks else None
        dims = (shape.num_layers, num_blocks + num_scratch_blocks, shape.block_size,
                shape.num_kv_heads, shape.head_dim)
        self.k = torch.zeros(dims, dtype=shape.dtype, device=device)  # (L, NB, bs, Hkv, D)
        self.v = torch.zeros(dims, dtype=shape.dtype, device=device)  # (L, NB, bs, Hkv, D)
        self._staging: torch.Tensor | None = None  # pinned host bytes, CUDA caches only
        self._staging_lock = threading.Lock()  # transfer threads share the staging buffer

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache."""
        return self.k.nbytes + self.v.nbytes

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one local layer, each (NB, bs, Hkv, D)."""
        return self.k[index], self.v[index]

    def export(self, block_table: list[int], num_tokens: int, into: torch.Tensor | None = None
               ) -> KVBlob:
        """Copy the first num_tokens tokens of these blocks into a contiguous blob: new
        tensors, or K then V written into `into` (a host uint8 buffer, e.g. a shared-memory
        range, of at least `blob_nbytes(num_tokens)` bytes)."""
        shape = self._blob_shape(num_tokens)  # (L, n, Hkv, D)
        if into is None or self.k.device.type != "cpu":
            k, v = self.k.new_empty(shape), self.v.new_empty(shape)
            self._copy_blocks(block_table, num_tokens, k, v, is_export=True)
            if into is not None:  # a device cache: through a device blob to the host buffer
                host_k, host_v = kv_views(into[: self.blob_nbytes(num_tokens)], shape, self.shape.dtype)
                self._to_host(k, v, host_k, host_v)
                k, v = host_k, host_v
            return KVBlob(k=k, v=v, num_tokens=num_tokens)
        k, v = kv_views(into[: self.blob_nbytes(num_tokens)], shape, self.shape.dtype)
        self._copy_blocks(block_table, num_tokens, k, v, is_export=True)
        return KVBlob(k=k, v=v, num_tokens=num_tokens)

    def blob_nbytes(self, num_tokens: int) -> int:
        """Bytes of K plus V of `num_tokens` tokens (this rank's layers and heads)."""
        s = self.shape
        return 2 * s.num_layers * num_tokens * s.num_kv_heads * s.head_dim * s.dtype.itemsize

    def import_(self, block_table: list[int], blob: KVBlob) -> None:
        """Write the blob's tokens into these blocks (which must hold blob.num_tokens)."""
        if self.k.is_cuda and not blob.k.is_cuda:
            with self._staging_lock:
                staged_k, staged_v = self._staged(blob.nbytes, tuple(blob.k.shape), blob.k.dtype)
                staged_k.copy_(blob.k)
                staged_v.copy_(blob.v)
                k = staged_k.to(self.k.device, self.k.dtype, non_blocking=True)
                v = staged_v.to(self.v.device, self.v.dtype, non_blocking=True)
                self._copy_blocks(block_table, blob.num_tokens, k, v, is_export=False)
                torch.cuda.current_stream(self.k.device).synchronize()  # before reusing staging
            return
        k = blob.k.to(self.k.device, self.k.dtype).contiguous()
        v = blob.v.to(self.v.device, self.v.dtype).contiguous()
        self._copy_blocks(block_table, blob.num_tokens, k, v, is_export=False)

    def _to_host(self, k: torch.Tensor, v: torch.Tensor, host_k: torch.Tensor,
                 host_v: torch.Tensor) -> None:
        """Device k, v -> host tensors, through pinned staging with non-blocking copies."""
        with self._staging_lock:
            staged_k, staged_v = self._staged(k.nbytes + v.nbytes, tuple(k.shape), k.dtype)
            staged_k.copy_(k, non_blocking=True)
            staged_v.copy_(v, non_blocking=True)
            torch.cuda.current_stream(k.device).synchronize()
            host_k.copy_(staged_k)
            host_v.copy_(staged_v)

    def _staged(self, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of the pinned staging buffer, grown (doubling) to hold nbytes."""
        if self._staging is None or self._staging.numel() < nbytes:
            size = max(nbytes, 2 * (0 if self._staging is None else self._staging.numel()))
            self._staging = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return kv_views(self._staging[:nbytes], shape, dtype)

    def _blob_shape(self, num_tokens: int) -> tuple[int, ...]:
        s = self.shape
        return (s.num_layers, num_tokens, s.num_kv_heads, s.head_dim)

    def _copy_blocks(self, block_table: list[int], num_tokens: int, k: torch.Tensor,
                     v: torch.Tensor, is_export: bool) -> None:
        """Move whole blocks with one index op per layer, then the partial last block.

        NOTE: a per-layer index_select into a contiguous output runs at memcpy speed; one
        index op over all layers (or per token) ran 3-5x slower on the CPU.
        """
        bs = self.shape.block_size
        num_full, rest = divmod(num_tokens, bs)
        ids = torch.tensor(block_table[:num_full], dtype=torch.long, device=self.k.device)
        last = block_table[num_full] if rest else None
        block_numel = bs * self.shape.num_kv_heads * self.shape.head_dim
        for cache, blob in ((self.k, k), (self.v, v)):
            for layer in range(self.shape.num_layers):
                blocks = cache[layer].view(cache.shape[1], block_numel)  # (NB, bs*Hkv*D)
                full = blob[layer, : num_full * bs].view(num_full, block_numel)  # (nb, ...)
                if is_export:
                    torch.index_select(blocks, 0, ids, out=full)
                    if rest:
                        blob[layer, num_full * bs:] = cache[layer, last, :rest]
                else:
                    blocks.index_copy_(0, ids, full)
                    if rest:
                        cache[layer, last, :rest] = blob[layer, num_full * bs:]
