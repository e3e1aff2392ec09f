"""The running decode batch: KV blocks allocated as sequences grow, preemption by recompute.

Shared by the decode instance and the colocated instance; the rule is vLLM's default,
written once in `distserve_engine.policy` and followed by the simulator too:
- `Admission`: a waiting request joins when the batch is below its maximum size and the
  blocks its next step needs are free beside those the running requests' next step
  needs and those promised to KV pulls in flight; `max_tokens` is not read, so a
  client that sets it loosely costs nothing;
- `DecodeBatch.step`: before each decode step every running request gets the blocks its
  newest token needs, in the order they were admitted; when the free blocks run out, the
  most recently admitted request is preempted: its blocks are freed and the instance puts
  it back at the front of its queue, its prompt and generated tokens kept;
- `DecodeBatch.prefill`: a preempted request, admitted again, is prefilled again on this
  instance (prompt and generated tokens); that prefill samples its next token, the one
  the decode step would have, so greedy output does not change.
# NOTE: the price of growing instead of reserving prompt + max_tokens is recomputation
# when the cache runs out; the gain is as many concurrent requests as really fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distserve_engine import policy
from distserve_engine.block_manager import BlockManager
from distserve_engine.instance.iterations import IterationLog, decode_lens, prefill_lens
from distserve_engine.instance.loop import Sink
from distserve_engine.interface import Runner
from distserve_engine.request import ServeRequest, TokenEvent, TransferStats, now_s
from distserve_engine.sequence import Sequence


@dataclass
class Running:
    """A request in the decode batch (or preempted, waiting to rejoin) and whom to tell."""

    request: ServeRequest
    seq: Sequence
    sink: Sink
    queued_s: float
    started_s: float
    transfer: TransferStats | None = None
    is_first_event: bool = True


@dataclass
class Admission:
    """Who may join the decode batch: its size, the free blocks, the blocks promised.

    # NOTE: the cache holds at least one sequence of max_model_len tokens (the runner
    # refuses a smaller one), so a request alone in the batch always fits: preemption
    # cannot starve it.
    """

    block_manager: BlockManager
    max_batch_size: int
    num_preemptions: int = 0  # since the instance started (vllm:num_preemptions_total)
    request_id_to_promise: dict[str, int] = field(default_factory=dict)  # blocks, until in
    admitted_ids: set[str] = field(default_factory=set)  # running, pulling or recomputing

    @property
    def num_admitted(self) -> int:
        """Requests admitted and not yet finished, cancelled or preempted."""
        return len(self.admitted_ids)

    @property
    def num_free_blocks(self) -> int:
        """Blocks free and not promised to an admitted request whose KV is not in yet."""
        promised = sum(self.request_id_to_promise.values())
        return self.block_manager.num_free_blocks - promised

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        return self.block_manager.num_blocks_for(num_tokens)

    def can_admit(self, num_tokens: int, batch: DecodeBatch) -> bool:
        """True when a request whose next step holds num_tokens tokens may join now,
        beside the blocks `batch`'s next step needs."""
        return policy.can_admit(self.num_admitted, self.max_batch_size,
                                self.blocks_for(num_tokens), self.num_free_for(batch))

    def num_free_for(self, batch: DecodeBatch) -> int:
        """Blocks free for newcomers: free, less promised, less the batch's next step."""
        return self.num_free_blocks - batch.num_new_blocks()

    def admit(self, request_id: str, num_tokens: int) -> None:
        """Count the request in the batch; promise its blocks until `settle`."""
        self.admitted_ids.add(request_id)
        self.request_id_to_promise[request_id] = self.blocks_for(num_tokens)

    def settle(self, request_id: str) -> None:
        """The request's KV is about to be written into the cache: drop its promise."""
        self.request_id_to_promise.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """The request left the batch (finished, cancelled, failed or preempted)."""
        self.settle(request_id)
        self.admitted_ids.discard(request_id)

    def preempt(self, request_id: str) -> None:
        """The request was preempted: it leaves the batch and is counted."""
        self.release(request_id)
        self.num_preemptions += 1

    @property
    def usage(self) -> float:
        """Share of blocks in use or promised, in [0, 1]."""
        num_blocks = max(1, self.block_manager.num_blocks)
        return min(1.0, 1.0 - self.num_free_blocks / num_blocks)


class DecodeBatch:
    """The requests being decoded together, stepped one token at a time."""

    def __init__(self, runner: Runner, iterations: IterationLog | None = None) -> None:
        self.runner = runner
        self.iterations = iterations or IterationLog()  # each runner call, timed
        self.running: dict[str, Running] = {}  # in the order they were admitted

    def __len__(self) -> int:
        return len(self.running)

    def add(self, item: Running) -> None:
        """Join the batch at the next step."""
        self.running[item.request.request_id] = item

    def num_new_blocks(self) -> int:
        """Blocks the running requests must gain for their next step."""
        blocks = self.runner.block_manager
        return sum(blocks.num_new_blocks(item.seq, item.seq.num_tokens)
                   for item in self.running.values())

    def step(self, num_free_blocks: int) -> tuple[list[Running], list[Running]]:
        """Make room (preempting), then decode one token for every running request;
        return (those that finished, those preempted, oldest first)."""
        preempted = self.make_room(num_free_blocks)
        if not self.running:
            return [], preempted
        items = list(self.running.values())
        seqs = [item.seq for item in items]
        self.iterations.run("decode", decode_lens(seqs), lambda: self.runner.decode(seqs))
        return self._emit_all(items, now_s()), preempted

    def make_room(self, num_free_blocks: int) -> list[Running]:
        """Preempt the most recently admitted requests until the others' newest tokens
        fit in num_free_blocks; return them oldest first, their blocks freed."""
        blocks = self.runner.block_manager
        items = list(self.running.values())
        needs = [blocks.num_new_blocks(item.seq, item.seq.num_tokens) for item in items]
        total = sum(needs)
        preempted = []
        while items and total > num_free_blocks:
            victim = items.pop()
            total -= needs.pop()
            num_free_blocks += len(victim.seq.block_table)
            preempted.append(self.remove(victim.request.request_id))
        preempted.reverse()
        return preempted

    def prefill(self, items: list[Running]) -> list[Running]:
        """Prefill new or preempted requests (every uncached token), stream the token each
        samples, and join them to the batch; return those that finished."""
        seqs = [item.seq for item in items]
        self.iterations.run("prefill", prefill_lens(seqs), lambda: self.runner.prefill(seqs))
        for item in items:
            self.add(item)
        return self._emit_all(items, now_s())

    def _emit_all(self, items: list[Running], time_s: float) -> list[Running]:
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
        """Leave the batch and free the KV; the caller releases the admission."""
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

