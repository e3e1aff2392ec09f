"""Shared-memory KV transfer between processes of one host.

Each prefill process owns one arena: a file under /dev/shm (memory, not disk) mapped
once as a shared tensor. A pull asks the prefill instance over HTTP (control only) to
copy the request's KV into a free range of the arena and answers with its offset; the
decode process maps the arena once, views that range as K and V, and the engine thread
copies them straight into its own cache. Then the decode side releases the range
(`DELETE`), and the prefill side reuses it. The arena's pages are touched once and stay
resident, so a transfer costs two memory copies and no page faults, file writes or
HTTP bodies.

Shared memory is chosen only on proof that both processes see the same /dev/shm: each
arena comes with a token file of a random name, and its name travels in the `KVHandle`.
A decode process that finds the token in its own /dev/shm shares the prefill's memory;
one that does not (another pod, another host, even with the same host name) pulls over
TCP. A reader never creates a file: an arena that is not there raises `ArenaError`, so
a decode never runs on zero-filled KV.
# NOTE: when the arena has no free range (more KV in flight than it holds) the blob goes
# into a one-off file that the decode side unlinks after reading.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from distserve_engine.kv_cache import KVBlob
from distserve_engine.transfer.codec import NAME_TO_DTYPE, blob_header

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
PREFIX = "distserve-kv-"
TOKEN_PREFIX = f"{PREFIX}token-"
ALIGN_BYTES = 4096  # ranges start on a page


class ArenaError(RuntimeError):
    """A shared-memory KV file the decode side was told of is missing or too short."""


def is_available() -> bool:
    """True when a memory-backed folder exists."""
    return SHM_DIR == Path("/dev/shm")


def _create(path: Path, nbytes: int) -> torch.Tensor:
    """A new file as a shared uint8 tensor (writes reach every process mapping it)."""
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def _open_existing(path: Path, nbytes: int) -> torch.Tensor:
    """An existing file of at least `nbytes` as a shared uint8 tensor; never creates one."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise ArenaError(f"shared-memory KV file {path} is not in this process's {SHM_DIR}: "
                         "the prefill instance's /dev/shm is not shared with this one") from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ArenaError(f"shared-memory KV file {path} holds {size} bytes, {nbytes} expected")
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory
    return torch.frombuffer(mapping, dtype=torch.uint8)


def make_token() -> Path:
    """A token file of a random name whose content is its name: proof of a shared /dev/shm."""
    path = SHM_DIR / f"{TOKEN_PREFIX}{uuid.uuid4().hex}"
    path.write_text(path.name)
    return path


def sees_token(token: str) -> bool:
    """True when this process's /dev/shm holds the token file `token` (so it is shared)."""
    if not token.startswith(TOKEN_PREFIX) or "/" in token or not is_available():
        return False
    try:
        return (SHM_DIR / token).read_text() == token
    except OSError:
        return False


class Arena:
    """Prefill side: ranges of one shared-memory file, lent per request until released."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.path = SHM_DIR / f"{PREFIX}arena-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.data = _create(self.path, capacity_bytes)  # sparse until written
        self.token = make_token().name  # decode processes that see it may map the arena
        self._lock = threading.Lock()
        self._request_id_to_range: dict[str, tuple[int, int]] = {}  # offset, size

    def put(self, request_id: str, blob: KVBlob) -> dict[str, Any]:
        """Copy the blob into a free range; its header for the decode side."""
        size = -(-blob.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        with self._lock:
            offset = self._first_fit(size)
            if offset is None:
                return write_file(blob)
            self._request_id_to_range[request_id] = (offset, size)
        half = blob.nbytes // 2
        self.data[offset : offset + half].view(blob.k.dtype).view(blob.k.shape).copy_(blob.k)
        self.data[offset + half : offset + 2 * half].view(blob.v.dtype).view(blob.v.shape).copy_(blob.v)
        return {**blob_header(blob), "path": str(self.path), "offset": offset,
                "arena_bytes": self.capacity_bytes}

    def release(self, request_id: str) -> bool:
        """Free the request's range; False when it holds none."""
        with self._lock:
            return self._request_id_to_range.pop(request_id, None) is not None

    def _first_fit(self, size: int) -> int | None:
        start = 0
        for offset, used in sorted(self._request_id_to_range.values()):
            if offset - start >= size:
                return start
            start = offset + used
        return start if self.capacity_bytes - start >= size else None

    def close(self) -> None:
        """Remove the files (processes that mapped the arena keep their mapping)."""
        self.path.unlink(missing_ok=True)
        (SHM_DIR / self.token).unlink(missing_ok=True)


def write_file(blob: KVBlob) -> dict[str, Any]:
    """A one-off shared-memory file holding the blob; the reader unlinks it."""
    path = SHM_DIR / f"{PREFIX}{uuid.uuid4().hex}"
    data = _create(path, blob.nbytes)
    half = blob.nbytes // 2
    data[:half].view(blob.k.dtype).view(blob.k.shape).copy_(blob.k)
    data[half:].view(blob.v.dtype).view(blob.v.shape).copy_(blob.v)
    return {**blob_header(blob), "path": str(path), "offset": 0, "arena_bytes": None}


class ArenaReader:
    """Decode side: each arena mapped once; blobs are views into it (no copy)."""

    def __init__(self) -> None:
        self._path_to_data: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def view(self, header: dict[str, Any]) -> KVBlob:
        """K and V viewed in shared memory; a one-off file is unlinked once mapped.

        Raises `ArenaError` when the file is not in this process's /dev/shm.
        """
        path = Path(header["path"])
        if path.parent != SHM_DIR or not path.name.startswith(PREFIX):
            raise ValueError(f"KV shared-memory path outside {SHM_DIR}: {path}")
        if header.get("arena_bytes"):
            data = self._arena(path, header["arena_bytes"])
        else:
            try:
                data = _open_existing(path, header["nbytes"])
            finally:
                path.unlink(missing_ok=True)
        dtype, shape = NAME_TO_DTYPE[header["dtype"]], header["shape"]
        offset, half = header["offset"], header["nbytes"] // 2
        k = data[offset : offset + half].view(dtype).view(shape)  # (L, n, Hkv, D)
        v = data[offset + half : offset + 2 * half].view(dtype).view(shape)
        return KVBlob(k=k, v=v, num_tokens=header["num_tokens"])

    def _arena(self, path: Path, nbytes: int) -> torch.Tensor:
        with self._lock:
            data = self._path_to_data.get(str(path))
            if data is None:
                data = self._path_to_data[str(path)] = _open_existing(path, nbytes)
            return data
