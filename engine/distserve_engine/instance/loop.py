"""The engine thread every instance runs, and how other threads talk to it.

An instance owns one model runner, and only its engine thread touches the runner's
batches and the instance's queues. Other threads (the HTTP server, a KV transfer, the
router in the same process) never change that state directly: they `post` a command
that the engine thread runs between two batches. So the instance classes need no
locks, and a batch is never stalled by a caller. When a batch raises, the instance is
dead: every request it holds gets an error event at once and new ones are refused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distserve_engine.instance.iterations import IterationLog
from distserve_engine.request import InstanceLoad, ServeRequest, TokenEvent, now_s
from distserve_engine.sequence import Sequence

if TYPE_CHECKING:
    from distserve_engine.interface import Runner

log = logging.getLogger(__name__)

Sink = Callable[[Any], None]  # receives PrefillOutput / TokenEvent, on the engine thread
# NOTE: no batch or command takes minutes; one that runs this long is stuck (a hung
# collective, a wedged device), and `is_live` turns False so the pod is restarted.
STALL_LIMIT_S = 300.0


class InstanceLoop:
    """A thread running `step()` while there is work, and commands posted to it."""

    role = "instance"

    def __init__(self, name: str, runner: Any) -> None:
        self.name = name
        self.runner = runner
        self.error: str | None = None  # set when the instance died
        self.iterations = IterationLog()  # the runner's recent batches, timed
        self._wake = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        self._is_stopping = False
        self._busy_since_s: float | None = None  # monotonic start of the current batch/command
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    @property
    def is_healthy(self) -> bool:
        """False once a batch failed or the instance was stopped."""
        return self.error is None and not self._is_stopping

    def is_live(self, stall_limit_s: float = STALL_LIMIT_S) -> bool:
        """False when the instance died, its thread ended unasked, or one batch or command
        has run longer than `stall_limit_s` (the engine is hung: restart it)."""
        if self.error is not None:
            return False
        if self._thread.ident is not None and not self._thread.is_alive() and not self._is_stopping:
            return False
        since = self._busy_since_s
        return since is None or time.monotonic() - since <= stall_limit_s

    def start(self) -> InstanceLoop:
        """Start the engine thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Finish the current batch, abort every request, end the thread."""
        self.post(lambda: self._fail_all("instance stopped"))
        with self._wake:
            self._is_stopping = True
            self._wake.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def post(self, command: Callable[[], None]) -> None:
        """Run `command` on the engine thread before its next batch."""
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    def kill(self, reason: str) -> None:
        """Make the instance fail as if its batch had raised (fault injection, tests)."""
        self.post(lambda: self._die(RuntimeError(reason)))

    def _run(self) -> None:
        while True:
            with self._wake:
                waited = False
                while not self._inbox and not self._is_stopping and not self._has_work():
                    self._wake.wait()
                    waited = True
                commands = list(self._inbox)
                self._inbox.clear()
                is_stopping = self._is_stopping
            if waited:
                self.iterations.woke()
            self._busy_since_s = time.monotonic()
            try:
                for command in commands:
                    command()
                if is_stopping:
                    return
                if self.error is None and self._has_work():
                    self.step()
            except Exception as exc:  # a dead batch must not hang its requests
                self._die(exc)
            finally:
                self._busy_since_s = None
            if self.error is not None:
                self._drain_after_death()
                return

    def _die(self, exc: BaseException) -> None:
        log.exception("instance %s died", self.name, exc_info=exc)
        self.error = f"instance {self.name} failed: {exc}"
        self._fail_all(self.error)

    def _drain_after_death(self) -> None:
        """Answer commands posted after death (submits get an error from their own check)."""
        with self._wake:
            commands = list(self._inbox)
            self._inbox.clear()
        for command in commands:
            try:
                command()
            except Exception:  # noqa: BLE001 - the instance is already dead
                log.debug("command after death failed", exc_info=True)
        self._fail_all(self.error or "instance dead")

    # Subclasses implement these four.
    def step(self) -> None:
        """Run one batch."""
        raise NotImplementedError

    def _has_work(self) -> bool:
        """True when `step()` can make progress now."""
        raise NotImplementedError

    def _fail_all(self, error: str) -> None:
        """Send an error event to every request the instance holds and forget them."""
        raise NotImplementedError

    def load(self) -> InstanceLoad:
        """A snapshot of queue lengths and KV usage (read from any thread)."""
        raise NotImplementedError

    def _num_running(self, batch: Sized) -> int:
        """Requests in `batch` for a load snapshot: none once the instance died, though its
        batch empties a moment later, on the engine thread (the error is set first so that
        no request is dispatched to it meanwhile)."""
        return 0 if self.error is not None else len(batch)


def start_sequence(request: ServeRequest, runner: Runner) -> Sequence:
    """The sequence a prefill computes for `request`: its prompt, then any resumed tokens,
    whose detokenization is replayed so that the text continues where the client's ends."""
    seq = Sequence(request.request_id, request.prompt_token_ids, request.params)
    for token_id in request.resume_token_ids:
        seq.output_token_ids.append(token_id)
        runner.check_stop(seq)  # the text of these tokens went out already
    return seq


@dataclass
class Waiting:
    """A request queued for prefill, and where its events go."""

    request: ServeRequest
    sink: Sink
    queued_s: float


class PromptQueueLoop(InstanceLoop):
    """An instance that takes new requests into an FCFS queue of prompts (prefill, colocated)."""

    def __init__(self, name: str, runner: Any) -> None:
        super().__init__(name, runner)
        self._waiting: deque[Waiting] = deque()

    def submit(self, request: ServeRequest, sink: Sink) -> None:
        """Queue a request; `sink` receives its events on the engine thread."""
        if not self.is_healthy:
            sink(TokenEvent(request.request_id, [], now_s(), error=self.error or "stopped"))
            return
        queued_s = now_s()
        self.post(lambda: self._waiting.append(Waiting(request, sink, queued_s)))

    def cancel(self, request_id: str) -> None:
        """Drop a request wherever it is and free its KV (the client is gone)."""
        self.post(lambda: self._cancel(request_id))

    def _cancel(self, request_id: str) -> None:
        raise NotImplementedError

    def _queue_load(self, **fields: Any) -> InstanceLoad:
        """This instance's load: its prompt queue in requests and tokens, plus `fields`."""
        waiting = list(self._waiting)  # a snapshot: the engine thread appends meanwhile
        return InstanceLoad(
            instance=self.name,
            role=self.role,
            num_waiting=len(waiting),
            num_waiting_tokens=sum(w.request.num_tokens for w in waiting),
            is_healthy=self.is_healthy,
            error=self.error,
            **fields,
        )
