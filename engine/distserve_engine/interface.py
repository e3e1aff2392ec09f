"""The engine's two seams, written down: what an instance drives, and what a router calls.

`Runner` is the model as an instance loop sees it: `ModelRunner` on one rank, or
`DriverRunner` for an instance on tp x pp ranks (every call also replayed on the other
ranks). `InstanceClient` is an instance as the router sees it: `LocalInstanceClient` in
this process, or `HttpInstanceClient` at a URL. The router and the instance loops depend
on these Protocols only, so either side can change without the other noticing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: this module stays free of torch and transformers
    import torch

    from distserve_engine.block_manager import BlockManager
    from distserve_engine.config import EngineConfig
    from distserve_engine.kv_cache import KVBlob
    from distserve_engine.request import InstanceLoad, PrefillOutput, ServeRequest, TokenEvent
    from distserve_engine.sequence import Sequence
    from distserve_engine.tokenizer import Tokenizer


class InstanceError(RuntimeError):
    """The instance failed this request (it died, or refused it)."""


class Runner(Protocol):
    """One model and its paged KV cache; every method runs on the instance's engine
    thread, except `export_kv` and `import_kv`, which transfer threads may call."""

    config: EngineConfig  # the engine settings it was built with (tp, pp, block size, ...)
    tokenizer: Tokenizer
    max_model_len: int  # longest sequence (prompt plus output) the cache accepts

    @property
    def block_manager(self) -> BlockManager:
        """The KV blocks of the instance (equal on every rank); read to schedule."""

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes over the whole instance (what a pull moves)."""

    @property
    def kv_capacity_bytes(self) -> int:
        """Bytes of KV the whole instance's cache holds (sizes the shared-memory arena)."""

    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """Called with a new batch: run every uncached token, append one sampled token to
        each sequence (blocks are reserved here); the sampled tokens."""

    def decode(self, seqs: list[Sequence]) -> list[int]:
        """Called once per decode step with the running batch: one token each."""

    def check_stop(self, seq: Sequence) -> str:
        """Called after each new token: detokenize, set `seq.finish_reason` when a stop
        condition holds; the text that may be streamed now."""

    def free(self, seq: Sequence) -> None:
        """Called when a sequence finishes, is cancelled or has been pulled: free its blocks."""

    def export_kv(self, seq: Sequence, into: torch.Tensor | None = None) -> KVBlob:
        """Called when a decode instance pulls: the sequence's KV, every layer and head, as
        new tensors or written (K then V) into the host uint8 buffer `into`."""

    def import_kv(self, seq: Sequence, blob: KVBlob) -> None:
        """Called with a pulled blob: reserve blocks for `seq` and copy the KV into them."""


class InstanceClient(Protocol):
    """One prefill, decode or colocated instance as the router calls it. Every failure of
    the instance (an error event, a refused connection, a broken stream) is raised as
    `InstanceError` at once."""

    name: str  # unique among the router's instances
    role: str  # "prefill", "decode" or "colocated"
    url: str | None  # where it is served (None: in this process)
    node: str | None  # the node it runs on (None: unknown); decode dispatch prefers the prefill's
    is_draining: bool  # set by a peer update: no new requests, in-flight ones finish

    async def prefill(self, request: ServeRequest) -> PrefillOutput:
        """Prefill one request (prefill role); returns once its first token is out."""

    def decode(self, request: ServeRequest, prefill: PrefillOutput) -> AsyncIterator[TokenEvent]:
        """Decode a prefilled request (decode role); its token events, the last one ending it."""

    def generate(self, request: ServeRequest) -> AsyncIterator[TokenEvent]:
        """Both phases on a colocated instance; its token events."""

    async def cancel(self, request_id: str) -> None:
        """Stop the request wherever it is on the instance and free its KV."""

    async def load(self) -> InstanceLoad:
        """The instance's queue, batch and KV snapshot (polled for health and dispatch)."""

    async def close(self) -> None:
        """Release connections; the client is not used afterwards."""
