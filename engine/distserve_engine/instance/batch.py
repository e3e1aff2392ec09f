"""The running decode batch: admission by KV reservation, one step, finished requests.

Shared by the decode instance and the colocated instance. A request is admitted only
when the KV blocks it may ever need (prompt plus `max_tokens`) fit beside the blocks
already promised to the running requests, and the batch is below its maximum size.
# NOTE: reserving the worst case means a running request never runs out of blocks, so
# there is no preemption and no recomputation; the price is fewer concurrent requests
# when `max_tokens` is much larger than what requests really generate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distserve_engine.instance.loop import Sink
from distserve_engine.interface import Runner
from distserve_engine.request import ServeRequest, TokenEvent, TransferStats, now_s
from distserve_engine.sequence import Sequence


@dataclass
class Running:
    """A request in the decode batch and whom to tell about its tokens."""

    request: ServeRequest
    seq: Sequence
    sink: Sink
    queued_s: float
    started_s: float
    transfer: TransferStats | None = None
    is_first_event: bool = True


@dataclass
class Admission:
    """The KV blocks promised to admitted requests, against the cache's capacity."""

    num_blocks: int  # blocks in the cache
    block_size: int
    max_batch_size: int
    committed_blocks: int = 0
    num_admitted: int = 0
    request_id_to_blocks: dict[str, int] = field(default_factory=dict)

    def blocks_for(self, request: ServeRequest) -> int:
        """Blocks a request may need by its last token."""
        num_tokens = request.num_prompt_tokens + request.params.max_tokens
        return -(-num_tokens // self.block_size)

    def can_admit(self, request: ServeRequest) -> bool:
        """True when the request fits in batch size and KV beside those admitted."""
        is_room = self.committed_blocks + self.blocks_for(request) <= self.num_blocks
        return is_room and self.num_admitted < self.max_batch_size

    def admit(self, request: ServeRequest) -> None:
        """Promise the request its blocks."""
        blocks = self.blocks_for(request)
        self.committed_blocks += blocks
        self.num_admitted += 1
        self.request_id_to_blocks[request.request_id] = blocks

    def release(self, request_id: str) -> None:
        """Take back a request's promise (finished, cancelled or failed)."""
        blocks = self.request_id_to_blocks.pop(request_id, None)
        if blocks is not None:
            self.committed_blocks -= blocks
            self.num_admitted -= 1

    @property
    def usage(self) -> float:
        """Share of blocks promised, in [0, 1]."""
        return min(1.0, self.committed_blocks / max(1, self.num_blocks))


class DecodeBatch:
    """The requests being decoded together, stepped one token at a time."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.running: dict[str, Running] = {}

    def __len__(self) -> int:
        return len(self.running)

    def add(self, item: Running) -> None:
        """Join the batch at the next step."""
        self.running[item.request.request_id] = item

    def step(self) -> list[Running]:
        """Decode one token for every running request; return those that finished."""
        items = list(self.running.values())
        self.runner.decode([item.seq for item in items])
        time_s = now_s()
        finished = []
        for item in items:
            text = self.runner.check_stop(item.seq)
            self.emit(item, item.seq.output_token_ids[-1], text, time_s)
            if item.seq.is_finished:
                finished.append(self.remove(item.request.request_id))
        return finished

    def emit(self, item: Running, token_id: int, text: str, time_s: float) -> None:
        """Send a new token (and the first event's timings) to the request's sink."""
        event = TokenEvent(item.request.request_id, [token_id], time_s, text=text,
                           finish_reason=item.seq.finish_reason)
        if item.is_first_event:
            event.queued_s, event.started_s, event.transfer = (
                item.queued_s,
                item.started_s,
                item.transfer,
            )
            item.is_first_event = False
        item.sink(event)

    def remove(self, request_id: str) -> Running | None:
        """Leave the batch and free the KV; the caller releases the reservation."""
        item = self.running.pop(request_id, None)
        if item is not None:
            self.runner.free(item.seq)
        return item

    def fail_all(self, error: str) -> list[Running]:
        """Error every running request; free their KV."""
        items = list(self.running.values())
        for item in items:
            item.sink(TokenEvent(item.request.request_id, [], now_s(), error=error))
            self.remove(item.request.request_id)
        return items
