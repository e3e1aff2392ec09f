"""KV transfer over TCP: the raw bytes from the prefill instance's HTTP port.

The body is K then V; the header travels in `X-KV-Header` (JSON). Used between hosts,
where no memory is shared.
"""

from __future__ import annotations

import json

import httpx

from distserve_engine.kv_cache import KVBlob
from distserve_engine.request import KVHandle
from distserve_engine.transfer.codec import blob_bytes, blob_from_bytes, blob_header

HEADER = "X-KV-Header"
TIMEOUT_S = 120.0


def encode(blob: KVBlob) -> tuple[bytes, dict[str, str]]:
    """Prefill side: body bytes and the header to send."""
    k_bytes, v_bytes = blob_bytes(blob)
    return bytes(k_bytes) + bytes(v_bytes), {HEADER: json.dumps(blob_header(blob))}


def fetch(client: httpx.Client, handle: KVHandle) -> KVBlob:
    """Decode side: GET the bytes and rebuild the blob."""
    response = client.get(f"{handle.url}/kv/{handle.request_id}", timeout=TIMEOUT_S)
    response.raise_for_status()
    return blob_from_bytes(json.loads(response.headers[HEADER]), bytearray(response.content))
