"""Ownership of KV blocks: which are free, and which belong to which sequence.

The block manager only does bookkeeping; the tensors live in `kv_cache.py`. Allocation
is all-or-nothing per call so a failed request leaves no half-allocated sequence.
"""

from __future__ import annotations

from collections import deque

from distserve_engine.errors import OutOfBlocksError
from distserve_engine.sequence import Sequence


class BlockManager:
    """Free list of block ids and per-sequence block tables."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence."""
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Share of blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain to hold `num_tokens` tokens (0 when it has room)."""
        return max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, num_tokens: int) -> bool:
        """True when a new sequence of `num_tokens` tokens fits in the free blocks."""
        return self.num_blocks_for(num_tokens) <= self.num_free_blocks

    def reserve(self, seqs: list[Sequence], num_tokens: list[int]) -> None:
        """Grow each seq's block table to hold num_tokens[i] tokens, all or nothing."""
        needed = [self.num_new_blocks(s, n) for s, n in zip(seqs, num_tokens, strict=True)]
        if sum(needed) > self.num_free_blocks:
            raise OutOfBlocksError(
                f"KV cache: {sum(needed)} blocks needed, {self.num_free_blocks} free "
                f"of {self.num_blocks}"
            )
        for seq, n in zip(seqs, needed, strict=True):
            seq.block_table.extend(self.free_block_ids.popleft() for _ in range(n))

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks to the free list."""
        self.free_block_ids.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
