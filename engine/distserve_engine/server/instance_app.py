"""The HTTP face of one instance, which routers and decode instances call.

Internal endpoints (JSON; the contract is `request.py`'s dataclasses):
- `POST /prefill` {request} -> PrefillOutput (prefill role; waits for the first token)
- `POST /decode` {request, prefill} -> JSON lines of TokenEvents (decode role)
- `POST /generate` {request} -> JSON lines of TokenEvents (colocated role)
- `GET /kv/{id}` raw K then V bytes, header in X-KV-Header (prefill; TCP transfer)
- `POST /kv/{id}/shm` {path, arena_bytes, offset, nbytes}: export the KV straight into
  that range of the decode process's /dev/shm arena -> the blob's header (prefill;
  shared-memory transfer; the decode side frees the range itself).
- `DELETE /requests/{id}` cancel; `GET /load`, `GET /health` (ready for work),
  `GET /livez` (the engine thread alive and not stuck), `GET /metrics`,
  `GET /debug/iterations?limit=N` (the runner's recent batches, timed: `iterations.py`).
A caller that disconnects from a prefill or a stream cancels the request.

The routes are module-level; what they serve (the instance, its arena, its metrics)
lives in `app.state.served`, set by `build_instance_app`. A prefill instance writes a
token file into /dev/shm at start; decode processes that see it pull through shared
memory (`transfer/shm.py`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from distserve_engine.instance.iterations import ITERATION_HISTORY
from distserve_engine.metrics import CONTENT_TYPE, ServingMetrics
from distserve_engine.request import PrefillOutput, ServeRequest, TokenEvent
from distserve_engine.transfer import shm, tcp
from distserve_engine.transfer.codec import blob_header

if TYPE_CHECKING:
    from distserve_engine.instance.colocated import ColocatedInstance
    from distserve_engine.instance.decode import DecodeInstance
    from distserve_engine.instance.prefill import PrefillInstance

    Instance = PrefillInstance | DecodeInstance | ColocatedInstance


routes = APIRouter()


@dataclass
class Served:
    """What one instance server serves."""

    instance: Instance
    metrics: ServingMetrics | None = None
    arenas: shm.ArenaWriter | None = None  # prefill only, where /dev/shm exists


def build_instance_app(instance: Instance, metrics: ServingMetrics | None = None) -> FastAPI:
    """The FastAPI app of a prefill, decode or colocated instance."""
    app = FastAPI(title=f"DistServe {instance.role} instance {instance.name}")
    served = Served(instance, metrics)
    if instance.role == "prefill" and shm.is_available():
        served.arenas = shm.ArenaWriter()
        token = shm.make_token()
        instance.shm_token = token.name  # handles tell decode processes how to prove sharing
        app.router.on_shutdown.append(lambda: token.unlink(missing_ok=True))
    app.state.served = served
    app.include_router(routes)
    return app


def _served(raw: Request) -> Served:
    return raw.app.state.served


def _sink_to(queue: asyncio.Queue) -> Any:
    """A sink the engine thread calls; the event hops onto this event loop's queue."""
    loop = asyncio.get_running_loop()
    return lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)


async def _events(instance: Instance, queue: asyncio.Queue, request_id: str) -> AsyncIterator[str]:
    """JSON lines of the request's events; a caller that goes away cancels the request."""
    is_done = False
    try:
        while not is_done:
            event: TokenEvent = await queue.get()
            is_done = event.is_last
            yield json.dumps(event.to_dict()) + "\n"
    finally:
        if not is_done:
            instance.cancel(request_id)


@routes.post("/prefill")
async def prefill(raw: Request) -> Response:
    instance = _served(raw).instance
    request = ServeRequest.from_dict((await raw.json())["request"])
    queue: asyncio.Queue = asyncio.Queue()
    instance.submit(request, _sink_to(queue))
    try:
        out = await queue.get()
    except asyncio.CancelledError:
        instance.cancel(request.request_id)
        raise
    if isinstance(out, TokenEvent):
        return JSONResponse({"error": out.error or "aborted"}, status_code=503)
    return JSONResponse(out.to_dict())


@routes.post("/decode")
async def decode(raw: Request) -> Response:
    instance = _served(raw).instance
    body = await raw.json()
    request = ServeRequest.from_dict(body["request"])
    queue: asyncio.Queue = asyncio.Queue()
    instance.submit(request, PrefillOutput.from_dict(body["prefill"]), _sink_to(queue))
    return StreamingResponse(_events(instance, queue, request.request_id),
                             media_type="application/x-ndjson")


@routes.post("/generate")
async def generate(raw: Request) -> Response:
    instance = _served(raw).instance
    request = ServeRequest.from_dict((await raw.json())["request"])
    queue: asyncio.Queue = asyncio.Queue()
    instance.submit(request, _sink_to(queue))
    return StreamingResponse(_events(instance, queue, request.request_id),
                             media_type="application/x-ndjson")


@routes.get("/kv/{request_id}")
async def kv_tcp(request_id: str, raw: Request) -> Response:
    try:
        blob = await asyncio.to_thread(_served(raw).instance.take_kv, request_id)
    except KeyError:
        return JSONResponse({"error": f"no KV held for {request_id}"}, status_code=404)
    body, headers = await asyncio.to_thread(tcp.encode, blob)
    return Response(body, media_type="application/octet-stream", headers=headers)


@routes.post("/kv/{request_id}/shm")
async def kv_shm(request_id: str, raw: Request) -> Response:
    served = _served(raw)
    if served.arenas is None:
        return JSONResponse({"error": "this instance has no shared memory"}, status_code=409)
    try:
        into = served.arenas.range(await raw.json())
    except (shm.ArenaError, KeyError, TypeError, ValueError) as exc:
        return JSONResponse({"error": f"shared-memory range: {exc}"}, status_code=400)
    try:
        blob = await asyncio.to_thread(served.instance.take_kv, request_id, into)
    except KeyError:
        return JSONResponse({"error": f"no KV held for {request_id}"}, status_code=404)
    return JSONResponse(blob_header(blob))


@routes.delete("/requests/{request_id}")
async def cancel(request_id: str, raw: Request) -> dict:
    _served(raw).instance.cancel(request_id)
    return {"cancelled": request_id}


@routes.get("/load")
async def load(raw: Request) -> dict:
    return _served(raw).instance.load().to_dict()


@routes.get("/debug/iterations")
async def iterations(raw: Request, limit: int = Query(ITERATION_HISTORY, ge=1, le=ITERATION_HISTORY)) -> Response:
    """The engine thread's recent runner calls, oldest first (`instance.iterations`)."""
    recent = _served(raw).instance.iterations.recent(limit)
    return JSONResponse([item.to_dict() for item in recent])


@routes.get("/health")
async def health(raw: Request) -> Response:
    instance = _served(raw).instance
    status = 200 if instance.is_healthy else 503
    return JSONResponse({"healthy": instance.is_healthy, "error": instance.error}, status_code=status)


@routes.get("/livez")
async def livez(raw: Request) -> Response:
    instance = _served(raw).instance
    is_live = instance.is_live()  # False: dead or hung; kubelet restarts the pod
    return JSONResponse({"live": is_live, "error": instance.error}, status_code=200 if is_live else 503)


@routes.get("/metrics")
async def metrics_text(raw: Request) -> Response:
    served = _served(raw)
    if served.metrics is None:
        return Response(b"", media_type=CONTENT_TYPE)
    served.metrics.set_load(served.instance.load())
    return Response(served.metrics.render(), media_type=CONTENT_TYPE)
