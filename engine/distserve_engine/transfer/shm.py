"""Shared-memory KV transfer between processes of one host.

The prefill side writes K and V into one file under /dev/shm (memory, not disk) and
answers with its name and header; the decode side reads it and deletes it. One copy
out of the prefill cache (the export), one into the file, one out of it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from distserve_engine.kv_cache import KVBlob
from distserve_engine.transfer.codec import blob_bytes, blob_from_bytes, blob_header

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def is_available() -> bool:
    """True when a memory-backed folder exists."""
    return SHM_DIR == Path("/dev/shm")


def write(blob: KVBlob) -> dict[str, Any]:
    """Prefill side: put the blob in a new shared-memory file; return its header."""
    path = SHM_DIR / f"distserve-kv-{uuid.uuid4().hex}"
    k_bytes, v_bytes = blob_bytes(blob)
    with open(path, "wb") as f:
        f.write(k_bytes)
        f.write(v_bytes)
    return {**blob_header(blob), "path": str(path)}


def read(header: dict[str, Any]) -> KVBlob:
    """Decode side: read the file the header names, then delete it."""
    path = Path(header["path"])
    if path.parent != SHM_DIR or not path.name.startswith("distserve-kv-"):
        raise ValueError(f"KV shared-memory path outside {SHM_DIR}: {path}")
    try:
        data = bytearray(os.path.getsize(path))
        with open(path, "rb", buffering=0) as f:
            f.readinto(data)
    finally:
        path.unlink(missing_ok=True)
    return blob_from_bytes(header, data)
