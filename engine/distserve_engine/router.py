"""The router: a request's way through the instances, admission, peers and timelines.

Dispatch follows DistServe section 4.3 (`dispatch.py`: shortest prefill queue, least
loaded decode instance, preferring the prefill's node, or keeping to it under low node
affinity); health comes from polling every
instance's load (`health.py`), and an instance that fails a request is checked at once,
so while it is unhealthy it gets nothing. The router counts what it has sent and not yet
got back, so dispatch needs no round trip. Admission refuses a request with 503 when a
phase has no healthy instance (without `Retry-After`: nothing here knows when one comes
back), and with 429 by the bounds of `admission.py` (waiting, in flight, and optionally
the predicted TTFT), checked and counted in one step.

A request whose instance fails (dies, or its KV pull fails) is resumed: the prompt and
the tokens already streamed are prefilled again on a live instance and decoding goes on,
so the client's stream continues with neither a gap nor a repeat.

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

from distserve_engine.admission import AdmissionControl, Overloaded, Ticket
from distserve_engine.dispatch import NoInstance, Slot, pick_decode, pick_prefill
from distserve_engine.health import HealthPoller
from distserve_engine.interface import InstanceClient, InstanceError
from distserve_engine.request import PrefillOutput, ServeRequest, TokenEvent, now_s
from distserve_engine.timeline import Timeline

log = logging.getLogger(__name__)

MAX_RECOVERIES = 3  # times one request is resumed after instance failures before it fails
ROLES = ("prefill", "decode", "colocated")
TIMELINE_HISTORY = 2000  # finished timelines kept for /debug/timelines
INFLIGHT_BATCHES = 2  # default in-flight bound: waiting plus this many decode batches each

__all__ = ["Overloaded", "Router"]


class Router:
    """Dispatches requests over prefill + decode instances, or colocated ones."""

    def __init__(self, prefill: list[InstanceClient], decode: list[InstanceClient],
                 colocated: list[InstanceClient] = (), *,
                 metrics: Any = None, max_waiting_requests: int = 256,
                 ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
                 health_interval_s: float = 0.5, max_decode_batch: int | None = None,
                 max_inflight_requests: int | None = None, admit_by_ttft: bool = False,
                 can_decode_across_nodes: bool = True) -> None:
        if colocated and (prefill or decode):
            raise ValueError("router: give prefill and decode instances, or colocated ones")
        if not colocated and not (prefill and decode):
            raise ValueError("router: needs at least one prefill and one decode instance")
        self.prefill = [Slot(c) for c in prefill]
        self.decode = [Slot(c) for c in decode]
        self.colocated = [Slot(c) for c in colocated]
        self.metrics = metrics
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.max_decode_batch = max_decode_batch  # a decode instance with this many has no room
        self.max_inflight_requests = max_inflight_requests  # None: from the decode batches
        self.can_decode_across_nodes = can_decode_across_nodes  # False: stay on the prefill's node
        self.admission = AdmissionControl(max_waiting_requests, None, ttft_slo_s, admit_by_ttft)
        self.timelines: deque[Timeline] = deque(maxlen=TIMELINE_HISTORY)
        self.health = HealthPoller(
            lambda: self.slots, health_interval_s,
            on_load=metrics.set_load if metrics is not None else None,
            after_poll=self._retire_idle,
            on_unreachable=metrics.set_unreachable if metrics is not None else None)

    @property
    def num_waiting(self) -> int:
        """Admitted requests whose first token is not out yet."""
        return self.admission.num_waiting

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
                if self.metrics is not None:
                    self.metrics.forget_instance(slot.client.role, slot.client.name)
                await slot.client.close()

    def check_phases(self) -> None:
        """Raise Overloaded (503) when a phase has no instance that can take work."""
        roles = (("colocated", self.colocated),) if self.colocated else (
            ("prefill", self.prefill), ("decode", self.decode))
        for role, slots in roles:
            if not any(s.can_take for s in slots):
                raise Overloaded(503, f"no healthy {role} instance")

    def admit(self, num_prompt_tokens: int = 0) -> Ticket:
        """Count a request in now, or raise Overloaded; the ticket goes to `generate`."""
        self.check_phases()
        num_entry = sum(s.can_take for s in (self.colocated or self.prefill))
        self.admission.max_inflight_requests = self._inflight_limit()
        return self.admission.admit(num_prompt_tokens, num_entry)

    def _inflight_limit(self) -> int | None:
        """The in-flight bound: as set, else waiting plus INFLIGHT_BATCHES decode batches
        per decode (or colocated) instance; None without a decode batch size."""
        if self.max_inflight_requests is not None or self.max_decode_batch is None:
            return self.max_inflight_requests
        num_decoders = sum(s.can_take for s in (self.colocated or self.decode))
        return (self.admission.max_waiting_requests
                + INFLIGHT_BATCHES * self.max_decode_batch * num_decoders)

    async def generate(self, request: ServeRequest, ticket: Ticket | None = None
                       ) -> AsyncIterator[TokenEvent]:
        """Run one request admitted with `ticket` (admitted now when None); yield its
        token events (the first carries the first token)."""
        if ticket is None:
            ticket = self.admit(request.num_prompt_tokens)
        timeline = Timeline(request.request_id, request.arrival_s, request.num_prompt_tokens)
        try:
            flow = self._colocated(request, timeline) if self.colocated else \
                self._disaggregated(request, timeline)
            async for event in flow:
                arrived_s = now_s()  # TTFT and TPOT are measured where the client is served
                timeline.token_times_s.extend(arrived_s for _ in event.token_ids)
                if event.token_ids or event.is_last:
                    ticket.first_token(timeline.ttft_s if event.error is None else None)
                if event.is_last:
                    timeline.finish_reason, timeline.error = event.finish_reason, event.error
                yield event
        finally:
            ticket.release()
            timeline.finished_s = now_s()
            if timeline.finish_reason is None and timeline.error is None:
                timeline.finish_reason = "abort"
            self.timelines.append(timeline)
            if self.metrics is not None:
                self.metrics.observe_request(timeline, self.ttft_slo_s, self.tpot_slo_s)

    async def _disaggregated(self, request: ServeRequest, timeline: Timeline) -> AsyncIterator[TokenEvent]:
        """Prefill, then decode; when an instance fails the request (it died, or the KV
        pull did), re-prefill the prompt and the tokens streamed so far on a live prefill
        instance and go on decoding elsewhere, so the stream continues without a gap or a
        repeat; after MAX_RECOVERIES, or with no instance left, an error event ends it."""
        rid = request.request_id
        streamed: list[int] = []  # tokens the client has
        failures: list[str] = []  # what ended each earlier attempt
        prefill: Slot | None = None
        decode: Slot | None = None
        is_done = False
        try:
            for attempt in range(MAX_RECOVERIES + 1):
                resumed = request.resumed_after(streamed)
                try:
                    prefill, decode = pick_prefill(self.prefill), None
                    out = await self._prefill_on(prefill, resumed, timeline if not streamed else None)
                    streamed.append(out.first_token_id)
                    is_done = out.finish_reason is not None
                    yield TokenEvent(rid, [out.first_token_id], out.finished_s, text=out.first_text,
                                     finish_reason=out.finish_reason)
                    if is_done:
                        return
                    decode = pick_decode(self.decode, prefill.node, self.max_decode_batch,
                                         self.can_decode_across_nodes)
                    timeline.decode_instance = decode.client.name
                    async for event in self._decode_on(decode, resumed, out, timeline):
                        streamed.extend(event.token_ids)
                        is_done = event.is_last
                        yield event
                    return
                except InstanceError as exc:
                    await self.health.check(prefill, decode)
                    if isinstance(exc, NoInstance) or attempt == MAX_RECOVERIES:
                        is_done = True
                        yield TokenEvent(rid, [], now_s(), error=_failure(rid, exc, failures))
                        return
                    failures.append(str(exc))
                    log.warning("request %s: %s; resuming after %d tokens", rid, exc, len(streamed))
                    timeline.num_recoveries += 1
        finally:
            if not is_done:  # the client left: free the KV wherever it is
                for slot in (prefill, decode):
                    if slot is not None:
                        asyncio.ensure_future(slot.client.cancel(rid))

    async def _prefill_on(self, slot: Slot, request: ServeRequest, timeline: Timeline | None
                          ) -> PrefillOutput:
        """One prefill on `slot`, counted while it runs; the timeline gets the first one's times."""
        if timeline is not None:
            timeline.prefill_instance = slot.client.name
        slot.take(request.num_tokens)
        try:
            out = await slot.client.prefill(request)
        finally:
            slot.give_back(request.num_tokens)
        if timeline is not None:
            timeline.prefill_queued_s, timeline.prefill_started_s = out.queued_s, out.started_s
            timeline.prefill_finished_s = out.finished_s
        return out

    async def _decode_on(self, slot: Slot, request: ServeRequest, prefill: PrefillOutput,
                         timeline: Timeline) -> AsyncIterator[TokenEvent]:
        """The decode stream of a prefilled request on `slot`, counted while it runs."""
        slot.take(request.num_tokens)
        try:
            async for event in slot.client.decode(request, prefill):
                if event.queued_s is not None:
                    timeline.decode_queued_s, timeline.decode_started_s = event.queued_s, event.started_s
                    timeline.transfer = event.transfer
                yield event
        finally:
            slot.give_back(request.num_tokens)

    async def _colocated(self, request: ServeRequest, timeline: Timeline) -> AsyncIterator[TokenEvent]:
        """Both phases on one colocated instance; on its failure, resumed on another."""
        rid = request.request_id
        streamed: list[int] = []
        failures: list[str] = []
        slot: Slot | None = None
        is_done = False
        try:
            for attempt in range(MAX_RECOVERIES + 1):
                resumed = request.resumed_after(streamed)
                try:
                    slot = pick_prefill(self.colocated, "colocated")
                    timeline.prefill_instance = timeline.decode_instance = slot.client.name
                    slot.take(resumed.num_tokens)
                    try:
                        async for event in slot.client.generate(resumed):
                            if event.queued_s is not None and not streamed:
                                timeline.prefill_queued_s = event.queued_s
                                timeline.prefill_started_s = event.started_s
                            streamed.extend(event.token_ids)
                            is_done = event.is_last
                            yield event
                    finally:
                        slot.give_back(resumed.num_tokens)
                    return
                except InstanceError as exc:
                    await self.health.check(slot)
                    if isinstance(exc, NoInstance) or attempt == MAX_RECOVERIES:
                        is_done = True
                        yield TokenEvent(rid, [], now_s(), error=_failure(rid, exc, failures))
                        return
                    failures.append(str(exc))
                    log.warning("request %s: %s; resuming after %d tokens", rid, exc, len(streamed))
                    timeline.num_recoveries += 1
        finally:
            if not is_done and slot is not None:
                asyncio.ensure_future(slot.client.cancel(rid))


def _failure(request_id: str, exc: InstanceError, failures: list[str]) -> str:
    """The error a client sees: no instance name or URL (those are logged, with the
    request's id); how many times the request was resumed before it ended."""
    log.warning("request %s failed: %s%s", request_id, exc,
                f" (after: {'; '.join(failures)})" if failures else "")
    if isinstance(exc, NoInstance):
        return f"{exc}; the request ended after {len(failures)} resumption(s)"
    return (f"an instance failed while serving the request and it could not be resumed "
            f"({len(failures)} resumption(s) tried)")
