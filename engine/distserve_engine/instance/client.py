"""How the router talks to an instance: in the same process, or over HTTP.

Both clients implement `interface.InstanceClient`, so the router never knows where an
instance runs: `prefill` (one PrefillOutput), `decode` and `generate` (a stream of
TokenEvents), `cancel`, and `load`. A failure of the instance (an error event, a
refused connection, a broken stream) surfaces as `InstanceError`, at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from distserve_engine.interface import InstanceError
from distserve_engine.request import InstanceLoad, PrefillOutput, ServeRequest, TokenEvent

CONNECT_TIMEOUT_S = 5.0

__all__ = ["HttpInstanceClient", "InstanceError", "LocalInstanceClient"]


def _check(event: Any) -> Any:
    if isinstance(event, TokenEvent) and event.error is not None:
        raise InstanceError(event.error)
    return event


class LocalInstanceClient:
    """An instance object in this process; its events hop onto the event loop."""

    def __init__(self, instance: Any) -> None:
        self.instance = instance
        self.name: str = instance.name
        self.role: str = instance.role
        self.url: str | None = None
        self.node: str | None = None
        self.is_draining = False

    def _sink(self, queue: asyncio.Queue) -> Any:
        loop = asyncio.get_running_loop()
        return lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)

    async def prefill(self, request: ServeRequest) -> PrefillOutput:
        """Prefill one request; its first token and KV handle."""
        queue: asyncio.Queue = asyncio.Queue()
        self.instance.submit(request, self._sink(queue))
        return _check(await queue.get())

    async def decode(self, request: ServeRequest, prefill: PrefillOutput) -> AsyncIterator[TokenEvent]:
        """Decode a prefilled request; its token events."""
        queue: asyncio.Queue = asyncio.Queue()
        self.instance.submit(request, prefill, self._sink(queue))
        async for event in self._drain(queue):
            yield event

    async def generate(self, request: ServeRequest) -> AsyncIterator[TokenEvent]:
        """Both phases on a colocated instance; its token events."""
        queue: asyncio.Queue = asyncio.Queue()
        self.instance.submit(request, self._sink(queue))
        async for event in self._drain(queue):
            yield event

    async def _drain(self, queue: asyncio.Queue) -> AsyncIterator[TokenEvent]:
        while True:
            event = _check(await queue.get())
            yield event
            if event.is_last:
                return

    async def cancel(self, request_id: str) -> None:
        """Stop the request on the instance and free its KV."""
        self.instance.cancel(request_id)

    async def load(self) -> InstanceLoad:
        """The instance's queue and KV snapshot."""
        return self.instance.load()

    async def close(self) -> None:
        """Nothing to close in-process."""


class HttpInstanceClient:
    """An instance server (`python -m distserve_engine.server --role ...`) at a URL."""

    def __init__(self, name: str, role: str, url: str, node: str | None = None,
                 is_draining: bool = False) -> None:
        self.name = name
        self.role = role
        self.url = url.rstrip("/")
        self.node = node  # where it runs: the router prefers decode on a prefill's node
        self.is_draining = is_draining  # the router sends it nothing new
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))

    async def prefill(self, request: ServeRequest) -> PrefillOutput:
        """POST /prefill; waits for the first token."""
        doc = await self._post_json("/prefill", {"request": request.to_dict()})
        return PrefillOutput.from_dict(doc)

    async def decode(self, request: ServeRequest, prefill: PrefillOutput) -> AsyncIterator[TokenEvent]:
        """POST /decode; a stream of JSON lines."""
        body = {"request": request.to_dict(), "prefill": prefill.to_dict()}
        async for event in self._stream("/decode", body):
            yield event

    async def generate(self, request: ServeRequest) -> AsyncIterator[TokenEvent]:
        """POST /generate on a colocated instance; a stream of JSON lines."""
        async for event in self._stream("/generate", {"request": request.to_dict()}):
            yield event

    async def cancel(self, request_id: str) -> None:
        """DELETE /requests/{id}; an unreachable instance has nothing left to free."""
        try:
            await self._client.delete(f"{self.url}/requests/{request_id}", timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError:
            pass

    async def load(self) -> InstanceLoad:
        """GET /load."""
        try:
            response = await self._client.get(f"{self.url}/load", timeout=CONNECT_TIMEOUT_S)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise InstanceError(f"instance {self.name} at {self.url} unreachable: {exc}") from exc
        return InstanceLoad.from_dict(response.json())

    async def close(self) -> None:
        """Close the connections."""
        await self._client.aclose()

    async def _post_json(self, path: str, body: dict) -> dict:
        try:
            response = await self._client.post(f"{self.url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise InstanceError(f"instance {self.name} at {self.url} failed: {exc}") from exc
        doc = response.json()
        if response.status_code != 200 or "error" in doc:
            raise InstanceError(doc.get("error") or f"instance {self.name}: HTTP {response.status_code}")
        return doc

    async def _stream(self, path: str, body: dict) -> AsyncIterator[TokenEvent]:
        try:
            async with self._client.stream("POST", f"{self.url}{path}", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise InstanceError(f"instance {self.name}: HTTP {response.status_code} {text}")
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    event = _check(TokenEvent.from_dict(json.loads(line)))
                    yield event
                    if event.is_last:
                        return
        except httpx.HTTPError as exc:
            raise InstanceError(f"instance {self.name} at {self.url} failed: {exc}") from exc
        raise InstanceError(f"instance {self.name} ended the stream early")
