"""The kopf handlers: thin, named `<resource>_<event>`; the work is in `reconciling`.

Run with `distserve operator` (or `kopf run -m distserve.k8s.handlers -A`); the
periodic monitor is in `monitoring`. Each
handler of one resource takes that resource's lock, so a plan being written and the
periodic monitor never interleave; different resources proceed in parallel (the
search itself runs in a worker thread).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from distserve import spec as specs
from distserve.k8s import client, metrics, monitoring, naming, network, reconciling, replanning
from distserve.k8s.client import ApiClient

RESOURCE = (specs.API_GROUP, specs.API_VERSION, specs.PLURAL)
TIMING = reconciling.Timing()
FINALIZER = "distserve.io/cleanup"
STORAGE_PREFIX = "operator.distserve.io"


def _lock(memo: Any) -> asyncio.Lock:
    """The per-resource lock (kopf gives every resource its own memo)."""
    if "lock" not in memo:
        memo["lock"] = asyncio.Lock()
    return memo["lock"]


@kopf.on.startup()
async def operator_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Settings and the API client shared by all handlers."""
    settings.persistence.finalizer = FINALIZER
    # NOTE: not the distserve.io/ prefix: kopf hides its own prefix's annotations from the
    # change detection, and distserve.io/approved-plan must stay visible.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=STORAGE_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=STORAGE_PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.INFO
    network.settings()  # a malformed chart value stops the operator here, naming the variable
    memo["api"] = ApiClient()


@kopf.on.cleanup()
async def operator_cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Close the API client."""
    if "api" in memo:
        await memo["api"].close()


@kopf.on.login()
def operator_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """One login for kopf and for the operator's own client."""
    return client.login(**kwargs)


@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
async def deployment_plan(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A new or changed spec: plan, show, apply (or wait for approval)."""
    async with _lock(memo):
        await reconciling.plan_resource(memo["api"], body)


@kopf.on.resume(*RESOURCE)
async def deployment_resume(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Operator restarted: make sure the applied plan's objects exist, change nothing else."""
    async with _lock(memo):
        await reconciling.resume(memo["api"], body)


@kopf.on.field(*RESOURCE, field=("metadata", "annotations", naming.APPROVAL_ANNOTATION))
async def deployment_approve(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The user approved a plan through the annotation."""
    async with _lock(memo):
        await reconciling.approve(memo["api"], body)


@kopf.timer(*RESOURCE, interval=TIMING.monitor_interval_s, initial_delay=TIMING.monitor_interval_s)
async def deployment_monitor(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Readiness, failing pods, and the rollout's drain-then-delete steps."""
    async with _lock(memo):
        await monitoring.monitor(memo["api"], body, TIMING)


@kopf.timer(*RESOURCE, interval=TIMING.replan_tick_s, initial_delay=TIMING.replan_tick_s)
async def deployment_replan(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """With spec.replanning enabled: observe, decide, reshuffle. The observation and the
    search run without the resource's lock (they take seconds); the writes take it."""
    await replanning.replan_round(memo["api"], body, memo, _lock(memo))


@kopf.on.delete(*RESOURCE)
async def deployment_delete(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Delete everything the resource owns."""
    async with _lock(memo):
        count = await reconciling.delete_resource(memo["api"], body)
    metrics.forget(naming.Owner.from_body(body))
    logger.info(f"deleted {count} objects")
