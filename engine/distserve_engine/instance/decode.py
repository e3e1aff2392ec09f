"""The decode instance: continuous batching, and KV pulled only when there is room.

DistServe section 4.3: a prefilled request waits here (as a `KVHandle`, its KV still on
the prefill instance) until this instance has room for it: a place in the batch and the
blocks of its prompt and first token (`batch.py`: KV then grows with the sequence, and
a request preempted for lack of blocks waits at the front of the same queue, to be
prefilled again here). Only then is its KV pulled. The pull runs on a transfer thread
while the engine thread keeps stepping the batch; the finished blob is written into the
cache between two steps, and the request joins the batch at the next one. So a burst of
prefilled requests waits in prefill memory (back-pressure) and never stalls decoding.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from distserve_engine.instance.batch import Admission, DecodeBatch, Running
from distserve_engine.instance.loop import InstanceLoop, Sink
from distserve_engine.interface import Runner
from distserve_engine.kv_cache import KVBlob
from distserve_engine.request import (
    InstanceLoad,
    PrefillOutput,
    ServeRequest,
    TokenEvent,
    TransferStats,
    now_s,
)
from distserve_engine.sequence import Sequence
from distserve_engine.transfer import KVFetcher

NUM_TRANSFER_THREADS = 2  # concurrent pulls; more would only share the same link
KV_PULL_ATTEMPTS = 2  # a pull that fails (timeout, reset) is tried once more ...
KV_PULL_RETRY_S = 0.2  # ... after this pause


@dataclass
class _Incoming:
    request: ServeRequest
    prefill: PrefillOutput
    sink: Sink
    queued_s: float
    is_cancelled: bool = False


class DecodeInstance(InstanceLoop):
    """Decodes prefilled requests in one continuous batch; pulls KV with back-pressure."""

    role = "decode"

    def __init__(self, name: str, runner: Runner, fetcher: KVFetcher, max_batch_size: int) -> None:
        super().__init__(name, runner)
        self.fetcher = fetcher  # pulls run on this instance's transfer threads
        self.batch = DecodeBatch(runner, self.iterations)
        self.admission = Admission(runner.block_manager, max_batch_size)
        # FCFS: prefilled requests whose KV is not pulled yet, and preempted ones.
        self._pending: deque[_Incoming | Running] = deque()
        self._pulling: dict[str, _Incoming] = {}
        self._ready: deque[tuple[_Incoming, KVBlob, TransferStats]] = deque()
        self._pool = ThreadPoolExecutor(NUM_TRANSFER_THREADS, thread_name_prefix=f"pull-{name}")

    def submit(self, request: ServeRequest, prefill: PrefillOutput, sink: Sink) -> None:
        """Queue a prefilled request; `sink` receives its TokenEvents."""
        if not self.is_healthy:
            sink(TokenEvent(request.request_id, [], now_s(), error=self.error or "stopped"))
            return
        incoming = _Incoming(request, prefill, sink, now_s())
        self.post(lambda: self._pending.append(incoming))

    def cancel(self, request_id: str) -> None:
        """Stop a request wherever it is and free its KV."""
        self.post(lambda: self._cancel(request_id))

    def stop(self) -> None:
        """Stop the engine thread and the transfer threads."""
        super().stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()  # its shared-memory arena goes with it

    def step(self) -> None:
        """Admit what fits (start pulls, take back the preempted), import finished pulls,
        then either prefill the preempted ones again or decode one token for all."""
        recompute = self._admit()
        self._import_ready()
        if recompute:
            for item in recompute:
                self.admission.settle(item.request.request_id)
            self._release(self.batch.prefill(recompute))
        elif len(self.batch):
            finished, preempted = self.batch.step(self.admission.num_free_blocks)
            self._release(finished)
            for item in reversed(preempted):
                self.admission.preempt(item.request.request_id)
                self._pending.appendleft(item)

    def _release(self, items: list[Running]) -> None:
        for item in items:
            self.admission.release(item.request.request_id)

    def _admit(self) -> list[Running]:
        """Admit the head of the queue while it fits: start its pull, or return it to be
        prefilled again (a preempted request)."""
        recompute: list[Running] = []
        while self._pending:
            head = self._pending[0]
            num_tokens = _next_step_tokens(head)
            is_full = len(recompute) >= self.runner.config.max_num_seqs
            if is_full or not self.admission.can_admit(num_tokens, self.batch):
                break
            self._pending.popleft()
            self.admission.admit(head.request.request_id, num_tokens)
            if isinstance(head, Running):
                recompute.append(head)
            else:
                self._pulling[head.request.request_id] = head
                self._pool.submit(self._pull, head)
        return recompute

    def _pull(self, incoming: _Incoming) -> None:
        """Transfer thread: fetch the KV (tried again once after a short pause), then hand
        it to the engine thread. A pull that still fails ends the request with an error
        event; the router then recomputes the KV on a live prefill instance."""
        for attempt in range(KV_PULL_ATTEMPTS):
            try:
                blob, stats = self.fetcher.fetch(incoming.prefill.kv)
                break
            except Exception as exc:  # noqa: BLE001 - reported to the request, not raised
                error = f"KV pull from {incoming.prefill.instance} failed: {exc}"
                if attempt + 1 == KV_PULL_ATTEMPTS or incoming.is_cancelled:
                    self.post(lambda error=error: self._pull_failed(incoming, error))
                    return
                time.sleep(KV_PULL_RETRY_S)
        self.post(lambda: self._ready.append((incoming, blob, stats)))

    def _pull_failed(self, incoming: _Incoming, error: str) -> None:
        rid = incoming.request.request_id
        self._pulling.pop(rid, None)
        self.admission.release(rid)
        if not incoming.is_cancelled:
            incoming.sink(TokenEvent(rid, [], now_s(), error=error))

    def _import_ready(self) -> None:
        while self._ready:
            incoming, blob, stats = self._ready.popleft()
            rid = incoming.request.request_id
            self._pulling.pop(rid, None)
            if incoming.is_cancelled:
                self.admission.release(rid)
                self.fetcher.release(incoming.prefill.kv)
                continue
            self.admission.settle(rid)  # the blocks are reserved by the import below
            seq = Sequence(rid, incoming.request.prompt_token_ids, incoming.request.params)
            seq.output_token_ids.extend([*incoming.request.resume_token_ids, incoming.prefill.first_token_id])
            seq.resume_detokenizer(incoming.prefill.detokenizer)  # its text already went out
            import_started_s = now_s()
            try:
                self.runner.import_kv(seq, blob)  # the copy into this cache ends the transfer
            finally:
                self.fetcher.release(incoming.prefill.kv)  # the blob's shared memory, if any
            stats.finished_s += now_s() - import_started_s
            self.batch.add(
                Running(
                    request=incoming.request,
                    seq=seq,
                    sink=incoming.sink,
                    queued_s=incoming.queued_s,
                    started_s=now_s(),
                    transfer=stats,
                )
            )

    def _has_work(self) -> bool:
        can_admit = bool(self._pending) and self.admission.can_admit(
            _next_step_tokens(self._pending[0]), self.batch)
        return bool(len(self.batch) or self._ready or can_admit)

    def _cancel(self, request_id: str) -> None:
        for incoming in list(self._pending):
            if incoming.request.request_id == request_id:
                self._pending.remove(incoming)
                incoming.sink(TokenEvent(request_id, [], now_s(), finish_reason="abort"))
        if request_id in self._pulling:
            self._pulling[request_id].is_cancelled = True
        item = self.batch.remove(request_id)
        if item is not None:
            self.admission.release(request_id)
            item.sink(TokenEvent(request_id, [], now_s(), finish_reason="abort"))

    def _fail_all(self, error: str) -> None:
        for item in self.batch.fail_all(error):
            self.admission.release(item.request.request_id)
        waiting = [*self._pending, *self._pulling.values(), *(r[0] for r in self._ready)]
        self._pending.clear()
        self._ready.clear()
        for incoming in waiting:
            if isinstance(incoming, _Incoming):
                incoming.is_cancelled = True
            incoming.sink(TokenEvent(incoming.request.request_id, [], now_s(), error=error))

    def load(self) -> InstanceLoad:
        """Pending pulls, running batch, promised KV."""
        pending = list(self._pending)
        return InstanceLoad(
            instance=self.name,
            role=self.role,
            num_waiting=len(pending) + len(self._pulling),
            num_waiting_tokens=sum(p.request.num_tokens for p in pending),
            num_running=self._num_running(self.batch),
            kv_usage=self.admission.usage,
            num_preemptions=self.admission.num_preemptions,
            is_healthy=self.is_healthy,
            error=self.error,
        )


def _next_step_tokens(item: _Incoming | Running) -> int:
    """Tokens a queued request holds at its next step: a pulled one its prompt (and
    resumed tokens) and first token, a preempted one everything it has."""
    return item.seq.num_tokens if isinstance(item, Running) else item.request.num_tokens + 1
