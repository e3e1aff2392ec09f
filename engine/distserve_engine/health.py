"""The router's view of instance health: every instance's load, polled on an interval.

An instance that answers reports its own health (an engine thread that died or stalled
says so); one that does not answer is unhealthy until it answers again. A poll also
feeds the load gauges, and an instance that does not answer has its gauges zeroed
(`on_unreachable`): a dead process runs nothing and holds no KV, and a gauge left at
its last value would say otherwise. After each round the router's `after_poll` runs (it retires
drained instances). A failure seen while serving a request triggers an immediate check
of the instances involved (`check`), so a dead one stops getting work at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from distserve_engine.dispatch import Slot
from distserve_engine.interface import InstanceError
from distserve_engine.request import InstanceLoad


class HealthPoller:
    """Polls the slots `slots()` returns every `interval_s` seconds."""

    def __init__(self, slots: Callable[[], list[Slot]], interval_s: float,
                 on_load: Callable[[InstanceLoad], None] | None = None,
                 after_poll: Callable[[], Awaitable[None]] | None = None,
                 on_unreachable: Callable[[str, str], None] | None = None) -> None:
        self.slots = slots
        self.interval_s = interval_s
        self.on_load = on_load  # e.g. the metrics' load gauges
        self.on_unreachable = on_unreachable  # (role, instance name) that did not answer
        self.after_poll = after_poll
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Poll once now, then on the interval in the background."""
        await self.poll()
        self._task = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        """Stop the background polling."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def poll(self) -> None:
        """Check every instance once, then run `after_poll`."""
        await self.check(*self.slots())
        if self.after_poll is not None:
            await self.after_poll()

    async def check(self, *slots: Slot | None) -> None:
        """Read these instances' loads now; mark the unreachable ones unhealthy."""
        await asyncio.gather(*(self._check(s) for s in slots if s is not None))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll()

    async def _check(self, slot: Slot) -> None:
        try:
            load = await slot.client.load()
        except InstanceError as exc:
            slot.is_healthy, slot.error = False, str(exc)
            if self.on_unreachable is not None:
                self.on_unreachable(slot.client.role, slot.client.name)
            return
        slot.is_healthy, slot.error = load.is_healthy, load.error
        slot.kv_usage = load.kv_usage
        if self.on_load is not None:
            self.on_load(load)
