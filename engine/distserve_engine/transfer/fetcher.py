"""Picks the transport for one pull from where the KV is, and times it."""

from __future__ import annotations

import httpx

from distserve_engine.kv_cache import KVBlob
from distserve_engine.request import HOSTNAME, KVHandle, TransferStats, now_s
from distserve_engine.transfer import inprocess, shm, tcp


class KVFetcher:
    """The decode instance's side of every transport."""

    def __init__(self) -> None:
        self._client = httpx.Client()
        self._arenas = shm.ArenaReader()

    def transport_for(self, handle: KVHandle) -> str:
        """'inprocess', 'shm' or 'tcp', from the handle's process and host."""
        if inprocess.can_fetch(handle):
            return "inprocess"
        if handle.host == HOSTNAME and shm.is_available():
            return "shm"
        return "tcp"

    def fetch(self, handle: KVHandle) -> tuple[KVBlob, TransferStats]:
        """Pull the KV (blocking); the prefill instance frees it."""
        transport = self.transport_for(handle)
        started_s = now_s()
        if transport == "inprocess":
            blob = inprocess.fetch(handle)
        elif transport == "shm":
            response = self._client.post(f"{handle.url}/kv/{handle.request_id}/shm", timeout=tcp.TIMEOUT_S)
            response.raise_for_status()
            blob = self._arenas.view(response.json())  # a view: copied by the import
        else:
            blob = tcp.fetch(self._client, handle)
        return blob, TransferStats(transport, blob.nbytes, started_s, now_s())

    def release(self, handle: KVHandle) -> None:
        """After the import: let the prefill instance reuse the shared memory (shm only)."""
        if self.transport_for(handle) != "shm":
            return
        try:
            self._client.delete(f"{handle.url}/kv/{handle.request_id}/shm", timeout=tcp.TIMEOUT_S)
        except httpx.HTTPError:  # the prefill instance is gone, and its arena with it
            pass

    def close(self) -> None:
        """Close the HTTP connections."""
        self._client.close()
