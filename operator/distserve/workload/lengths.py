"""Request length samples: which (prompt, output) token counts each application has.

The samples ship in `distserve/data/` as `.npz` files built by
`scripts/build_workloads.py`:
- `chatbot`: ShareGPT V3 conversations (12,657 requests), SmolLM2 tokenizer;
- `code`: HumanEval prompt -> canonical solution, the 164 problems x 10;
- `summarization`: LongBench-like, MODELLED (no package ships LongBench): prompts of
  1,900-2,048 tokens less a 16-512 token answer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

import numpy as np

DATASETS = ("chatbot", "code", "summarization")
_ALIASES = {"sharegpt": "chatbot", "humaneval": "code", "longbench": "summarization"}


@dataclass(frozen=True)
class LengthSample:
    """Paired prompt and output lengths (tokens) of one application's requests."""

    name: str
    prompt_tokens: np.ndarray  # int32, one per request
    output_tokens: np.ndarray  # int32, >= 1

    def __post_init__(self) -> None:
        if len(self.prompt_tokens) != len(self.output_tokens) or len(self.prompt_tokens) == 0:
            raise ValueError(
                f"{self.name}: need as many output lengths as prompt lengths, at least one"
            )

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    @property
    def mean_prompt_tokens(self) -> float:
        """Mean prompt length in tokens."""
        return float(self.prompt_tokens.mean())

    @property
    def mean_output_tokens(self) -> float:
        """Mean output length in tokens."""
        return float(self.output_tokens.mean())


@functools.cache
def load_lengths(name: str) -> LengthSample:
    """A shipped sample by application name (or dataset name: sharegpt, humaneval, longbench)."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in DATASETS:
        raise ValueError(f"unknown workload {name!r}: expected one of {', '.join(DATASETS)}")
    ref = resources.files("distserve") / "data" / f"{key}.npz"
    with resources.as_file(ref) as path, np.load(path) as data:
        prompts = data["prompt_tokens"].astype(np.int64)
        outputs = data["output_tokens"].astype(np.int64)
    prompts.flags.writeable = False
    outputs.flags.writeable = False
    return LengthSample(key, prompts, outputs)
