"""The colocated instance: the baseline that runs both phases on one runner.

Continuous batching as in vLLM (and the paper's baseline): each iteration either
prefills a batch of waiting requests (FCFS, up to `max_prefill_tokens`, prefill first
so new requests start soon) or runs one decode step for every running request. A
prefill therefore stalls every running request for its whole duration: the
interference DistServe removes. Admission reserves KV like the decode instance.
# NOTE: chunked prefill (Sarathi) would need the runner to prefill part of a prompt
# onto KV it already holds; the runner's `prefill` takes whole prompts, so this baseline
# has no chunked mode (the simulator models it).
"""

from __future__ import annotations

from distserve_engine.instance.batch import Admission, DecodeBatch, Running
from distserve_engine.instance.loop import PromptQueueLoop, Waiting, start_sequence
from distserve_engine.interface import Runner
from distserve_engine.request import InstanceLoad, TokenEvent, now_s


class ColocatedInstance(PromptQueueLoop):
    """Prefill and decode of the same requests on one runner, prefill first."""

    role = "colocated"

    def __init__(
        self, name: str, runner: Runner, max_prefill_tokens: int, max_batch_size: int
    ) -> None:
        super().__init__(name, runner)
        self.max_prefill_tokens = max_prefill_tokens
        self.batch = DecodeBatch(runner)
        self.admission = Admission(
            num_blocks=runner.block_manager.num_blocks,
            block_size=runner.block_manager.block_size,
            max_batch_size=max_batch_size,
        )

    def step(self) -> None:
        """Prefill the waiting requests that fit, else decode one token for all."""
        batch = self._schedule()
        if batch:
            self._prefill(batch)
        elif len(self.batch):
            for item in self.batch.step():
                self.admission.release(item.request.request_id)

    def _schedule(self) -> list[Waiting]:
        batch: list[Waiting] = []
        num_tokens = 0
        for item in self._waiting:
            n = item.request.num_tokens
            if batch and num_tokens + n > self.max_prefill_tokens:
                break
            if not self.admission.can_admit(item.request):
                break
            self.admission.admit(item.request)
            batch.append(item)
            num_tokens += n
        for _ in batch:
            self._waiting.popleft()
        return batch

    def _prefill(self, batch: list[Waiting]) -> None:
        started_s = now_s()
        seqs = [start_sequence(w.request, self.runner) for w in batch]
        self.runner.prefill(seqs)
        time_s = now_s()
        for item, seq in zip(batch, seqs, strict=True):
            running = Running(
                request=item.request,
                seq=seq,
                sink=item.sink,
                queued_s=item.queued_s,
                started_s=started_s,
            )
            self.batch.add(running)
            text = self.runner.check_stop(seq)
            self.batch.emit(running, seq.output_token_ids[-1], text, time_s)
            if seq.is_finished:
                self.batch.remove(item.request.request_id)
                self.admission.release(item.request.request_id)

    def _has_work(self) -> bool:
        can_prefill = bool(self._waiting) and self.admission.can_admit(self._waiting[0].request)
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
        return self._queue_load(num_running=len(self.batch), kv_usage=self.admission.usage)
