"""Picks the transport for one pull from where the KV is, does it, and times it.

The choice rests on proof, never on names: in-process when the prefill instance is
registered in this process; shared memory when this process sees the token file the
prefill's arena wrote in /dev/shm (pods of one node each have their own /dev/shm, and
may share a host name); TCP otherwise.
"""

from __future__ import annotations

import threading

import httpx

from distserve_engine.kv_cache import KVBlob
from distserve_engine.request import KVHandle, TransferStats, now_s
from distserve_engine.transfer import inprocess, shm, tcp

DEFAULT_ARENA_BYTES = 256 << 20  # the decode side's shared-memory arena, unless told


class KVFetcher:
    """The decode instance's side of every transport."""

    def __init__(self, arena_bytes: int = DEFAULT_ARENA_BYTES) -> None:
        self.arena_bytes = arena_bytes
        self._client = httpx.Client()
        self._arena: shm.Arena | None = None  # made at the first shared-memory pull
        self._arena_lock = threading.Lock()
        self._token_to_is_shared: dict[str, bool] = {}  # a prefill's token is checked once

    def transport_for(self, handle: KVHandle) -> str:
        """'inprocess', 'shm' or 'tcp', from what this process can reach of the handle."""
        if inprocess.can_fetch(handle):
            return "inprocess"
        if handle.shm_token and self._sees(handle.shm_token):
            return "shm"
        return "tcp"

    def _sees(self, token: str) -> bool:
        is_shared = self._token_to_is_shared.get(token)
        if is_shared is None:
            is_shared = self._token_to_is_shared[token] = shm.sees_token(token)
        return is_shared

    def fetch(self, handle: KVHandle) -> tuple[KVBlob, TransferStats]:
        """Pull the KV (blocking); the prefill instance frees it. A shared-memory blob is a
        view of this side's arena until `release(handle)`."""
        transport = self.transport_for(handle)
        started_s = now_s()
        blob = None
        if transport == "inprocess":
            blob = inprocess.fetch(handle)
        elif transport == "shm":
            blob = self._fetch_shm(handle)
            transport = "shm" if blob is not None else "tcp"
        if blob is None:
            blob = tcp.fetch(self._client, handle)
        return blob, TransferStats(transport, blob.nbytes, started_s, now_s())

    def _fetch_shm(self, handle: KVHandle) -> KVBlob | None:
        """One call: the prefill exports straight into a range of this side's arena; None
        when the arena has no room (the caller goes over TCP)."""
        arena = self._own_arena()
        where = arena.reserve(handle.request_id, handle.nbytes)
        if where is None:
            return None
        try:
            response = self._client.post(f"{handle.url}/kv/{handle.request_id}/shm", json=where,
                                         timeout=tcp.TIMEOUT_S)
            response.raise_for_status()
            return arena.view(handle.request_id, response.json())
        except BaseException:
            arena.release(handle.request_id)
            raise

    def _own_arena(self) -> shm.Arena:
        with self._arena_lock:
            if self._arena is None:
                self._arena = shm.Arena(self.arena_bytes)
            return self._arena

    def release(self, handle: KVHandle) -> None:
        """After the import (or a cancel): free the blob's range of the arena, if it has one."""
        if self._arena is not None:
            self._arena.release(handle.request_id)

    def close(self) -> None:
        """Close the HTTP connections and remove the arena's file."""
        self._client.close()
        if self._arena is not None:
            self._arena.close()
