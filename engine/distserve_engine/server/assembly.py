"""Builds runners, instances, the router and the apps from the serving settings."""

from __future__ import annotations

import os
from typing import Any

import torch

from distserve_engine.instance.client import HttpInstanceClient, LocalInstanceClient
from distserve_engine.instance.colocated import ColocatedInstance
from distserve_engine.instance.decode import DecodeInstance
from distserve_engine.instance.prefill import PrefillInstance
from distserve_engine.metrics import ServingMetrics
from distserve_engine.router import Router
from distserve_engine.runner import ModelRunner
from distserve_engine.server.openai_app import Frontend, build_openai_app
from distserve_engine.server.settings import Peer, ServeSettings
from distserve_engine.transfer import KVFetcher, inprocess

ROLES = ("prefill", "decode", "colocated")


def pin_cpu(cores: list[int] | None, num_threads: int | None = None) -> None:
    """Pin this process to these cores and size torch's thread pools to them."""
    if cores:
        os.sched_setaffinity(0, set(cores))
    threads = num_threads or (len(cores) if cores else None)
    if threads:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)  # one op at a time: the engine thread's
        except RuntimeError:  # already set, or inter-op work already ran in this process
            pass


MAX_ARENA_BYTES = 1 << 30  # a decode's shared-memory arena: at most its KV cache, and 1 GiB


def build_instance(role: str, name: str, settings: ServeSettings, runner: Any = None,
                   url: str = "") -> Any:
    """A started instance of `role` with its own runner."""
    runner = runner or ModelRunner(settings.engine)
    if role == "prefill":
        instance = PrefillInstance(name, runner, settings.max_prefill_tokens, url=url)
        inprocess.register(instance)
    elif role == "decode":
        fetcher = KVFetcher(arena_bytes=min(runner.kv_capacity_bytes, MAX_ARENA_BYTES))
        instance = DecodeInstance(name, runner, fetcher, settings.max_decode_batch)
    elif role == "colocated":
        instance = ColocatedInstance(name, runner, settings.max_prefill_tokens,
                                     settings.max_decode_batch)
    else:
        raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
    return instance.start()


def build_metrics(settings: ServeSettings, role: str, name: str) -> ServingMetrics:
    """The process's metrics with its labels and the plan it serves under."""
    metrics = ServingMetrics(settings.deployment, role, name, settings.model_name,
                             settings.engine.max_model_len)
    metrics.set_plan(**settings.plan_metrics())
    settings.export_slo(metrics)
    return metrics


def build_router(settings: ServeSettings, role_to_clients: dict[str, list[Any]],
                 metrics: Any) -> Router:
    """A router over the given instance clients."""
    return Router(role_to_clients.get("prefill", []), role_to_clients.get("decode", []),
                  role_to_clients.get("colocated", []), metrics=metrics,
                  max_waiting_requests=settings.max_waiting_requests,
                  ttft_slo_s=settings.ttft_slo_s, tpot_slo_s=settings.tpot_slo_s,
                  max_decode_batch=settings.max_decode_batch,
                  max_inflight_requests=settings.max_inflight_requests,
                  admit_by_ttft=settings.admit_by_ttft,
                  can_decode_across_nodes=settings.can_decode_across_nodes)


def http_clients(peers: dict[str, list[Peer]]) -> dict[str, list[HttpInstanceClient]]:
    """Clients of the peers' instance servers, per role."""
    return {role: [HttpInstanceClient(p.name, role, p.url, p.node, p.draining) for p in entries]
            for role, entries in peers.items() if entries}


def build_in_process(settings: ServeSettings) -> tuple[Router, list[Any], Any]:
    """Router and all instances in this process (`--role all`, tests); returns the runner used for the tokenizer."""
    names = [(role, f"{role}-{i}") for role in ROLES for i in range(settings.instances.get(role, 0))]
    multi_rank = [name for role, name in names if settings.parallel_of(role, name).num_ranks > 1]
    if multi_rank:
        raise ValueError(f"parallel.{multi_rank[0]}: several ranks need one process per rank; "
                         "one process serving every instance runs them at tp = pp = 1")
    instances = [build_instance(role, name, settings) for role, name in names]
    clients: dict[str, list[Any]] = {}
    for instance in instances:
        clients.setdefault(instance.role, []).append(LocalInstanceClient(instance))
    metrics = build_metrics(settings, "router", "router-0")
    return build_router(settings, clients, metrics), instances, instances[0].runner


def build_frontend_app(settings: ServeSettings, router: Router, tokenizer: Any,
                       max_model_len: int, on_shutdown: Any = None, watcher: Any = None,
                       api_keys: tuple[str, ...] = ()) -> Any:
    """The OpenAI app over a router; the router starts polling (and `watcher`, a
    PeerWatcher, watching the settings file) when the app starts. With `api_keys`, /v1
    and /debug need one of them."""
    frontend = Frontend(router, tokenizer, settings.model_name, max_model_len,
                        settings.default_max_tokens)

    async def startup() -> None:
        await router.start()
        if watcher is not None:
            watcher.start()

    async def shutdown() -> None:
        if watcher is not None:
            await watcher.stop()
        await router.stop()
        if on_shutdown is not None:
            on_shutdown()

    return build_openai_app(frontend, router.metrics, on_startup=startup, on_shutdown=shutdown,
                            api_keys=api_keys, max_body_bytes=settings.max_request_body_bytes)


def load_tokenizer(settings: ServeSettings) -> tuple[Any, int]:
    """The tokenizer and context length, without loading weights (router pods)."""
    from distserve_engine.loader import load_model_config, resolve_checkpoint
    from distserve_engine.tokenizer import Tokenizer

    config = settings.engine
    ckpt = resolve_checkpoint(config.model, require_weights=False)
    model_config = load_model_config(ckpt)
    max_model_len = min(model_config.max_position, config.max_model_len or model_config.max_position)
    return Tokenizer.load(ckpt, model_config.eos_token_ids), max_model_len
