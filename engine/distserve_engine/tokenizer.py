"""The checkpoint's own tokenizer and chat template, behind a small interface.

Wraps a `transformers` fast tokenizer loaded from the checkpoint folder (or built from
the GGUF metadata); nothing is fetched from a hub. `eos_token_ids` merges the
tokenizer's EOS with the ids in `config.json` / `generation_config.json`, because
instruction-tuned checkpoints often end turns with a token other than the tokenizer EOS.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from distserve_engine.errors import CheckpointError, EngineError
from distserve_engine.loader import Checkpoint


class Tokenizer:
    """encode / decode / chat template of one checkpoint."""

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: list[int]) -> None:
        self.hf = hf_tokenizer
        eos = set(extra_eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.all_special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)

    @classmethod
    def load(cls, ckpt: Checkpoint, extra_eos_token_ids: list[int]) -> Tokenizer:
        """Load from the checkpoint; raise CheckpointError when that fails."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            if ckpt.is_gguf:
                hf = AutoTokenizer.from_pretrained(
                    str(ckpt.gguf_path.parent), gguf_file=ckpt.gguf_path.name
                )
            else:
                hf = AutoTokenizer.from_pretrained(str(ckpt.folder))
        except Exception as e:  # transformers raises many types (OSError, ValueError...)
            raise CheckpointError(f"cannot load the tokenizer from {ckpt.folder}: {e}") from e
        return cls(hf, extra_eos_token_ids + _generation_eos_ids(ckpt.folder))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (with BOS when the tokenizer adds one)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text."""
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """Token ids -> token strings (for debugging and logprobs)."""
        return self.hf.convert_ids_to_tokens(token_ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render chat messages with the checkpoint's template and tokenize them."""
        if not getattr(self.hf, "chat_template", None):
            raise EngineError("messages: this checkpoint has no chat template")
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        # The template already holds any BOS text; do not add special tokens twice.
        return self.encode(text, add_special_tokens=False)


def _generation_eos_ids(folder: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.exists():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(value, list):
            ids.extend(int(v) for v in value)
        elif value is not None:
            ids.append(int(value))
    return ids
