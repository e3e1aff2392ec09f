"""Finding a checkpoint on disk and streaming its weights as HF-named tensors.

Two formats: an HF folder (`config.json`, `*.safetensors`, tokenizer files) and GGUF.
Both stream `(hf_name, tensor)` pairs so a model has one loading path. GGUF tensors are
dequantized to float32 and renamed to HF names; llama.cpp stores Q and K rows permuted
for its interleaved rotary, which is undone here so the HF (half-split) rotary applies.

Loading a large checkpoint takes minutes, so progress goes to the log (INFO, logger
`distserve_engine.loader`): the total at the start, then each file (safetensors) or
each tenth of the tensors (GGUF) with bytes read and seconds spent.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distserve_engine.errors import CheckpointError
from distserve_engine.model_config import ModelConfig

log = logging.getLogger(__name__)
GIB = 1 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# GGUF tensor name (with "blk.N." stripped) -> HF name (with "model.layers.N." stripped).
GGUF_LAYER_TO_HF = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
GGUF_GLOBAL_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class Checkpoint:
    """Where a model's files are: an HF folder, or a GGUF file (and its folder)."""

    folder: Path
    gguf_path: Path | None = None

    @property
    def is_gguf(self) -> bool:
        """True when weights come from a GGUF file."""
        return self.gguf_path is not None


def resolve_checkpoint(path: str, require_weights: bool = True) -> Checkpoint:
    """Find the checkpoint at `path`; raise CheckpointError naming any missing file.
    `require_weights` False: config and tokenizer suffice (a router loads no weights)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"model: path {path!r} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise CheckpointError(f"model: {path!r} is a file but not a .gguf file")
        return Checkpoint(folder=p.parent, gguf_path=p)
    if not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return Checkpoint(folder=p, gguf_path=ggufs[0])
        if len(ggufs) > 1:
            raise CheckpointError(f"model: {path!r} holds several .gguf files; name one")
        raise CheckpointError(f"model: {path!r} is missing config.json (and has no .gguf file)")
    missing = []
    if require_weights and not list(p.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((p / name).exists() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (" + " or ".join(TOKENIZER_FILES) + ")")
    if missing:
        raise CheckpointError(f"model: folder {path!r} is missing " + " and ".join(missing))
    return Checkpoint(folder=p)


def load_model_config(ckpt: Checkpoint) -> ModelConfig:
    """Read the architecture from config.json or the GGUF metadata."""
    if ckpt.is_gguf:
        reader = _gguf_reader(ckpt.gguf_path)
        return ModelConfig.from_gguf(_gguf_metadata(reader), {t.name for t in reader.tensors},
                                     gguf_weights_dtype(reader))
    try:
        hf = json.loads((ckpt.folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"config.json in {ckpt.folder} is not valid JSON: {e}") from e
    return ModelConfig.from_hf(hf)


def iter_weights(ckpt: Checkpoint, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every weight in the checkpoint."""
    if ckpt.is_gguf:
        yield from _iter_gguf(ckpt.gguf_path, config)
    else:
        yield from _iter_safetensors(ckpt.folder)


class LoadProgress:
    """Logs how much of a checkpoint has been read."""

    def __init__(self, where: Path, total_bytes: int, num_parts: int, unit: str) -> None:
        self.total_bytes, self.num_parts, self.unit = total_bytes, num_parts, unit
        self.done_bytes = self.done_parts = 0
        self.start_s = time.monotonic()
        log.info("loading weights from %s: %d %s, %.2f GiB", where, num_parts, unit,
                 total_bytes / GIB)

    def advance(self, nbytes: int, parts: int = 1, name: str = "") -> None:
        """Count `parts` more read, of `nbytes` bytes; log it."""
        self.done_bytes += nbytes
        self.done_parts += parts
        log.info("loading weights: %d/%d %s%s, %.2f/%.2f GiB, %.0f s", self.done_parts,
                 self.num_parts, self.unit, f" ({name})" if name else "",
                 self.done_bytes / GIB, self.total_bytes / GIB, time.monotonic() - self.start_s)


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    progress = LoadProgress(folder, sum(f.stat().st_size for f in files), len(files), "files")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read weights file {file}: {e}") from e
        progress.advance(file.stat().st_size, name=file.name)


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: Path) -> Any:
    """The parsed GGUF file, shared by config and weight loading (parsing takes seconds)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf reader raises ValueError/struct errors
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e


# GGUF tensor types that store plain floats; every other type is a quantized block format.
GGUF_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def gguf_weights_dtype(reader: Any) -> str:
    """The dtype a GGUF stores its weight matrices in: that of its largest tensor
    ("quantized" for a block format; norms and biases stay F32 in every file)."""
    largest = max(reader.tensors, key=lambda t: int(t.n_elements), default=None)
    if largest is None:
        return "float32"
    return GGUF_FLOAT_TYPES.get(largest.tensor_type.name, "quantized")


def _gguf_metadata(reader: Any) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "token_type", "merges")):
            meta[key] = field.data  # only its length is needed here
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - an odd field should not block loading
            continue
    return meta


def _iter_gguf(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = _gguf_reader(path)
    tensors = list(reader.tensors)
    progress = LoadProgress(path, sum(int(t.n_bytes) for t in tensors), len(tensors), "tensors")
    step = max(1, len(tensors) // 10)
    pending_bytes = 0
    for index, t in enumerate(tensors, start=1):
        name = _gguf_name_to_hf(t.name)
        if name is not None:  # None, e.g. rope_freqs: recomputed from the config
            yield name, _gguf_weight(gguf, t, name, config)
        pending_bytes += int(t.n_bytes)
        if index % step == 0 or index == len(tensors):
            progress.advance(pending_bytes, index - progress.done_parts)
            pending_bytes = 0


def _gguf_weight(gguf: Any, t: Any, name: str, config: ModelConfig) -> torch.Tensor:
    """One GGUF tensor as a float32 HF weight."""
    array = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(reversed([int(n) for n in t.shape]))  # GGUF lists dims fastest-first
    weight = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
    if name.endswith("q_proj.weight"):
        return unpermute_rotary(weight, config.num_heads)
    if name.endswith("k_proj.weight"):
        return unpermute_rotary(weight, config.num_kv_heads)
    return weight


def _gguf_name_to_hf(name: str) -> str | None:
    if name in GGUF_GLOBAL_TO_HF:
        return GGUF_GLOBAL_TO_HF[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in GGUF_LAYER_TO_HF:
            return f"model.layers.{layer}.{GGUF_LAYER_TO_HF[rest]}"
    return None


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of a Q or K projection weight."""
    out_features = weight.shape[0]
    half = out_features // num_heads // 2
    # llama.cpp stored rows as (heads, half, 2); HF wants (heads, 2, half).
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # (nh, hd/2, 2, in)
    return w.transpose(1, 2).reshape(weight.shape)  # (nh*hd, in)
