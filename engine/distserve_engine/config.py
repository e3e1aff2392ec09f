"""Engine configuration: what to load, where, and how much memory the KV cache gets.

`EngineConfig` is the one object a caller builds; it validates itself so a bad setting
fails at construction with a message naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distserve_engine.errors import EngineError

if TYPE_CHECKING:
    import torch

# NOTE: this module imports no torch, so a settings document can be built and checked
# where torch is not installed (the operator's image).
# NOTE: fp16 matmuls on CPU are slow or unsupported for some ops; bf16 is the CPU half.
DEVICE_TO_DTYPES = {
    "cpu": ("float32", "bfloat16"),
    "cuda": ("float16", "bfloat16", "float32"),
}
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Share of the CUDA memory left after the weights that the KV cache takes by default.
DEFAULT_CUDA_KV_FRACTION = 0.8


@dataclass
class EngineConfig:
    """Settings of one engine instance (one rank when tp * pp > 1)."""

    model: str  # an HF checkpoint folder, a folder holding one .gguf, or a .gguf file
    device: str = "cpu"  # "cpu" or "cuda" / "cuda:N"
    dtype: str = "auto"  # "auto" is float32 on CPU and bfloat16 on CUDA
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int | None = None  # KV memory budget; ignored when num_blocks is set
    num_blocks: int | None = None  # explicit number of KV blocks
    max_num_seqs: int = 256  # most sequences in one batch (the runner rejects more)
    max_num_batched_tokens: int = 8192  # prefill token budget a scheduler fills to (not enforced)
    max_model_len: int | None = None  # cap on context length (default: the model's)
    seed: int = 0  # seeds weights-independent randomness (unseeded sampling)
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree (layer stages)
    dist_init_method: str = "env://"  # torch.distributed rendezvous when tp * pp > 1
    enable_cuda_graphs: bool = True  # replay decode steps from CUDA graphs (CUDA, tp = pp = 1)

    def __post_init__(self) -> None:
        if self.device_type not in DEVICE_TO_DTYPES:
            raise EngineError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DEVICE_TO_DTYPES[self.device_type]:
            raise EngineError(
                f"dtype: {self.dtype!r} is not supported on {self.device_type}; "
                f"choose one of {DEVICE_TO_DTYPES[self.device_type]}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tp", "pp"):
            if getattr(self, name) < 1:
                raise EngineError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("kv_cache_bytes", "num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EngineError(f"{name}: must be >= 1 when set, got {value}")

    @property
    def device_type(self) -> str:
        """'cpu' or 'cuda'."""
        return self.device.split(":")[0]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of weights and KV cache."""
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.device_type == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)

    @property
    def world_size(self) -> int:
        """Number of ranks: tp * pp."""
        return self.tp * self.pp
