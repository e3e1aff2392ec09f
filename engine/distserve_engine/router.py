"""The router: which instance gets a request, health, overload, and the request's timeline.

DistServe section 4.3: a new request goes to the prefill instance with the shortest
queue (in prompt tokens not yet prefilled), and once prefilled to the least loaded
decode instance (fewest requests); with colocated instances (the baseline) to the one
with the fewest outstanding tokens. The router counts what it has sent and not yet got
back, so dispatch needs no round trip. It polls every instance's load for health and
for the gauges; an instance that fails a request is checked at once, and while it is
unhealthy it gets nothing. Admission refuses a request with 503 when a phase has no
healthy instance, and with 429 when too many requests wait for their first token.

Peers change at run time (`set_peers`, fed by `server/peers.py` from the settings file):
a new instance is added at once; one no longer listed, or listed as draining, gets no
new request while its in-flight ones finish, and is dropped once idle. A prefilled
request prefers a decode instance on its prefill instance's node (Algorithm 2 places
them so KV moves over the node's fast link), and goes elsewhere when none there has room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from distserve_engine.instance.client import InstanceError
from distserve_engine.request import ServeRequest, TokenEvent, now_s
from distserve_engine.timeline import Timeline

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a refused client is told to wait
DECODE_KV_FULL = 0.9  # a decode instance at this KV usage has no room for another request
ROLES = ("prefill", "decode", "colocated")
TIMELINE_HISTORY = 2000  # finished timelines kept for /debug/timelines


class Overloaded(Exception):
    """The request is refused: 429 (too many waiting) or 503 (no instance)."""

    def __init__(self, status: int, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass
class Slot:
    """One instance as the router tracks it."""

    client: Any
    num_outstanding: int = 0  # requests sent and not finished on it
    num_outstanding_tokens: int = 0  # their prompt tokens
    is_healthy: bool = True
    error: str | None = None
    is_draining: bool = False  # no new request; in-flight ones finish
    kv_usage: float = 0.0  # from the last load poll

    @property
    def node(self) -> str | None:
        """The node the instance runs on (None: unknown, e.g. in one process)."""
        return getattr(self.client, "node", None)

    @property
    def can_take(self) -> bool:
        """Whether a new request may go here."""
        return self.is_healthy and not self.is_draining

    def take(self, num_tokens: int) -> None:
        self.num_outstanding += 1
        self.num_outstanding_tokens += num_tokens

    def give_back(self, num_tokens: int) -> None:
        self.num_outstanding -= 1
        self.num_outstanding_tokens -= num_tokens


class Router:
    """Dispatches requests over prefill + decode instances, or colocated ones."""

    def __init__(self, prefill: list[Any], decode: list[Any], colocated: list[Any] = (), *,
                 metrics: Any = None, max_waiting_requests: int = 256,
                 ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
                 health_interval_s: float = 0.5, max_decode_batch: int | None = None) -> None:
        if colocated and (prefill or decode):
            raise ValueError("router: give prefill and decode instances, or colocated ones")
        if not colocated and not (prefill and decode):
            raise ValueError("router: needs at least one prefill and one decode instance")
        self.prefill = [Slot(c) for c in prefill]
        self.decode = [Slot(c) for c in decode]
        self.colocated = [Slot(c) for c in colocated]
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.health_interval_s = health_interval_s
        self.max_decode_batch = max_decode_batch  # a decode instance with this many has no room
        self.num_waiting = 0  # admitted, first token not yet out (or not yet decoding)
        self.timelines: deque[Timeline] = deque(maxlen=TIMELINE_HISTORY)
        self._poller: asyncio.Task | None = None

    @property
    def slots(self) -> list[Slot]:
        """Every instance."""
        return [*self.prefill, *self.decode, *self.colocated]

    async def start(self) -> None:
        """Start polling the instances' loads."""
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        """Stop polling and close the clients."""
        if self._poller:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for slot in self.slots:
            await slot.client.close()

    async def poll(self) -> None:
        """Read every instance's load once; mark the unreachable ones unhealthy."""
        await asyncio.gather(*(self._check(slot) for slot in self.slots))
        await self._retire_idle()

    def set_peers(self, role_to_clients: dict[str, list[Any]]) -> None:
        """Adopt a new peer list: add new instances, drain those not listed (or draining).

        A client is matched to a known instance by name and URL; a client with
        `is_draining` set marks its instance draining. Unused new clients are closed.
        """
        for role in ROLES:
            slots = getattr(self, role)
            name_to_slot = {(s.client.name, getattr(s.client, "url", None)): s for s in slots}
            listed = set()
            for client in role_to_clients.get(role, []):
                key = (client.name, getattr(client, "url", None))
                listed.add(key)
                slot = name_to_slot.get(key)
                if slot is None:
                    slot = Slot(client)
                    slots.append(slot)
                    asyncio.ensure_future(self._check(slot))
                elif slot.client is not client:
                    slot.client.node = getattr(client, "node", None)
                    asyncio.ensure_future(client.close())
                slot.is_draining = bool(getattr(client, "is_draining", False))
            for key, slot in name_to_slot.items():
                if key not in listed and not slot.is_draining:
                    log.info("router: %s draining", key[0])
                    slot.is_draining = True

    async def _retire_idle(self) -> None:
        """Drop draining instances with nothing in flight; close their clients."""
        for role in ROLES:
            slots = getattr(self, role)
            idle = [s for s in slots if s.is_draining and s.num_outstanding == 0]
            for slot in idle:
                slots.remove(slot)
                log.info("router: %s drained, removed", slot.client.name)
                await slot.client.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.poll()

    async def _check(self, slot: Slot) -> None:
        try:
            load = await slot.client.load()
        except InstanceError as exc:
            slot.is_healthy, slot.error = False, str(exc)
            return
        slot.is_healthy, slot.error = load.is_healthy, load.error
        slot.kv_usage = load.kv_usage
        if self.metrics is not None:
            self.metrics.set_load(load)

    def admit(self) -> None:
        """Raise Overloaded when the request cannot be taken now."""
        roles = (("colocated", self.colocated),) if self.colocated else (
            ("prefill", self.prefill), ("decode", self.decode))
        for role, slots in roles:
            if not any(s.can_take for s in slots):
                raise Overloaded(503, f"no healthy {role} instance")
        if self.num_waiting >= self.max_waiting_requests:
            raise Overloaded(429, f"{self.num_waiting} requests already wait for their first "
                                  f"token (limit {self.max_waiting_requests}); retry later")

    def _pick(self, slots: list[Slot], role: str) -> Slot:
        healthy = [s for s in slots if s.can_take]
        if not healthy:
            raise InstanceError(f"no healthy {role} instance")
        return min(healthy, key=lambda s: (s.num_outstanding_tokens, s.num_outstanding))

    def _has_room(self, slot: Slot) -> bool:
        """Whether a decode instance can take one more request now."""
        is_batch_full = self.max_decode_batch is not None and slot.num_outstanding >= self.max_decode_batch
        return slot.kv_usage < DECODE_KV_FULL and not is_batch_full

    def _pick_decode(self, prefill: Slot) -> Slot:
        """The least loaded decode instance on the prefill instance's node with room,
        else the least loaded one anywhere."""
        healthy = [s for s in self.decode if s.can_take]
        if not healthy:
            raise InstanceError("no healthy decode instance")
        roomy = [s for s in healthy if self._has_room(s)]
        local = [s for s in roomy if s.node == prefill.node]
        return min(local or roomy or healthy, key=lambda s: (s.num_outstanding, s.kv_usage))

    async def generate(self, request: ServeRequest) -> AsyncIterator[TokenEvent]:
        """Run one request; yield its token events (the first carries the first token)."""
        timeline = Timeline(request.request_id, request.arrival_s, request.num_prompt_tokens)
        self.num_waiting += 1
        is_waiting = True
        try:
            flow = self._colocated(request, timeline) if self.colocated else \
                self._disaggregated(request, timeline)
            async for event in flow:
                if is_waiting and (event.token_ids or event.is_last):
                    self.num_waiting -= 1
                    is_waiting = False
                arrived_s = now_s()  # TTFT and TPOT are measured where the client is served
                timeline.token_times_s.extend(arrived_s for _ in event.token_ids)
                if event.is_last:
                    timeline.finish_reason, timeline.error = event.finish_reason, event.error
                yield event
        finally:
            if is_waiting:
                self.num_waiting -= 1
            timeline.finished_s = now_s()
            if timeline.finish_reason is None and timeline.error is None:
                timeline.finish_reason = "abort"
            self.timelines.append(timeline)
            if self.metrics is not None:
                self.metrics.observe_request(timeline, self.ttft_slo_s, self.tpot_slo_s)

    async def _disaggregated(self, request: ServeRequest, timeline: Timeline) -> AsyncIterator[TokenEvent]:
        rid, n = request.request_id, request.num_prompt_tokens
        prefill = self._pick(self.prefill, "prefill")
        timeline.prefill_instance = prefill.client.name
        decode: Slot | None = None
        is_done = False
        prefill.take(n)
        try:
            try:
                out = await prefill.client.prefill(request)
            finally:
                prefill.give_back(n)
            timeline.prefill_queued_s, timeline.prefill_started_s = out.queued_s, out.started_s
            timeline.prefill_finished_s = out.finished_s
            first = TokenEvent(rid, [out.first_token_id], out.finished_s, text=out.first_text,
                               finish_reason=out.finish_reason)
            is_done = out.finish_reason is not None
            yield first
            if is_done:
                return
            decode = self._pick_decode(prefill)
            timeline.decode_instance = decode.client.name
            decode.take(n)
            try:
                async for event in decode.client.decode(request, out):
                    if event.queued_s is not None:
                        timeline.decode_queued_s, timeline.decode_started_s = event.queued_s, event.started_s
                        timeline.transfer = event.transfer
                    is_done = event.is_last
                    yield event
            finally:
                decode.give_back(n)
        except InstanceError as exc:
            is_done = True
            await self._recheck(prefill, decode)
            yield TokenEvent(rid, [], now_s(), error=str(exc))
        finally:
            if not is_done:  # the client left: free the KV wherever it is
                for slot in (prefill, decode):
                    if slot is not None:
                        asyncio.ensure_future(slot.client.cancel(rid))

    async def _colocated(self, request: ServeRequest, timeline: Timeline) -> AsyncIterator[TokenEvent]:
        rid, n = request.request_id, request.num_prompt_tokens
        slot = self._pick(self.colocated, "colocated")
        timeline.prefill_instance = timeline.decode_instance = slot.client.name
        is_done = False
        slot.take(n)
        try:
            async for event in slot.client.generate(request):
                if event.queued_s is not None:
                    timeline.prefill_queued_s, timeline.prefill_started_s = event.queued_s, event.started_s
                is_done = event.is_last
                yield event
        except InstanceError as exc:
            is_done = True
            await self._recheck(slot)
            yield TokenEvent(rid, [], now_s(), error=str(exc))
        finally:
            slot.give_back(n)
            if not is_done:
                asyncio.ensure_future(slot.client.cancel(rid))

    async def _recheck(self, *slots: Slot | None) -> None:
        """After a failure: poll the instances involved so a dead one stops getting work."""
        await asyncio.gather(*(self._check(s) for s in slots if s is not None))
