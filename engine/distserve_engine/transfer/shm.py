"""Shared-memory KV transfer between processes that see the same /dev/shm.

The decode process owns an arena: a file under /dev/shm (memory, not disk) mapped once
as a shared tensor, lent out in ranges. A pull reserves a range for the request's KV
(its size is in the `KVHandle`) and asks the prefill instance, in one HTTP call
(control only), to export the KV straight into that range; the prefill process maps
the arena once by its path, writes K then V there from its cache, frees its blocks and
answers with the blob's header. The decode side views the range and its engine thread
copies it into its own cache, then releases the range locally. A transfer costs two
memory copies (cache -> arena -> cache), one HTTP exchange, and no page faults, file
writes or HTTP bodies; the arena's pages are touched once and stay resident.

Shared memory is chosen only on proof that both processes see the same /dev/shm: a
prefill process writes a token file of a random name, and its name travels in the
`KVHandle`. A decode process that finds the token in its own /dev/shm shares the
prefill's memory; one that does not (another pod, another host, even with the same host
name) pulls over TCP. Nothing here creates a file it was told of: a file that is not
there raises `ArenaError`, so a decode never runs on zero-filled KV.
# NOTE: when the arena has no free range (more KV in flight than it holds) the pull
# goes over TCP instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from distserve_engine.kv_cache import KVBlob
from distserve_engine.transfer.codec import NAME_TO_DTYPE, kv_views

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
PREFIX = "distserve-kv-"
TOKEN_PREFIX = f"{PREFIX}token-"
ALIGN_BYTES = 4096  # ranges start on a page
# A prefill keeps at most this many decode arenas mapped: one per decode process it has
# served, so a decode that died and came back does not pin its old arena's memory forever.
MAX_MAPPED_ARENAS = 16


class ArenaError(RuntimeError):
    """A shared-memory KV file named in a pull is missing, too short or not ours."""


def is_available() -> bool:
    """True when a memory-backed folder exists."""
    return SHM_DIR == Path("/dev/shm")


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


def _create(path: Path, nbytes: int) -> torch.Tensor:
    """A new file as a shared uint8 tensor (writes reach every process mapping it)."""
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def _open_existing(path: Path, nbytes: int) -> torch.Tensor:
    """An existing file of at least `nbytes` as a shared uint8 tensor; never creates one."""
    if path.parent != SHM_DIR or not path.name.startswith(PREFIX):
        raise ArenaError(f"KV shared-memory path outside {SHM_DIR}/{PREFIX}*: {path}")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise ArenaError(f"shared-memory KV file {path} is not in this process's {SHM_DIR}: "
                         "the two instances do not share /dev/shm") from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ArenaError(f"shared-memory KV file {path} holds {size} bytes, {nbytes} expected")
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory
    return torch.frombuffer(mapping, dtype=torch.uint8)


def remove_orphaned_arenas() -> list[Path]:
    """Remove the arenas of decode processes that died without closing them (each live one
    holds a shared lock on its file); the paths removed."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}arena-*"):
        with contextlib.suppress(OSError), open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class Arena:
    """Decode side: ranges of one shared-memory file, each held by one pull until released.

    The owner holds a shared lock on the file while it lives, so an arena whose process
    died is found and removed by the next arena made on this /dev/shm.
    """

    def __init__(self, capacity_bytes: int) -> None:
        remove_orphaned_arenas()
        self.capacity_bytes = capacity_bytes
        self.path = SHM_DIR / f"{PREFIX}arena-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.data = _create(self.path, capacity_bytes)  # sparse until written
        self._lock_file = open(self.path, "rb")  # noqa: SIM115 - held for the arena's life
        fcntl.flock(self._lock_file, fcntl.LOCK_SH)
        self._lock = threading.Lock()
        self._request_id_to_range: dict[str, tuple[int, int]] = {}  # offset, size

    def reserve(self, request_id: str, nbytes: int) -> dict[str, Any] | None:
        """A free range for the request's KV, as the prefill side is told of it; None when full."""
        size = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        with self._lock:
            offset = self._first_fit(size)
            if offset is None:
                return None
            self._request_id_to_range[request_id] = (offset, size)
        return {"path": str(self.path), "arena_bytes": self.capacity_bytes,
                "offset": offset, "nbytes": size}

    def view(self, request_id: str, header: dict[str, Any]) -> KVBlob:
        """The request's K and V as the prefill wrote them into its range (no copy)."""
        offset, size = self._request_id_to_range[request_id]
        if header["nbytes"] > size:
            raise ArenaError(f"KV of {header['nbytes']} bytes in a {size}-byte range")
        buffer = self.data[offset : offset + header["nbytes"]]
        k, v = kv_views(buffer, header["shape"], NAME_TO_DTYPE[header["dtype"]])
        return KVBlob(k=k, v=v, num_tokens=header["num_tokens"])

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
        """Remove the file (processes that mapped it keep their mapping)."""
        self.path.unlink(missing_ok=True)
        self._lock_file.close()


class ArenaWriter:
    """Prefill side: decode arenas mapped once each; a pull's range as a buffer to export into."""

    def __init__(self) -> None:
        self._path_to_data: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def range(self, where: dict[str, Any]) -> torch.Tensor:
        """The uint8 range `where` (from `Arena.reserve`) names; ArenaError when not there."""
        path, arena_bytes = str(where["path"]), int(where["arena_bytes"])
        offset, nbytes = int(where["offset"]), int(where["nbytes"])
        if offset < 0 or nbytes < 0 or offset + nbytes > arena_bytes:
            raise ArenaError(f"range {offset}+{nbytes} outside the {arena_bytes}-byte arena {path}")
        with self._lock:
            data = self._path_to_data.get(path)
            if data is None or data.numel() < arena_bytes:
                data = _open_existing(Path(path), arena_bytes)
                if len(self._path_to_data) >= MAX_MAPPED_ARENAS:
                    del self._path_to_data[next(iter(self._path_to_data))]  # the oldest
                self._path_to_data[path] = data
        return data[offset : offset + nbytes]
