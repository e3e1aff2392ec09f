"""The OpenAI-compatible API in front of the router (FastAPI).

`/v1/completions`, `/v1/chat/completions` (the checkpoint's chat template),
`/v1/models`, `/health` (503 while no instance can take work), `/livez` (the process
answers), `/metrics`, and `/debug/timelines` (recent request
timelines). Streams are server-sent events ending in `data: [DONE]`. Errors use
OpenAI's format: 400 naming the field for bad input, 404 for another model, 429 or 503
with `Retry-After` when overloaded, 503 when an instance fails a request. A client that
disconnects cancels its request, which frees its KV on every instance.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from distserve_engine.errors import EngineError
from distserve_engine.metrics import CONTENT_TYPE
from distserve_engine.request import ServeRequest, now_s
from distserve_engine.router import Overloaded, Router
from distserve_engine.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    to_sampling_params,
)
from distserve_engine.server.responses import Reply, error_body, sse

DISCONNECT_POLL_S = 0.2


def error_response(message: str, status: int, param: str | None = None,
                   retry_after_s: int | None = None) -> JSONResponse:
    """An OpenAI-format error, with Retry-After when given."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return error_response(f"body: not valid JSON ({err.get('msg')})", 400, "body")
    message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    return error_response(message, 400, param)


class Frontend:
    """Turns API requests into ServeRequests and router events into OpenAI replies."""

    def __init__(self, router: Router, tokenizer: Any, model_name: str, max_model_len: int,
                 default_max_tokens: int | None = None) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens

    def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> ServeRequest:
        """Tokenize and check the request; BadRequest naming the field."""
        if body.model is not None and body.model != self.model_name:
            raise BadRequest(f"model: {body.model!r} is not served here; use {self.model_name!r}",
                             "model", status=404)
        is_chat = isinstance(body, ChatCompletionRequest)
        field = "messages" if is_chat else "prompt"
        try:
            if is_chat:
                token_ids = self.tokenizer.apply_chat_template([m.as_template_input() for m in body.messages])
            else:
                prompt = body.prompt_of()
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                vocab = self.tokenizer.vocab_size
                if any(not 0 <= t < vocab for t in token_ids):
                    raise BadRequest(f"prompt: token ids must be in [0, {vocab})", "prompt")
            params = to_sampling_params(body, len(token_ids), self.max_model_len,
                                        self.default_max_tokens if is_chat else 16, field)
        except EngineError as exc:
            raise BadRequest(str(exc), str(exc).split(":")[0] or field) from None
        prefix = "chatcmpl" if is_chat else "cmpl"
        return ServeRequest(f"{prefix}-{uuid.uuid4().hex}", token_ids, params, arrival_s=now_s())

    async def stream(self, request: ServeRequest, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks of one request, then [DONE]."""
        is_first = True
        async for event in self.router.generate(request):
            if event.error is not None:
                yield sse(error_body(event.error, 503))
                break
            reply.num_output_tokens += len(event.token_ids)
            reason = _finish_reason(event.finish_reason)
            if event.text or reason or is_first:
                yield sse(reply.chunk(event.text, reason, is_first=is_first))
                is_first = False
            if event.is_last:
                break
        if include_usage:
            yield sse(reply.usage_chunk())
        yield sse("[DONE]")

    async def collect(self, request: ServeRequest, reply: Reply) -> Reply | JSONResponse:
        """The whole reply, or the error response when an instance failed it."""
        async for event in self.router.generate(request):
            if event.error is not None:
                return error_response(event.error, 503, retry_after_s=1)
            reply.text += event.text
            reply.num_output_tokens += len(event.token_ids)
            if event.is_last:
                reply.finish_reason = _finish_reason(event.finish_reason)
                break
        return reply


def _finish_reason(reason: str | None) -> str | None:
    return None if reason in (None, "abort") else reason


async def _until_disconnect(raw: Request, work: asyncio.Task) -> Any:
    """Await `work`, cancelling it (and so the request) when the client goes away."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return work.result()
        if await raw.is_disconnected():
            work.cancel()
            return None


def build_openai_app(frontend: Frontend, metrics: Any, on_startup: Any = None,
                     on_shutdown: Any = None) -> FastAPI:
    """The router's FastAPI app."""
    app = FastAPI(title="DistServe", on_startup=[on_startup] if on_startup else None,
                  on_shutdown=[on_shutdown] if on_shutdown else None)
    app.exception_handler(RequestValidationError)(lambda _r, exc: _validation_response(exc))

    async def serve(raw: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        try:
            request = frontend.prepare(body)
            if metrics is not None:
                metrics.observe_arrival()
            frontend.router.admit()
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.param)
        except Overloaded as exc:
            if metrics is not None:
                metrics.rejected.labels(**metrics.labels, status=str(exc.status)).inc()
            return error_response(str(exc), exc.status, retry_after_s=exc.retry_after_s)
        reply = Reply(request.request_id, frontend.model_name,
                      isinstance(body, ChatCompletionRequest), request.num_prompt_tokens)
        if body.stream:
            return StreamingResponse(frontend.stream(request, reply, body.include_usage),
                                     media_type="text/event-stream")
        result = await _until_disconnect(raw, asyncio.create_task(frontend.collect(request, reply)))
        if result is None:  # client gone; nobody reads this
            return Response(status_code=499)
        return result if isinstance(result, JSONResponse) else JSONResponse(result.whole())

    @app.post("/v1/completions")
    async def completions(raw: Request, body: CompletionRequest) -> Response:
        return await serve(raw, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request, body: ChatCompletionRequest) -> Response:
        return await serve(raw, body)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": frontend.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "distserve", "max_model_len": frontend.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        try:
            frontend.router.admit()
        except Overloaded as exc:
            if exc.status == 503:
                return error_response(str(exc), 503, retry_after_s=exc.retry_after_s)
        return JSONResponse({"status": "ok"})

    @app.get("/livez")
    async def livez() -> dict:
        # NOTE: the router is alive while it answers; it must not be restarted because
        # its instances are down (that is /health's 503, a readiness matter).
        return {"live": True}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render() if metrics else b"", media_type=CONTENT_TYPE)

    @app.get("/debug/timelines")
    async def timelines(limit: int = 100) -> Response:
        recent = list(frontend.router.timelines)[-limit:]
        return Response(json.dumps([t.to_dict() for t in recent]), media_type="application/json")

    return app
