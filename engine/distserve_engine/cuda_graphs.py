"""Decode steps replayed from CUDA graphs captured at a few batch sizes.

A decode step's shapes depend only on its batch size and its widest block table, so the
runner keeps one graph per (batch bucket, block bucket), captured the first time a step
of that shape comes, and replays it: the step's inputs are copied into the graph's
static tensors, rows beyond the batch are padding, and their outputs are dropped.

A padding row is a one-token sequence at position 0 in the scratch block, a KV block
the cache holds beyond those the block manager hands out: it writes its K/V there and
attends to that key alone, so it never touches a sequence's blocks and never produces
a NaN (a row with no key would, and a NaN value in a masked slot still poisons 0 * NaN).
Table columns beyond a sequence's blocks point at the scratch block too, masked off.

Bucketing and padding are plain tensor code, tested on the CPU; capture and replay
need CUDA. A batch above the largest bucket runs eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from distserve_engine.attention import AttentionMetadata, build_metadata

# Batch sizes captured: small ones exactly, then every multiple of 8 (as vLLM does).
SMALL_BATCHES = (1, 2, 4)
BATCH_STEP = 8


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch buckets for at most max_num_seqs sequences, ascending."""
    sizes = [b for b in SMALL_BATCHES if b < max_num_seqs]
    sizes += list(range(BATCH_STEP, max_num_seqs, BATCH_STEP))
    return sizes + [max_num_seqs]


def block_buckets(max_blocks: int) -> list[int]:
    """Block-table widths captured: powers of two below max_blocks, then max_blocks."""
    widths, width = [], 1
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return widths + [max_blocks]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n, or None when n is above them all."""
    index = bisect.bisect_left(buckets, n)
    return buckets[index] if index < len(buckets) else None


class StaticDecode:
    """The static inputs of one captured shape: token ids and metadata of `batch` rows
    and `num_blocks` table columns, all padding until `fill` copies a step in."""

    def __init__(self, batch: int, num_blocks: int, block_size: int, scratch_block: int,
                 device: torch.device) -> None:
        self.batch, self.num_blocks = batch, num_blocks
        self.block_size, self.scratch_block = block_size, scratch_block
        self.input_ids = torch.zeros(batch, dtype=torch.long, device=device)
        tables = [[scratch_block] * num_blocks] * batch
        self.meta = build_metadata([1] * batch, [1] * batch, tables, block_size, device)
        self._pad_from(0)

    def fill(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy one eager decode step's inputs (n <= batch rows, <= num_blocks columns) in."""
        n, width = meta.block_tables.shape
        static = self.meta
        self.input_ids[:n].copy_(input_ids)
        for name in ("positions", "slot_mapping", "context_lens"):
            getattr(static, name)[:n].copy_(getattr(meta, name))
        static.block_tables[:n].fill_(self.scratch_block)
        static.block_tables[:n, :width].copy_(meta.block_tables)
        static.attn_mask[:n].fill_(False)
        static.attn_mask[:n, ..., : meta.attn_mask.shape[-1]].copy_(meta.attn_mask)
        self._pad_from(n)
        static.buffers.pop("decode_bias", None)  # the CPU path derives it from the mask

    def _pad_from(self, n: int) -> None:
        """Make rows n.. padding: token 0 at position 0 of the scratch block, its only key."""
        static = self.meta
        self.input_ids[n:] = 0
        static.positions[n:] = 0
        static.slot_mapping[n:] = self.scratch_block * self.block_size
        static.context_lens[n:] = 1
        static.block_tables[n:] = self.scratch_block
        static.attn_mask[n:] = False
        static.attn_mask[n:, ..., 0] = True


class DecodeGraphs:
    """Captures and replays the model's decode forward per (batch, blocks) bucket."""

    def __init__(self, model: Callable, kv_cache, max_num_seqs: int, max_blocks: int,
                 block_size: int, scratch_block: int) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.widths = block_buckets(max_blocks)
        self.block_size, self.scratch_block = block_size, scratch_block
        self.pool = torch.cuda.graph_pool_handle()
        self.key_to_graph: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, StaticDecode,
                                                       torch.Tensor]] = {}

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True when this decode step fits a bucket."""
        batch, width = meta.block_tables.shape
        return (meta.num_queries == 1 and bucket_for(batch, self.batch_sizes) is not None
                and bucket_for(width, self.widths) is not None)

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """Hidden states (B, hidden) of one decode step, from the graph of its bucket."""
        batch, width = meta.block_tables.shape
        key = (bucket_for(batch, self.batch_sizes), bucket_for(width, self.widths))
        if key not in self.key_to_graph:
            self.key_to_graph[key] = self._capture(*key)
        graph, static, hidden = self.key_to_graph[key]
        static.fill(input_ids, meta)
        graph.replay()
        return hidden[:batch]

    def _capture(self, batch: int, width: int):
        static = StaticDecode(batch, width, self.block_size, self.scratch_block,
                              self.kv_cache.k.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (allocator, kernels)
            self.model(static.input_ids, static.meta, self.kv_cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(static.input_ids, static.meta, self.kv_cache)
        return graph, static, hidden
