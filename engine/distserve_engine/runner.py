"""The model runner: executes one prefill batch or one decode step on one rank.

It owns the model, the paged KV cache and its block manager, and the sampler. It does
not schedule: a caller (an instance loop) decides which sequences go in each batch and
when to free them. With tp * pp > 1 every rank is built and called the same way (SPMD).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from distserve_engine.attention import AttentionMetadata, build_metadata
from distserve_engine.block_manager import BlockManager
from distserve_engine.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_CUDA_KV_FRACTION,
    EngineConfig,
)
from distserve_engine.cuda_graphs import DecodeGraphs
from distserve_engine.errors import EngineError, PromptTooLongError
from distserve_engine.kv_cache import KVBlob, KVCache, KVCacheShape, num_blocks_for_budget
from distserve_engine.loader import iter_weights, load_model_config, resolve_checkpoint
from distserve_engine.models import build_model
from distserve_engine.models.base import check_parallel_fits
from distserve_engine.models.layers import warm_blocked_products
from distserve_engine.parallel import (
    broadcast_tokens,
    init_parallel,
    recv_from_prev_stage,
    send_to_next_stage,
)
from distserve_engine.sampling import Sampler
from distserve_engine.sequence import Sequence
from distserve_engine.stopping import StopChecker
from distserve_engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model, KV cache and sampler; runs prefill batches and decode steps."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.device = _rank_device(config, rank)
        torch.manual_seed(config.seed)
        ckpt = resolve_checkpoint(config.model)
        self.model_config = load_model_config(ckpt)
        self.dtype = config.torch_dtype(self.model_config.weights_dtype)
        check_parallel_fits(self.model_config, config.tp, config.pp)  # before joining a group
        self.parallel = init_parallel(config.tp, config.pp, rank, config.dist_init_method,
                                      config.device_type)
        with _default_dtype(self.dtype), self.device:
            self.model = build_model(self.model_config, self.parallel)
        self.tokenizer = Tokenizer.load(ckpt, self.model_config.eos_token_ids)
        self.model.load_weights(iter_weights(ckpt, self.model_config))
        self.model.eval()
        if config.prefill_warmup_tokens and self.device.type == "cpu" and self.dtype == torch.bfloat16:
            started = time.perf_counter()
            runs = warm_blocked_products(self.model.layers, config.prefill_warmup_tokens)
            logger.info("built the bfloat16 products of prefills up to %d tokens: %d in %.1f s",
                        config.prefill_warmup_tokens, runs, time.perf_counter() - started)
        self.max_model_len = min(self.model_config.max_position,
                                 config.max_model_len or self.model_config.max_position)
        self.kv_cache = self._build_kv_cache()
        self.num_blocks = self.kv_cache.num_blocks
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_cache, config.max_num_seqs,
            -(-self.max_model_len // config.block_size), config.block_size,
            self.kv_cache.scratch_block,
        ) if self._is_graphed else None
        self.block_manager = BlockManager(self.num_blocks, config.block_size)
        self.sampler = Sampler(config.seed)
        self.stop_checker = StopChecker(self.tokenizer, self.max_model_len)
        self.last_logits: torch.Tensor | None = None  # (B, V) of the latest step, last stage
        logger.info("%s on %s %s: KV cache %d blocks x %d tokens (%.1f MiB, %d tokens), "
                    "max_model_len %d", self.model_config.architecture, self.device, self.dtype,
                    self.num_blocks, config.block_size, self.kv_cache.nbytes / 2**20,
                    self.num_blocks * config.block_size, self.max_model_len)

    def _build_kv_cache(self) -> KVCache:
        c, m = self.config, self.model_config
        shape = KVCacheShape(num_layers=len(self.model.layer_range),
                             num_kv_heads=m.num_kv_heads // c.tp, head_dim=m.head_dim,
                             block_size=c.block_size, dtype=self.dtype)
        if c.num_blocks is not None:
            num_blocks = c.num_blocks
            budget_bytes = num_blocks * shape.bytes_per_block
        elif c.kv_cache_bytes is not None:
            budget_bytes = c.kv_cache_bytes
        elif c.device_type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget_bytes = int(free_bytes * DEFAULT_CUDA_KV_FRACTION)
        else:
            budget_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = num_blocks_for_budget(shape, budget_bytes, self.max_model_len)
        return KVCache(shape, num_blocks, self.device, num_scratch_blocks=int(self._is_graphed))

    @property
    def _is_graphed(self) -> bool:
        c = self.config
        return c.enable_cuda_graphs and c.device_type == "cuda" and c.world_size == 1

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes in this rank's cache."""
        return self.kv_cache.shape.bytes_per_block // self.config.block_size

    @property
    def kv_capacity_bytes(self) -> int:
        """Bytes of KV this rank's cache holds."""
        return self.kv_cache.nbytes

    def can_allocate(self, num_tokens: int) -> bool:
        """True when a new sequence of num_tokens tokens fits in the free KV blocks."""
        return self.block_manager.can_allocate(num_tokens)

    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """Run all not-yet-cached tokens of each sequence; sample and append one token each."""
        self._check_batch_size(seqs)
        for seq in seqs:
            self._check_prompt(seq)
        self.block_manager.reserve(seqs, [s.num_tokens for s in seqs])
        new_tokens = [s.token_ids[s.num_cached_tokens:] for s in seqs]
        meta = self._metadata(seqs, [s.num_cached_tokens for s in seqs],
                              [len(t) for t in new_tokens])
        input_ids = torch.tensor([t for ts in new_tokens for t in ts], device=self.device)
        return self._step(seqs, input_ids, meta)

    def decode(self, seqs: list[Sequence]) -> list[int]:
        """Run one decode step over the sequences' newest tokens; append one token each."""
        self._check_batch_size(seqs)
        for seq in seqs:
            if seq.num_cached_tokens != seq.num_tokens - 1:
                raise EngineError(f"sequence {seq.seq_id}: decode needs a prefilled sequence "
                                  f"({seq.num_cached_tokens} of {seq.num_tokens} tokens cached)")
            if seq.num_tokens > self.max_model_len:
                raise PromptTooLongError(f"sequence {seq.seq_id}: {seq.num_tokens} tokens exceed "
                                         f"max_model_len {self.max_model_len}")
        self.block_manager.reserve(seqs, [s.num_tokens for s in seqs])
        meta = self._metadata(seqs, [s.num_tokens - 1 for s in seqs], [1] * len(seqs))
        input_ids = torch.tensor([s.last_token_id for s in seqs], device=self.device)
        graphs = self.decode_graphs
        return self._step(seqs, input_ids, meta, graphs if graphs and graphs.can_run(meta) else None)

    def _check_batch_size(self, seqs: list[Sequence]) -> None:
        if not seqs:
            raise EngineError("batch: no sequences")
        if len(seqs) > self.config.max_num_seqs:
            raise EngineError(f"batch: {len(seqs)} sequences exceed max_num_seqs "
                              f"{self.config.max_num_seqs}")

    def _check_prompt(self, seq: Sequence) -> None:
        n, vocab = seq.num_tokens, self.model_config.vocab_size
        if n == 0:
            raise EngineError(f"sequence {seq.seq_id}: prompt is empty")
        if n > self.max_model_len:
            raise PromptTooLongError(f"sequence {seq.seq_id}: prompt has {n} tokens, more than "
                                     f"the model's context of {self.max_model_len}")
        if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab:
            raise EngineError(f"sequence {seq.seq_id}: prompt token ids must be in [0, {vocab})")

    def _metadata(self, seqs: list[Sequence], starts: list[int], num_new: list[int]
                  ) -> AttentionMetadata:
        tables = [s.block_table for s in seqs]
        return build_metadata(starts, num_new, tables, self.config.block_size, self.device)

    @torch.inference_mode()
    def _step(self, seqs: list[Sequence], input_ids: torch.Tensor, meta: AttentionMetadata,
              forward: DecodeGraphs | None = None) -> list[int]:
        state = self.parallel
        x = input_ids
        if not state.is_first_stage:
            hidden_size = self.model_config.hidden_size
            x = recv_from_prev_stage((len(input_ids), hidden_size), self.dtype, self.device, state)
        # NOTE: a prefill's last stage runs past its last attention for the rows it samples
        # alone (`CausalLM.forward`): 3% of a 64-token prompt's GEMM work at SmolLM2's 30 layers
        rows = (meta.logits_index if state.is_last_stage and forward is None
                and len(input_ids) > len(seqs) else None)
        hidden = (self.model(x, meta, self.kv_cache, rows) if forward is None
                  else forward(x, meta, self.kv_cache))  # (T, hidden), or (B, hidden) with rows
        token_ids = [0] * len(seqs)
        if state.is_last_stage:
            sampled = hidden if rows is not None else hidden[meta.logits_index]  # (B, hidden)
            self.last_logits = self.model.compute_logits(sampled)  # (B, V)
            steps = [len(s.output_token_ids) for s in seqs]
            token_ids = self.sampler(self.last_logits, [s.params for s in seqs], steps,
                                     [s.output_token_ids for s in seqs])
        else:
            send_to_next_stage(hidden, state)
        token_ids = broadcast_tokens(token_ids, state, self.device)
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.num_cached_tokens = seq.num_tokens
            seq.output_token_ids.append(token_id)
        return token_ids

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits (T, V) at every position of token_ids (tp any, pp 1); the cache is left as is."""
        seq = Sequence(seq_id="score", prompt_token_ids=list(token_ids))
        self._check_prompt(seq)
        self.block_manager.reserve([seq], [seq.num_tokens])
        try:
            meta = self._metadata([seq], [0], [seq.num_tokens])
            hidden = self.model(torch.tensor(token_ids, device=self.device), meta, self.kv_cache)
            return self.model.compute_logits(hidden)  # (T, V)
        finally:
            self.block_manager.free(seq)

    def export_kv(self, seq: Sequence, into: torch.Tensor | None = None) -> KVBlob:
        """The sequence's cached KV as contiguous tensors (this rank's layers and heads),
        written into the uint8 buffer `into` when given (K then V)."""
        return self.kv_cache.export(seq.block_table, seq.num_cached_tokens, into)

    def import_kv(self, seq: Sequence, blob: KVBlob) -> None:
        """Allocate blocks in this cache for seq and copy the blob's KV into them."""
        s = self.kv_cache.shape
        expected = (s.num_layers, blob.num_tokens, s.num_kv_heads, s.head_dim)
        if tuple(blob.k.shape) != expected or tuple(blob.v.shape) != expected:
            raise EngineError(f"import_kv: blob shape {tuple(blob.k.shape)} does not match this "
                              f"cache's {expected}")
        if seq.block_table:
            raise EngineError(f"import_kv: sequence {seq.seq_id} already holds blocks; "
                              "import into seq.detached()")
        self.block_manager.reserve([seq], [blob.num_tokens])
        self.kv_cache.import_(seq.block_table, blob)
        seq.num_cached_tokens = blob.num_tokens

    def free(self, seq: Sequence) -> None:
        """Release the sequence's KV blocks."""
        self.block_manager.free(seq)

    def check_stop(self, seq: Sequence) -> str:
        """Detokenize the newest tokens; set seq.finish_reason; return text to stream."""
        return self.stop_checker.update(seq)


def _rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of this rank: plain "cuda" with several ranks means one GPU per rank."""
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is None and config.world_size > 1:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank to its current device
    return device


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
