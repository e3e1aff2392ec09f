"""The HTTP face of one instance, which routers and decode instances call.

Internal endpoints (JSON; the contract is `request.py`'s dataclasses):
- `POST /prefill` {request} -> PrefillOutput (prefill role; waits for the first token)
- `POST /decode` {request, prefill} -> JSON lines of TokenEvents (decode role)
- `POST /generate` {request} -> JSON lines of TokenEvents (colocated role)
- `GET /kv/{id}` raw K then V bytes, header in X-KV-Header (prefill; TCP transfer)
- `POST /kv/{id}/shm` -> header: where in this process's /dev/shm arena the KV now is
  (prefill; shared-memory transfer); `DELETE /kv/{id}/shm` releases that range.
- `DELETE /requests/{id}` cancel; `GET /load`, `GET /health` (ready for work),
  `GET /livez` (the engine thread alive and not stuck), `GET /metrics`.
A caller that disconnects from a prefill or a stream cancels the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from distserve_engine.metrics import CONTENT_TYPE
from distserve_engine.request import PrefillOutput, ServeRequest, TokenEvent
from distserve_engine.transfer import shm, tcp

MAX_ARENA_BYTES = 1 << 30  # the shared-memory arena never holds more than the KV cache


def build_instance_app(instance: Any, metrics: Any = None) -> FastAPI:
    """The FastAPI app of a prefill, decode or colocated instance."""
    app = FastAPI(title=f"DistServe {instance.role} instance {instance.name}")
    arena = None
    if instance.role == "prefill" and shm.is_available():
        arena = shm.Arena(min(instance.runner.kv_cache.nbytes, MAX_ARENA_BYTES))
        instance.shm_token = arena.token  # handles tell decode processes how to prove sharing
        app.router.on_shutdown.append(arena.close)

    def sink_to(queue: asyncio.Queue) -> Any:
        loop = asyncio.get_running_loop()
        return lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)

    async def events(queue: asyncio.Queue, request_id: str) -> AsyncIterator[str]:
        is_done = False
        try:
            while not is_done:
                event: TokenEvent = await queue.get()
                is_done = event.is_last
                yield json.dumps(event.to_dict()) + "\n"
        finally:
            if not is_done:  # the caller went away
                instance.cancel(request_id)

    @app.post("/prefill")
    async def prefill(raw: Request) -> Response:
        request = ServeRequest.from_dict((await raw.json())["request"])
        queue: asyncio.Queue = asyncio.Queue()
        instance.submit(request, sink_to(queue))
        try:
            out = await queue.get()
        except asyncio.CancelledError:
            instance.cancel(request.request_id)
            raise
        if isinstance(out, TokenEvent):
            return JSONResponse({"error": out.error or "aborted"}, status_code=503)
        return JSONResponse(out.to_dict())

    @app.post("/decode")
    async def decode(raw: Request) -> Response:
        body = await raw.json()
        request = ServeRequest.from_dict(body["request"])
        queue: asyncio.Queue = asyncio.Queue()
        instance.submit(request, PrefillOutput.from_dict(body["prefill"]), sink_to(queue))
        return StreamingResponse(events(queue, request.request_id), media_type="application/x-ndjson")

    @app.post("/generate")
    async def generate(raw: Request) -> Response:
        request = ServeRequest.from_dict((await raw.json())["request"])
        queue: asyncio.Queue = asyncio.Queue()
        instance.submit(request, sink_to(queue))
        return StreamingResponse(events(queue, request.request_id), media_type="application/x-ndjson")

    @app.get("/kv/{request_id}")
    async def kv_tcp(request_id: str) -> Response:
        try:
            blob = await asyncio.to_thread(instance.take_kv, request_id)
        except KeyError:
            return JSONResponse({"error": f"no KV held for {request_id}"}, status_code=404)
        body, headers = await asyncio.to_thread(tcp.encode, blob)
        return Response(body, media_type="application/octet-stream", headers=headers)

    @app.post("/kv/{request_id}/shm")
    async def kv_shm(request_id: str) -> Response:
        if arena is None:
            return JSONResponse({"error": "this instance has no shared-memory arena"}, status_code=409)
        try:
            blob = await asyncio.to_thread(instance.take_kv, request_id)
        except KeyError:
            return JSONResponse({"error": f"no KV held for {request_id}"}, status_code=404)
        return JSONResponse(await asyncio.to_thread(arena.put, request_id, blob))

    @app.delete("/kv/{request_id}/shm")
    async def kv_shm_release(request_id: str) -> dict:
        return {"released": arena is not None and arena.release(request_id)}

    @app.delete("/requests/{request_id}")
    async def cancel(request_id: str) -> dict:
        instance.cancel(request_id)
        return {"cancelled": request_id}

    @app.get("/load")
    async def load() -> dict:
        return instance.load().to_dict()

    @app.get("/health")
    async def health() -> Response:
        status = 200 if instance.is_healthy else 503
        return JSONResponse({"healthy": instance.is_healthy, "error": instance.error}, status_code=status)

    @app.get("/livez")
    async def livez() -> Response:
        is_live = instance.is_live()  # False: dead or hung; kubelet restarts the pod
        return JSONResponse({"live": is_live, "error": instance.error}, status_code=200 if is_live else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        if metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        metrics.set_load(instance.load())
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
