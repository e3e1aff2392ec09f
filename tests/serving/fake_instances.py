"""Instance clients for router tests: they answer only when a test opens their gate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from distserve_engine.request import (
    InstanceLoad,
    PrefillOutput,
    ServeRequest,
    TokenEvent,
    now_s,
)
from distserve_engine.sequence import DetokenizerState


class GatedClient:
    """A prefill or decode instance that holds every request until `gate` is set; the
    prefill answers token 1 and a handle, the decode two more tokens."""

    def __init__(self, name: str, role: str, gate: asyncio.Event | None = None) -> None:
        self.name, self.role = name, role
        self.url = None
        self.node = None
        self.is_draining = False
        self.gate = gate
        self.num_started = 0  # requests that reached this instance

    async def _wait(self) -> None:
        self.num_started += 1
        if self.gate is not None:
            await self.gate.wait()

    async def prefill(self, request: ServeRequest) -> PrefillOutput:
        await self._wait()
        t = now_s()
        return PrefillOutput(request.request_id, 1, "a", None, None, DetokenizerState(), t, t, t,
                             self.name)

    async def decode(self, request: ServeRequest, prefill: PrefillOutput) -> AsyncIterator[TokenEvent]:
        await self._wait()
        yield TokenEvent(request.request_id, [2], now_s(), text="b")
        yield TokenEvent(request.request_id, [3], now_s(), text="c", finish_reason="length")

    async def generate(self, request: ServeRequest) -> AsyncIterator[TokenEvent]:
        raise NotImplementedError

    async def cancel(self, request_id: str) -> None:
        pass

    async def load(self) -> InstanceLoad:
        return InstanceLoad(self.name, self.role)

    async def close(self) -> None:
        pass


class WordTokenizer:
    """One token per word (id = its length), enough for the frontend to run."""

    vocab_size = 100
    eos_token_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(len(w), 99) for w in text.split()] or [1]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode(" ".join(m["content"] for m in messages))
