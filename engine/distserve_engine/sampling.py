"""Sampling parameters and the batched sampler that turns logits into next tokens.

The sampler treats a batch at once: penalties, temperature, top-k and top-p are tensor
ops over (B, V). Presence and frequency penalties follow OpenAI's and vLLM's meaning:
they count the tokens the request has generated (not its prompt) and are subtracted
from the logits before temperature, `logit -= frequency_penalty * count +
presence_penalty * (count > 0)`, so they change greedy choices too. A request with a seed gets noise from a generator seeded by (seed, step), so
its tokens do not depend on the batch it shares or the instance that runs it: a
sequence prefilled on one instance and decoded on another samples the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distserve_engine import native
from distserve_engine.errors import EngineError

# Large odd multiplier mixing the step into a per-request seed (splitmix64's constant).
_STEP_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


@dataclass
class SamplingParams:
    """How one request samples and when it stops."""

    max_tokens: int = 16  # most generated tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = -1  # tokens kept; -1 or 0 keeps all
    seed: int | None = None  # per-request seed; None draws from the engine's generator
    stop: list[str] = field(default_factory=list)  # strings that end generation
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end generation
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a generated token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise EngineError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise EngineError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise EngineError(f"top_k: must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise EngineError(f"seed: must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise EngineError(f"stop: must be non-empty strings, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise EngineError(f"{name}: must be a number in [-2, 2], got {value!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise EngineError(f"stop_token_ids: must be token ids >= 0, got {self.stop_token_ids!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when generated tokens change the next token's logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0


class Sampler:
    """Samples one token per row of a logits batch."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
                 output_token_ids: list[list[int]] | None = None) -> list[int]:
        """logits (B, V) float; steps[i] is how many tokens row i has generated so far;
        output_token_ids[i] those tokens (needed only when a row has penalties)."""
        # NOTE: sampling runs on the CPU: the tokens go there anyway and CPU generators
        # make seeded draws identical on every device.
        logits = logits.float().cpu()
        if any(p.has_penalties for p in params):
            if output_token_ids is None:
                raise ValueError("output_token_ids: needed when a request has penalties")
            logits = apply_penalties(logits, params, output_token_ids)
        greedy_ids = row_argmax(logits)  # (B,)
        if all(p.is_greedy for p in params):
            return greedy_ids.tolist()
        probs = self._filtered_probs(logits, params)  # (B, V)
        noise = self._exponential_noise(probs.shape, params, steps)  # (B, V)
        # Exponential race: argmax(p / E), E ~ Exp(1), draws index i with probability p_i.
        sampled_ids = row_argmax(probs / noise)
        is_greedy = torch.tensor([p.is_greedy for p in params])
        return torch.where(is_greedy, greedy_ids, sampled_ids).tolist()

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
        top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
        top_ps = torch.tensor([p.top_p for p in params])
        logits = logits / temps[:, None]
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # (B, V)
        ranks = torch.arange(vocab)[None, :]  # (1, V)
        drop = ranks >= top_ks[:, None]
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
        drop |= mass_before >= top_ps[:, None]
        drop[:, 0] = False  # always keep the best token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)
        return filtered.softmax(dim=-1)

    def _exponential_noise(
        self, shape: torch.Size, params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        noise = torch.empty(shape).exponential_(generator=self.generator)  # (B, V)
        for row, (p, step) in enumerate(zip(params, steps, strict=True)):
            if p.seed is not None and not p.is_greedy:
                g = torch.Generator().manual_seed((p.seed * _STEP_MIX + step) & _SEED_MASK)
                noise[row].exponential_(generator=g)
        return noise.clamp_min_(1e-20)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of a (B, V) float32 CPU tensor, by the C kernel where
    it is built (`native.argmax_rows`), else torch's."""
    kernel = native.argmax_rows()
    if (kernel is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2
            or x.stride(-1) != 1 or x.shape[-1] == 0):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernel(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """Logits (B, V) less each row's presence and frequency penalties over its output."""
    batch, vocab = logits.shape
    counts = torch.zeros(batch, vocab)  # (B, V) occurrences of each token in the output
    for row, token_ids in enumerate(output_token_ids):
        if token_ids and params[row].has_penalties:
            ids = torch.tensor(token_ids, dtype=torch.long)
            counts[row].index_add_(0, ids, torch.ones(len(token_ids)))
    frequency = torch.tensor([p.frequency_penalty for p in params])[:, None]  # (B, 1)
    presence = torch.tensor([p.presence_penalty for p in params])[:, None]  # (B, 1)
    return logits - frequency * counts - presence * (counts > 0).float()
