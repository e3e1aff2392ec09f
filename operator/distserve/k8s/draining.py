"""When an old revision may be deleted: once the router has stopped sending to it and its
instances are idle, or at the drain timeout.

Draining starts when the router's ConfigMap marks the old instances; kubelet brings the
new file to the router pods within its sync period (about a minute), so nothing is
judged idle before `drain_min_seconds`. After that the operator asks each old instance's
`GET /load` (the engine's instance API): idle means nothing queued, running or held for
a pull. An instance the operator cannot reach is not known to be idle; it goes at the
drain timeout, and its pod's own grace period still lets in-flight requests finish.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

PROBE_TIMEOUT_S = 2.0


async def probe_load(url: str) -> dict[str, Any] | None:
    """An instance's load document, or None when it cannot be reached."""
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{url.rstrip('/')}/load") as response:
                if response.status != 200:
                    return None
                return await response.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def is_idle_load(load: dict[str, Any] | None) -> bool:
    """Whether a load document says the instance has no request left (None: unknown)."""
    if load is None:
        return False
    return not any(load.get(k) for k in ("num_waiting", "num_running", "num_held"))


async def instances_idle(instances: list[dict[str, Any]]) -> bool:
    """Whether every listed instance (router.json entries) is reachable and idle."""
    loads = await asyncio.gather(*(probe_load(e["url"]) for e in instances))
    return all(is_idle_load(load) for load in loads)


async def verdict(instances: list[dict[str, Any]], elapsed_s: float, min_s: float,
                  timeout_s: float) -> str | None:
    """"idle" or "timeout" when the old instances may be deleted now, else None."""
    if elapsed_s >= timeout_s:
        return "timeout"
    if elapsed_s < min(min_s, timeout_s):
        return None
    return "idle" if await instances_idle(instances) else None
