"""What an instance's engine thread ran, batch by batch.

Each prefill batch and decode step of the runner is kept as an `Iteration`: its kind,
when it started, how long the runner took and the lengths it ran over, in the terms the
latency profile times them (`distserve_engine.profile`): a prefill batch by the tokens
it computed per sequence, a decode step by each sequence's context including the token
it adds. `GET /debug/iterations` serves the most recent ones; `distserve fidelity` holds
them against the profile's time for the very same batches, which tells a slower runner
under serving (its HTTP threads and KV exports share the core) from a scheduling gap.
No torch here: the control plane reads the same documents.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

# iterations kept per instance: a 600-request run of `distserve fidelity` is up to ~11000
# decode steps of SmolLM2, and its first ones must still be here at its end
ITERATION_HISTORY = 32768
KINDS = ("prefill", "decode")

T = TypeVar("T")


@dataclass(frozen=True)
class Iteration:
    """One runner call of the engine thread."""

    kind: str  # "prefill" or "decode"
    started_s: float  # wall clock (time.time, as `request.now_s`), comparable across processes
    seconds: float  # how long the runner took
    lens: tuple[int, ...]  # prefill: tokens computed per sequence; decode: context + 1 per sequence
    # the engine thread's time before the call since the last call ended (or since it woke
    # from waiting for work): commands, scheduling, KV imports, emitting the last tokens
    overhead_s: float = 0.0
    # the engine thread's CPU time during the runner call (None: not measured); below
    # `seconds` by the time the thread waited for its core (other threads and processes
    # on it: the instance's HTTP threads, KV exports, the router, the clients)
    cpu_s: float | None = None

    @property
    def busy_s(self) -> float:
        """The engine thread's time this iteration took, its overhead included."""
        return self.seconds + self.overhead_s

    def to_dict(self) -> dict:
        """A JSON-able document."""
        return {**asdict(self), "lens": list(self.lens)}

    @classmethod
    def from_dict(cls, doc: dict) -> Iteration:
        """The inverse of to_dict; a ValueError naming what is wrong."""
        try:
            kind = doc["kind"]
            if kind not in KINDS:
                raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
            cpu_s = doc.get("cpu_s")
            return cls(kind, float(doc["started_s"]), float(doc["seconds"]),
                       tuple(int(n) for n in doc["lens"]), float(doc.get("overhead_s", 0.0)),
                       None if cpu_s is None else float(cpu_s))
        except (KeyError, TypeError) as err:
            raise ValueError(f"an iteration needs kind, started_s, seconds and lens: {err}") from err


class IterationLog:
    """The last `maxlen` iterations of one instance (written by its engine thread, read
    by any thread)."""

    def __init__(self, maxlen: int = ITERATION_HISTORY,
                 clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self._items: deque[Iteration] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._clock = clock  # durations (the start is wall clock, comparable across processes)
        # the calling thread's CPU time (with more torch threads than one, this one's only)
        self._cpu_clock = cpu_clock
        self._free_since = clock()  # the last call ended, or the thread woke

    def woke(self) -> None:
        """The engine thread stopped waiting for work: its overhead counts from now."""
        self._free_since = self._clock()

    def run(self, kind: str, lens: Sequence[int], call: Callable[[], T]) -> T:
        """Run call (the runner's prefill or decode over a batch of these lengths), keep
        its time and the overhead before it, return what it returns. A call that raises
        is not kept."""
        started_s = time.time()
        started, cpu_started = self._clock(), self._cpu_clock()
        overhead_s = started - self._free_since
        result = call()
        cpu_s = self._cpu_clock() - cpu_started
        self._free_since = ended = self._clock()
        item = Iteration(kind, started_s, ended - started, tuple(lens), overhead_s, cpu_s)
        with self._lock:
            self._items.append(item)
        return result

    def recent(self, limit: int | None = None) -> list[Iteration]:
        """The last `limit` iterations (all kept when None), oldest first."""
        with self._lock:
            items = list(self._items)
        if limit is None:
            return items
        return items[-limit:] if limit > 0 else []


def prefill_lens(seqs: Sequence) -> list[int]:
    """Tokens a prefill computes for each sequence: all it holds less what is cached."""
    return [seq.num_tokens - seq.num_cached_tokens for seq in seqs]


def decode_lens(seqs: Sequence) -> list[int]:
    """Each sequence's context after the step: its tokens, the newest not yet cached."""
    return [seq.num_tokens for seq in seqs]
