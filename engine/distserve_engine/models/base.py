"""What every model implements, and the weight loading they share.

A model is built for one rank: it holds only its pipeline stage's layers and its tensor
parallel slices. It lists, per HF weight name, the loaders that copy that tensor into
its parameters; loading then checks that every listed name was present.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from distserve_engine.attention import AttentionMetadata
from distserve_engine.errors import CheckpointError, EngineError
from distserve_engine.kv_cache import KVCache
from distserve_engine.model_config import ModelConfig
from distserve_engine.models.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    block_head_for_cpu,
    stored_weight,
    transpose_for_cpu,
)
from distserve_engine.parallel import ParallelState, tp_all_gather_last

Loader = Callable[[torch.Tensor], None]


def copy_into(param: torch.Tensor) -> Loader:
    """A loader that copies a full tensor into a replicated parameter."""

    def load(t: torch.Tensor) -> None:
        if t.shape != param.shape:
            raise CheckpointError(f"weight shape {tuple(t.shape)} != expected {tuple(param.shape)}")
        param.data.copy_(t)

    return load


def check_parallel_fits(config: ModelConfig, tp: int, pp: int) -> None:
    """EngineError unless tp divides the heads and MLP width and pp <= the layer count."""
    for name, value in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % tp:
            raise EngineError(f"tp: {tp} does not divide the model's {name} ({value})")
    if config.num_layers < pp:
        raise EngineError(f"pp: {pp} stages but the model has {config.num_layers} layers")


class CausalLM(nn.Module):
    """Base of the decoder-only models: stage layout, logits, weight loading."""

    def __init__(self, config: ModelConfig, state: ParallelState) -> None:
        super().__init__()
        check_parallel_fits(config, state.tp, state.pp)
        self.config = config
        self.state = state
        self.layer_range = state.layer_range(config.num_layers)
        self.padded_vocab = -(-config.vocab_size // state.tp) * state.tp
        self.lm_head: ColumnParallelLinear | None = None
        self.is_head_shared = False  # lm_head.weight is the embedding tensor itself

    def share_tied_head(self, embedding: nn.Embedding | None) -> None:
        """With tied weights on one rank holding both ends, keep one tensor, not two."""
        c, s = self.config, self.state
        if c.tie_word_embeddings and embedding is not None and self.lm_head is not None \
                and s.tp == 1 and self.padded_vocab == c.vocab_size:
            self.lm_head.weight = embedding.weight
            self.is_head_shared = True

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids (T,) on the first stage, else hidden (T, hidden) -> hidden (T, hidden).

        With `rows` (the last stage's prefill: each sequence's last new token, whose logits
        are sampled), the last layer writes every row's keys and values into the cache and
        runs the rest (output projection, MLP) for those rows alone; the result is
        (len(rows), hidden). The other rows' states past the last attention are never
        read, and the MLP is most of a layer's work."""
        raise NotImplementedError

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last-stage transform before the LM head (final norm); (B, hidden) -> (B, hidden)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) last-token states -> (B, vocab) logits in float32."""
        logits = self.lm_head(self.final_hidden(hidden))  # (B, padded_vocab / tp)
        logits = tp_all_gather_last(logits, self.state)  # (B, padded_vocab)
        return logits[:, : self.config.vocab_size].float()

    def weight_loaders(self) -> dict[str, list[Loader]]:
        """HF weight name -> loaders; every name listed must be in the checkpoint."""
        raise NotImplementedError

    def lm_head_loader(self) -> Loader:
        """Loader padding the vocab rows to a multiple of tp, then sharding them."""

        def load(t: torch.Tensor) -> None:
            if self.is_head_shared:
                return  # already loaded as the embedding
            padded = t.new_zeros(self.padded_vocab, t.shape[1])
            padded[: t.shape[0]] = t
            self.lm_head.load(padded)

        return load

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in; CheckpointError naming any weight that is missing."""
        name_to_loaders = self.weight_loaders()
        seen = set()
        for name, tensor in weights:
            for load in name_to_loaders.get(self.normalize_name(name), []):
                try:
                    load(tensor)
                except (RuntimeError, CheckpointError) as e:
                    raise CheckpointError(f"weight {name!r}: {e}") from e
                seen.add(self.normalize_name(name))
        missing = sorted(set(name_to_loaders) - seen)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise CheckpointError(f"checkpoint is missing {len(missing)} weights: {shown}")
        if next(self.parameters()).device.type == "cpu":
            if self.lm_head is not None:
                block_head_for_cpu(self.lm_head)
            for module in self.modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    is_tied = module is self.lm_head and self.is_head_shared
                    transpose_for_cpu(module, keep_weight=is_tied)  # the embedding's rows

    def weight_bytes_read(self) -> int:
        """Bytes of weights a one-token step reads: each linear's stored copy, the norms,
        and not an untied input embedding (only the batch's rows of it are read)."""
        total = sum(p.nbytes for p in self.parameters())  # a shared tensor counted once
        for module in self.modules():
            is_linear = isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            if is_linear and getattr(module, "weight", None) is None:  # replaced by a copy
                total += stored_weight(module).nbytes
        embedding = getattr(self, "embed_tokens", None)
        if embedding is not None and not self.is_head_shared:
            total -= embedding.weight.nbytes
        return total

    def normalize_name(self, name: str) -> str:
        """Map variant spellings of a checkpoint name to the one weight_loaders uses."""
        return name
