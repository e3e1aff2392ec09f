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
# Checkpoint weight dtypes (`ModelConfig.weights_dtype`) that "auto" runs in bfloat16 on a
# CPU that multiplies bfloat16 natively.
HALF_WEIGHTS = ("bfloat16", "float16", "quantized")
# Share of the CUDA memory left after the weights that the KV cache takes by default.
DEFAULT_CUDA_KV_FRACTION = 0.8


@dataclass
class EngineConfig:
    """Settings of one engine instance (one rank when tp * pp > 1)."""

    model: str  # an HF checkpoint folder, a folder holding one .gguf, or a .gguf file
    device: str = "cpu"  # "cpu" or "cuda" / "cuda:N"
    dtype: str = "auto"  # "auto": bfloat16 on CUDA; on the CPU see `torch_dtype`
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
    # Prefills of up to this many tokens have their bfloat16 CPU products built at start
    # (`layers.warm_blocked_products`); 0: built as requests first need them.
    prefill_warmup_tokens: int = 0

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
        if self.prefill_warmup_tokens < 0:
            raise EngineError(f"prefill_warmup_tokens: must be >= 0, got {self.prefill_warmup_tokens}")
        for name in ("kv_cache_bytes", "num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EngineError(f"{name}: must be >= 1 when set, got {value}")

    @property
    def device_type(self) -> str:
        """'cpu' or 'cuda'."""
        return self.device.split(":")[0]

    def torch_dtype(self, weights_dtype: str | None = None) -> torch.dtype:
        """The dtype of weights and KV cache, `weights_dtype` being the checkpoint's
        (`ModelConfig.weights_dtype`).

        "auto" is bfloat16 on CUDA. On the CPU it is bfloat16 where the checkpoint's
        weights are half-precision or quantized and the CPU multiplies bfloat16 itself (AMX
        or AVX512-BF16), as vLLM's CPU backend runs such models; float32 otherwise: for a
        float32 checkpoint, or where bfloat16 would be emulated (slower than float32).

        NOTE: on this machine's CPU (AMX, one thread) SmolLM2 in bfloat16 decoded 2.4-2.6x
        faster than in float32 and prefilled 1.3-1.6x (`benchmarks/engine_throughput.py`).
        """
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.device_type == "cuda":
            return torch.bfloat16
        if weights_dtype in HALF_WEIGHTS and cpu_multiplies_bfloat16():
            return torch.bfloat16
        return torch.float32

    @property
    def world_size(self) -> int:
        """Number of ranks: tp * pp."""
        return self.tp * self.pp


def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU has bfloat16 multiply instructions (AMX tiles or AVX512-BF16)."""
    import torch

    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
