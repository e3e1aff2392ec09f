"""Metrics stay true when an instance dies: its gauges read 0, and a drained one's go away."""

from __future__ import annotations

import asyncio

from fake_instances import GatedClient

from distserve_engine.interface import InstanceError
from distserve_engine.metrics import ServingMetrics
from distserve_engine.request import InstanceLoad
from distserve_engine.router import Router


class DyingClient(GatedClient):
    """Reports a busy load until `is_dead`, then cannot be reached."""

    is_dead = False

    async def load(self) -> InstanceLoad:
        if self.is_dead:
            raise InstanceError("connection refused")
        return InstanceLoad(self.name, self.role, num_waiting=2, num_running=4, num_held=1,
                            kv_usage=0.5)


def series(metrics: ServingMetrics, name: str, instance: str) -> float | None:
    """The value of one gauge of one instance, None when it has no series."""
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and s.labels.get("instance") == instance:
                return s.value
    return None


def test_a_dead_instance_reads_unhealthy_and_idle():
    metrics = ServingMetrics("test", "router", "router-0", "m")
    decode = DyingClient("decode-0", "decode")
    router = Router([GatedClient("prefill-0", "prefill")], [decode], metrics=metrics)
    asyncio.run(router.poll())
    assert series(metrics, "vllm:num_requests_running", "decode-0") == 4
    assert series(metrics, "distserve_instance_healthy", "decode-0") == 1
    decode.is_dead = True
    asyncio.run(router.poll())
    for name in ("distserve_instance_healthy", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "distserve_kv_held_requests"):
        assert series(metrics, name, "decode-0") == 0, name


def test_a_drained_instance_has_no_series_left():
    metrics = ServingMetrics("test", "router", "router-0", "m")
    decode = DyingClient("decode-0", "decode")
    router = Router([GatedClient("prefill-0", "prefill")], [decode, DyingClient("decode-1", "decode")],
                    metrics=metrics)
    asyncio.run(router.poll())
    router.decode[0].is_draining = True
    asyncio.run(router.poll())  # idle and draining: removed after the round
    assert [s.client.name for s in router.decode] == ["decode-1"]
    assert series(metrics, "distserve_instance_healthy", "decode-0") is None
    assert series(metrics, "distserve_instance_healthy", "decode-1") == 1
