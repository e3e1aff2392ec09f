"""The prefill instance: FCFS batches up to Lm tokens, first token, KV held until pulled.

DistServe section 4.3: requests are prefilled first come, first served; a batch takes
prompts from the head of the queue while their tokens stay within `max_prefill_tokens`
(Lm, the length that saturates the device), and a longer prompt runs alone. After the
batch, each request's KV stays in this instance's cache until a decode instance pulls
it (`take_kv`): the prefill instance's memory is the queue between the phases. When
that memory is full, the head of the queue waits for a pull (back-pressure) instead of
pushing KV onto a decode instance that has no room.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from distserve_engine import policy
from distserve_engine.instance.iterations import prefill_lens
from distserve_engine.instance.loop import PromptQueueLoop, Waiting, start_sequence
from distserve_engine.interface import Runner
from distserve_engine.kv_cache import KVBlob
from distserve_engine.request import (
    InstanceLoad,
    KVHandle,
    PrefillOutput,
    TokenEvent,
    now_s,
)
from distserve_engine.sequence import Sequence

if TYPE_CHECKING:
    import torch


class PrefillInstance(PromptQueueLoop):
    """FCFS prefill batches; KV kept per request until a decode instance takes it."""

    role = "prefill"

    def __init__(
        self, name: str, runner: Runner, max_prefill_tokens: int, url: str = ""
    ) -> None:
        super().__init__(name, runner)
        self.max_prefill_tokens = max_prefill_tokens  # Lm
        self.url = url  # where decode instances reach `take_kv` over HTTP
        self.shm_token = ""  # set when a shared-memory arena serves this instance's pulls
        self._held: dict[str, Sequence] = {}
        self._held_lock = threading.Lock()  # `take_kv` runs on transfer threads

    def take_kv(self, request_id: str, into: torch.Tensor | None = None) -> KVBlob:
        """Copy out a held request's KV (into the uint8 buffer `into`, K then V, when given)
        and free its blocks; KeyError when not held."""
        with self._held_lock:
            seq = self._held.pop(request_id)
        blob = self.runner.export_kv(seq, into)
        # NOTE: blocks are freed on the engine thread, between batches, so the free
        # list never changes under a running prefill.
        self.post(lambda: self.runner.free(seq))
        return blob

    def step(self) -> None:
        """Prefill the next FCFS batch; hold each request's KV for its decode pull."""
        batch = self._schedule()
        started_s = now_s()
        seqs = [start_sequence(w.request, self.runner) for w in batch]
        self.iterations.run("prefill", prefill_lens(seqs), lambda: self.runner.prefill(seqs))
        finished_s = now_s()
        for item, seq in zip(batch, seqs, strict=True):
            text = self.runner.check_stop(seq)
            handle = None
            if not seq.is_finished:
                with self._held_lock:
                    self._held[seq.seq_id] = seq
                handle = KVHandle(
                    request_id=item.request.request_id,
                    instance=self.name,
                    url=self.url,
                    shm_token=self.shm_token,
                    num_tokens=seq.num_cached_tokens,
                    nbytes=self._kv_nbytes(seq.num_cached_tokens),
                )
            else:
                self.runner.free(seq)
            item.sink(
                PrefillOutput(
                    request_id=item.request.request_id,
                    first_token_id=seq.output_token_ids[-1],
                    first_text=text,
                    finish_reason=seq.finish_reason,
                    kv=handle,
                    detokenizer=seq.detokenizer_state,
                    queued_s=item.queued_s,
                    started_s=started_s,
                    finished_s=finished_s,
                    instance=self.name,
                )
            )

    def _schedule(self) -> list[Waiting]:
        """Head of the queue while tokens stay within Lm and the KV fits (`policy`)."""
        queue = ((w.request.num_tokens, self._blocks_for(w.request.num_tokens))
                 for w in self._waiting)
        count = policy.num_prefill_batch(queue, self.max_prefill_tokens,
                                         self.runner.block_manager.num_free_blocks,
                                         self.runner.config.max_num_seqs)
        return [self._waiting.popleft() for _ in range(count)]

    def _blocks_for(self, num_tokens: int) -> int:
        # The prefill reserves the prompt's blocks only; the first token's KV is written
        # on the decode instance.
        return self.runner.block_manager.num_blocks_for(num_tokens)

    def _kv_nbytes(self, num_tokens: int) -> int:
        return self.runner.kv_bytes_per_token * num_tokens

    def _has_work(self) -> bool:
        if not self._waiting:
            return False
        head = self._waiting[0].request.num_tokens
        return self._blocks_for(head) <= self.runner.block_manager.num_free_blocks

    def _cancel(self, request_id: str) -> None:
        for item in list(self._waiting):
            if item.request.request_id == request_id:
                self._waiting.remove(item)
                item.sink(TokenEvent(request_id, [], now_s(), finish_reason="abort"))
        with self._held_lock:
            seq = self._held.pop(request_id, None)
        if seq is not None:
            self.runner.free(seq)

    def _fail_all(self, error: str) -> None:
        while self._waiting:
            item = self._waiting.popleft()
            item.sink(TokenEvent(item.request.request_id, [], now_s(), error=error))
        with self._held_lock:
            held = list(self._held.values())
            self._held.clear()
        for seq in held:
            try:
                self.runner.free(seq)
            except Exception:  # noqa: BLE001 - a broken runner must not stop the cleanup
                pass

    def load(self) -> InstanceLoad:
        """Queue length in requests and tokens, held KV, cache usage."""
        return self._queue_load(
            num_held=len(self._held), kv_usage=self.runner.block_manager.usage
        )
