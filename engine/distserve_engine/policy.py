"""The batching rules the engine and the simulator share, written once (no torch).

The simulator (`distserve.simulator`) imports nothing else of the engine but this module
and the router's `admission`: the prefill instances, the colocated instances and both
simulators fill a prefill batch by the same function, and the router and the simulators
admit by the same `AdmissionControl`. It must therefore stay
pure Python, importing nothing beyond the standard library (a test checks that importing
the simulator loads no torch).

The decode-side rule (`instance/batch.py`, `distserve.simulator.batch`) is shared in
words and held equal by `tests/control/test_conformance.py`:
- KV grows with the sequence: a decode step first gives every running request room for
  all its tokens (the newest included), in the order they were admitted; when the free
  KV is short, the most recently admitted request is preempted (recompute, vLLM's
  default): its KV is freed and it goes back to the front of its instance's queue;
- a waiting request is admitted, first come first served, when the batch is below its
  maximum size and the KV its next step needs is free beside what the running requests'
  next step needs and what is promised to pulls in flight (`can_admit`); `max_tokens`
  is not read;
- a preempted request, admitted again, is prefilled again on the same instance (prompt
  and generated tokens), and that prefill samples its next token.

Decode dispatch (`dispatch.pick_decode`, the simulator's `hand_to_decode`): the least
loaded decode instance (requests sent and not finished, then KV usage) among those with
room (`has_decode_room`) near the prefill instance, else among those with room anywhere,
else among all.
"""

from __future__ import annotations

from collections.abc import Iterable

DECODE_KV_FULL = 0.9  # a decode instance at this KV usage has no room for another request


def num_prefill_batch(
    queue: Iterable[tuple[int, int]], max_batch_tokens: int, free_kv: int, max_batch_size: int
) -> int:
    """How many requests at the head of an FCFS queue form the next prefill batch.

    `queue` yields (tokens to prefill, KV it needs, in blocks or tokens) per request, head
    first; it is read only as far as the batch goes. The batch takes requests while their
    tokens stay within `max_batch_tokens` (Lm; a longer request runs alone), their KV
    within `free_kv` and their number within `max_batch_size`.
    """
    count = num_tokens = kv = 0
    for tokens, need in queue:
        if count and num_tokens + tokens > max_batch_tokens:
            break
        if kv + need > free_kv or count >= max_batch_size:
            break
        count += 1
        num_tokens += tokens
        kv += need
    return count


def can_admit(num_running: int, max_batch_size: int, need_kv: int, free_kv: int) -> bool:
    """True when a waiting request may join the decode batch: below its maximum size, and
    the KV its next step needs (blocks or tokens) is free."""
    return num_running < max_batch_size and need_kv <= free_kv


def has_decode_room(num_outstanding: int, kv_usage: float, max_decode_batch: int | None) -> bool:
    """Whether a decode instance may be sent one more request now: its KV usage is below
    DECODE_KV_FULL and its requests (sent, not finished) below max_decode_batch."""
    is_batch_full = max_decode_batch is not None and num_outstanding >= max_decode_batch
    return kv_usage < DECODE_KV_FULL and not is_batch_full
