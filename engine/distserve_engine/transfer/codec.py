"""KV blob <-> bytes: a small JSON header (shape, dtype) and K then V, raw."""

from __future__ import annotations

from typing import Any

import torch

from distserve_engine.kv_cache import KVBlob, kv_views

__all__ = ["NAME_TO_DTYPE", "blob_bytes", "blob_from_bytes", "blob_header", "kv_views"]

NAME_TO_DTYPE = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def blob_header(blob: KVBlob) -> dict[str, Any]:
    """What the receiver needs to rebuild the tensors."""
    return {
        "shape": list(blob.k.shape),  # (L, n, Hkv, D), V has the same
        "dtype": str(blob.k.dtype).removeprefix("torch."),
        "num_tokens": blob.num_tokens,
        "nbytes": blob.nbytes,
    }


def blob_bytes(blob: KVBlob) -> tuple[memoryview, memoryview]:
    """Views of K's and V's bytes (no copy when the tensors are contiguous on the CPU)."""
    return _raw(blob.k), _raw(blob.v)


def blob_from_bytes(header: dict[str, Any], data: bytes | bytearray | memoryview) -> KVBlob:
    """Rebuild a blob from its header and the K-then-V bytes."""
    dtype = NAME_TO_DTYPE[header["dtype"]]
    half = header["nbytes"] // 2
    if len(data) != 2 * half:
        raise ValueError(f"KV bytes: expected {2 * half}, got {len(data)}")
    flat = torch.frombuffer(data, dtype=torch.uint8)

    def tensor(start: int) -> torch.Tensor:
        return flat[start : start + half].view(dtype).reshape(header["shape"])

    return KVBlob(k=tensor(0), v=tensor(half), num_tokens=header["num_tokens"])


def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")
