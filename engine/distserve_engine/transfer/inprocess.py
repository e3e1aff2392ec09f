"""In-process KV handover: the prefill instance's export goes straight to the decoder."""

from __future__ import annotations

from typing import Any

from distserve_engine.kv_cache import KVBlob
from distserve_engine.request import KVHandle

# Prefill instances living in this process, by name (registered by whoever builds them).
NAME_TO_PREFILL: dict[str, Any] = {}


def register(instance: Any) -> None:
    """Make a prefill instance reachable by in-process pulls."""
    NAME_TO_PREFILL[instance.name] = instance


def unregister(instance: Any) -> None:
    """Forget a prefill instance (stopped)."""
    if NAME_TO_PREFILL.get(instance.name) is instance:
        del NAME_TO_PREFILL[instance.name]


def can_fetch(handle: KVHandle) -> bool:
    """True when the holder of this KV lives in this process."""
    return handle.instance in NAME_TO_PREFILL


def fetch(handle: KVHandle) -> KVBlob:
    """Take the KV from the prefill instance (it frees its blocks)."""
    instance = NAME_TO_PREFILL[handle.instance]
    try:
        return instance.take_kv(handle.request_id)
    except KeyError:
        raise LookupError(f"{handle.instance} holds no KV for {handle.request_id}") from None
