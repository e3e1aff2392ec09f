"""The router's peers at run time: re-read the settings file when its content changes.

The operator mounts the router's `serve.json` from a ConfigMap; kubelet replaces a
ConfigMap volume's files in place (an atomic symlink swap), so a plan switch reaches a
running router as a new file, not as a new pod. The watcher polls the file's content
every few seconds and hands the router the new peers (added at once; those gone drain:
no new request, in-flight ones finish) and the new limits (waiting bound, SLOs) and plan (its metrics).
A file that does not parse is logged and ignored: the router keeps what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distserve_engine.router import Router
from distserve_engine.server.settings import Peer, ServeSettings

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 2.0  # how often the file is read; kubelet's own delay dominates anyway


def apply_settings(router: Router, settings: ServeSettings,
                   make_clients: Callable[[dict[str, list[Peer]]], dict[str, list[Any]]]) -> None:
    """Give the router the settings' peers and limits."""
    router.max_waiting_requests = settings.max_waiting_requests
    router.max_decode_batch = settings.max_decode_batch
    router.can_decode_across_nodes = settings.can_decode_across_nodes
    router.ttft_slo_s, router.tpot_slo_s = settings.ttft_slo_s, settings.tpot_slo_s
    router.set_peers(make_clients(settings.peers))
    if router.metrics is not None:  # a replan names a new plan in the same file
        router.metrics.set_plan(**settings.plan_metrics())
        settings.export_slo(router.metrics)


class PeerWatcher:
    """Polls one settings file; on a change of content, re-applies it to the router."""

    def __init__(self, path: str | Path, router: Router,
                 make_clients: Callable[[dict[str, list[Peer]]], dict[str, list[Any]]],
                 interval_s: float = WATCH_INTERVAL_S) -> None:
        self.path = Path(path)
        self.router = router
        self.make_clients = make_clients
        self.interval_s = interval_s
        self._digest = self._read_digest()
        self._task: asyncio.Task | None = None

    def _read_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def check(self) -> bool:
        """Read the file once; True when it changed and was applied."""
        digest = self._read_digest()
        if digest is None or digest == self._digest:
            return False
        try:
            settings = ServeSettings.load(self.path)
        except (ValueError, OSError, TypeError) as exc:
            log.warning("peers: %s ignored: %s", self.path, exc)
            return False
        self._digest = digest
        apply_settings(self.router, settings, self.make_clients)
        log.info("peers: %s reloaded", self.path)
        return True

    def start(self) -> None:
        """Start polling (inside the running event loop)."""
        self._task = asyncio.create_task(self._watch_forever())

    async def stop(self) -> None:
        """Stop polling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()
