"""The router: a request's way through the instances, admission, peers and timelines.

Dispatch follows DistServe section 4.3 (`dispatch.py`: shortest prefill queue, least
loaded decode instance, preferring the prefill's node); health comes from polling every
instance's load (`health.py`), and an instance that fails a request is checked at once,
so while it is unhealthy it gets nothing. The router counts what it has sent and not yet
got back, so dispatch needs no round trip. Admission refuses a request with 503 when a
phase has no healthy instance, and with 429 when too many requests wait for their first
token.

Peers change at run time (`set_peers`, fed by `server/peers.py` from the settings file):
a new instance is added at once; one no longer listed, or listed as draining, gets no
new request while its in-flight ones finish, and is dropped once idle.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from distserve_engine.dispatch import Slot, pick_decode, pick_prefill
from distserve_engine.health import HealthPoller
from distserve_engine.interface import InstanceClient, InstanceError
from distserve_engine.request import ServeRequest, TokenEvent, now_s
from distserve_engine.timeline import Timeline

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a refused client is told to wait
ROLES = ("prefill", "decode", "colocated")
TIMELINE_HISTORY = 2000  # finished timelines kept for /debug/timelines


class Overloaded(Exception):
    """The request is refused: 429 (too many waiting) or 503 (no instance)."""

    def __init__(self, status: int, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class Router:
    """Dispatches requests over prefill + decode instances, or colocated ones."""

    def __init__(self, prefill: list[InstanceClient], decode: list[InstanceClient],
                 colocated: list[InstanceClient] = (), *,
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
        self.max_decode_batch = max_decode_batch  # a decode instance with this many has no room
        self.num_waiting = 0  # admitted, first token not yet out (or not yet decoding)
        self.timelines: deque[Timeline] = deque(maxlen=TIMELINE_HISTORY)
        self.health = HealthPoller(lambda: self.slots, health_interval_s,
                                   on_load=metrics.set_load if metrics is not None else None,
                                   after_poll=self._retire_idle)

    @property
    def slots(self) -> list[Slot]:
        """Every instance."""
        return [*self.prefill, *self.decode, *self.colocated]

    async def start(self) -> None:
        """Start polling the instances' loads."""
        await self.health.start()

    async def stop(self) -> None:
        """Stop polling and close the clients."""
        await self.health.stop()
        for slot in self.slots:
            await slot.client.close()

    async def poll(self) -> None:
        """Read every instance's load once; mark the unreachable ones unhealthy."""
        await self.health.poll()

    def set_peers(self, role_to_clients: dict[str, list[InstanceClient]]) -> None:
        """Adopt a new peer list: add new instances, drain those not listed (or draining).

        A client is matched to a known instance by name and URL; a client with
        `is_draining` set marks its instance draining. Unused new clients are closed.
        """
        for role in ROLES:
            slots = getattr(self, role)
            name_to_slot = {(s.client.name, s.client.url): s for s in slots}
            listed = set()
            for client in role_to_clients.get(role, []):
                key = (client.name, client.url)
                listed.add(key)
                slot = name_to_slot.get(key)
                if slot is None:
                    slot = Slot(client)
                    slots.append(slot)
                    asyncio.ensure_future(self.health.check(slot))
                elif slot.client is not client:
                    slot.client.node = client.node
                    asyncio.ensure_future(client.close())
                slot.is_draining = client.is_draining
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
        prefill = pick_prefill(self.prefill)
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
            decode = pick_decode(self.decode, prefill.node, self.max_decode_batch)
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
            await self.health.check(prefill, decode)
            yield TokenEvent(rid, [], now_s(), error=str(exc))
        finally:
            if not is_done:  # the client left: free the KV wherever it is
                for slot in (prefill, decode):
                    if slot is not None:
                        asyncio.ensure_future(slot.client.cancel(rid))

    async def _colocated(self, request: ServeRequest, timeline: Timeline) -> AsyncIterator[TokenEvent]:
        rid, n = request.request_id, request.num_prompt_tokens
        slot = pick_prefill(self.colocated, "colocated")
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
            await self.health.check(slot)
            yield TokenEvent(rid, [], now_s(), error=str(exc))
        finally:
            slot.give_back(n)
            if not is_done:
                asyncio.ensure_future(slot.client.cancel(rid))
