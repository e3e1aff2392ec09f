"""The colocated instance: the baseline that runs both phases on one runner.

Continuous batching as in vLLM (and the paper's baseline): each iteration either
prefills a batch of waiting requests (FCFS, up to `max_prefill_tokens`, prefill first
so new requests start soon) or runs one decode step for every running request. A
prefill therefore stalls every running request for its whole duration: the
interference DistServe removes. KV grows with the sequences and a request preempted for
lack of blocks goes back to the front of the queue, to be prefilled again, as on the
decode instance (`batch.py`).
# NOTE: chunked prefill (Sarathi) would need the runner to prefill part of a prompt
# onto KV it already holds; the runner's `prefill` takes whole prompts, so this baseline
# has no chunked mode (the simulator models it).
"""

from __future__ import annotations

from distserve_engine import policy
from distserve_engine.instance.batch import Admission, DecodeBatch, Running
from distserve_engine.instance.loop import PromptQueueLoop, Waiting, start_sequence
from distserve_engine.interface import Runner
from distserve_engine.request import InstanceLoad, TokenEvent, now_s


def prefill_tokens(item: Waiting | Running) -> int:
    """Tokens a queued request's prefill computes: its prompt (and resumed tokens), or
    for a preempted one everything it holds."""
    return item.seq.num_tokens if isinstance(item, Running) else item.request.num_tokens


class ColocatedInstance(PromptQueueLoop):
    """Prefill and decode of the same requests on one runner, prefill first."""

    role = "colocated"

    def __init__(
        self, name: str, runner: Runner, max_prefill_tokens: int, max_batch_size: int
    ) -> None:
        super().__init__(name, runner)
        self.max_prefill_tokens = max_prefill_tokens
        self.batch = DecodeBatch(runner, self.iterations)
        self.admission = Admission(runner.block_manager, max_batch_size)
        # _waiting (FCFS) holds new requests (Waiting) and preempted ones (Running).

    def step(self) -> None:
        """Prefill the waiting requests that fit, else decode one token for all."""
        batch = self._schedule()
        if batch:
            for item in batch:
                self.admission.settle(item.request.request_id)
            self._release(self.batch.prefill(batch))
        elif len(self.batch):
            finished, preempted = self.batch.step(self.admission.num_free_blocks)
            self._release(finished)
            for item in reversed(preempted):
                self.admission.preempt(item.request.request_id)
                self._waiting.appendleft(item)

    def _release(self, items: list[Running]) -> None:
        for item in items:
            self.admission.release(item.request.request_id)

    def _schedule(self) -> list[Running]:
        """Admit the head of the queue: a prefill batch within Lm, batch size and free KV."""
        admission = self.admission
        room = min(admission.max_batch_size - admission.num_admitted,
                   self.runner.config.max_num_seqs)
        queue = ((n, admission.blocks_for(n)) for n in map(prefill_tokens, self._waiting))
        count = policy.num_prefill_batch(queue, self.max_prefill_tokens,
                                         admission.num_free_for(self.batch), room)
        started_s = now_s()
        batch = []
        for _ in range(count):
            item = self._waiting.popleft()
            if not isinstance(item, Running):
                item = Running(item.request, start_sequence(item.request, self.runner),
                               item.sink, item.queued_s, started_s)
            admission.admit(item.request.request_id, item.seq.num_tokens)
            batch.append(item)
        return batch

    def _has_work(self) -> bool:
        can_prefill = bool(self._waiting) and self.admission.can_admit(
            prefill_tokens(self._waiting[0]), self.batch)
        return bool(len(self.batch) or can_prefill)

    def _cancel(self, request_id: str) -> None:
        for item in list(self._waiting):
            if item.request.request_id == request_id:
                self._waiting.remove(item)
                item.sink(TokenEvent(request_id, [], now_s(), finish_reason="abort"))
        running = self.batch.remove(request_id)
        if running is not None:
            self.admission.release(request_id)
            running.sink(TokenEvent(request_id, [], now_s(), finish_reason="abort"))

    def _fail_all(self, error: str) -> None:
        for item in self.batch.fail_all(error):
            self.admission.release(item.request.request_id)
        while self._waiting:
            item = self._waiting.popleft()
            item.sink(TokenEvent(item.request.request_id, [], now_s(), error=error))

    def load(self) -> InstanceLoad:
        """Waiting queue, running batch, promised KV."""
        return self._queue_load(num_running=self._num_running(self.batch),
                                kv_usage=self.admission.usage,
                                num_preemptions=self.admission.num_preemptions)
