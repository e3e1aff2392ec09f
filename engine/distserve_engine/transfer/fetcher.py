"""Picks the transport for one pull from where the KV is, and times it.

The choice rests on proof, never on names: in-process when the prefill instance is
registered in this process; shared memory when this process sees the token file the
prefill's arena wrote in /dev/shm (pods of one node each have their own /dev/shm, and
may share a host name); TCP otherwise.
"""

from __future__ import annotations

import httpx

from distserve_engine.kv_cache import KVBlob
from distserve_engine.request import KVHandle, TransferStats, now_s
from distserve_engine.transfer import inprocess, shm, tcp


class KVFetcher:
    """The decode instance's side of every transport."""

    def __init__(self) -> None:
        self._client = httpx.Client()
        self._arenas = shm.ArenaReader()
        self._token_to_is_shared: dict[str, bool] = {}  # an arena's token is checked once

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
