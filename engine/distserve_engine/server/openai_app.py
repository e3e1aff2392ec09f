"""The OpenAI-compatible API in front of the router (FastAPI).

`/v1/completions`, `/v1/chat/completions` (the checkpoint's chat template),
`/v1/models`, `/health` (503 while no instance can take work), `/livez` (the process
answers), `/metrics`, and `/debug/timelines` (recent request timelines). Streams are
server-sent events ending in `data: [DONE]`. Every error is OpenAI's format (`edge.py`
answers those the framework would: 401, 404, 405, 413, 500): 400 naming the field for
bad input, 404 for another model, 429 with `Retry-After` when overloaded, 503 when a
phase has no instance or an instance failed a request. A client that disconnects
cancels its request, which frees its KV on every instance.

# NOTE: decoding, validating and tokenizing a body run in a small thread pool, not on
# the event loop: a prompt of megabytes takes seconds to tokenize, and on the loop it
# would pause every stream and /health meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from distserve_engine.admission import Ticket
from distserve_engine.errors import EngineError
from distserve_engine.metrics import CONTENT_TYPE
from distserve_engine.request import ServeRequest, now_s
from distserve_engine.router import TIMELINE_HISTORY, Overloaded, Router
from distserve_engine.server import edge
from distserve_engine.server.edge import error_response
from distserve_engine.server.openapi import openapi_document
from distserve_engine.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    to_sampling_params,
)
from distserve_engine.server.responses import Reply, error_body, sse

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2
PARSE_THREADS = 4  # bodies parsed and tokenized at once; more wait for a thread


class Frontend:
    """Turns API requests into ServeRequests and router events into OpenAI replies."""

    def __init__(self, router: Router, tokenizer: Any, model_name: str, max_model_len: int,
                 default_max_tokens: int | None = None) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.num_preparing = 0  # bodies being parsed and tokenized now
        self._pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="parse")

    async def prepare_bytes(self, model: type, body: bytes
                            ) -> tuple[CompletionRequest | ChatCompletionRequest, ServeRequest]:
        """Parse, check and tokenize a body in the thread pool; BadRequest naming the field."""
        self.num_preparing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, self._prepare_bytes, model, body)
        finally:
            self.num_preparing -= 1

    def _prepare_bytes(self, model: type, body: bytes) -> tuple[Any, ServeRequest]:
        parsed = parse_body(model, body)
        return parsed, self.prepare(parsed)

    def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> ServeRequest:
        """Tokenize and check the request; BadRequest naming the field."""
        if body.model is not None and body.model != self.model_name:
            raise BadRequest(f"model: {body.model!r} is not served here; use {self.model_name!r}",
                             "model", status=404)
        is_chat = isinstance(body, ChatCompletionRequest)
        field = "messages" if is_chat else "prompt"
        try:
            if is_chat:
                token_ids = self._chat_tokens(body)
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

    def _chat_tokens(self, body: ChatCompletionRequest) -> list[int]:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template([m.as_template_input() for m in body.messages])
        except TemplateError as exc:
            raise BadRequest(f"messages: the model's chat template refuses them ({exc})",
                             "messages") from None

    async def stream(self, request: ServeRequest, reply: Reply, include_usage: bool,
                     ticket: Ticket) -> AsyncIterator[str]:
        """SSE chunks of one request, then [DONE]."""
        is_first = True
        async for event in self.router.generate(request, ticket):
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

    async def collect(self, request: ServeRequest, reply: Reply, ticket: Ticket
                      ) -> Reply | JSONResponse:
        """The whole reply, or the error response when an instance failed it."""
        async for event in self.router.generate(request, ticket):
            if event.error is not None:
                return error_response(event.error, 503)
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


def _refused(exc: Overloaded, metrics: Any) -> JSONResponse:
    if metrics is not None:
        metrics.rejected.labels(**metrics.labels, status=str(exc.status)).inc()
    return error_response(str(exc), exc.status, retry_after_s=exc.retry_after_s)


async def serve(frontend: Frontend, metrics: Any, raw: Request, model: type) -> Response:
    """One generation request: refuse early when full, parse off the loop, admit, answer."""
    try:
        frontend.router.check_phases()  # cheap, before a body is parsed
    except Overloaded as exc:
        if metrics is not None:
            metrics.observe_arrival()
        return _refused(exc, metrics)
    try:
        body, request = await frontend.prepare_bytes(model, await raw.body())
    except BadRequest as exc:
        return error_response(str(exc), exc.status, exc.param)
    if metrics is not None:
        metrics.observe_arrival()
    try:
        ticket = frontend.router.admit(request.num_prompt_tokens)
    except Overloaded as exc:
        return _refused(exc, metrics)
    reply = Reply(request.request_id, frontend.model_name, model is ChatCompletionRequest,
                  request.num_prompt_tokens)
    if body.stream:
        # The ticket is released when the stream ends, or here if it never started.
        return StreamingResponse(frontend.stream(request, reply, body.include_usage, ticket),
                                 media_type="text/event-stream",
                                 background=BackgroundTask(ticket.release))
    try:
        result = await _until_disconnect(
            raw, asyncio.create_task(frontend.collect(request, reply, ticket)))
    finally:
        ticket.release()
    if result is None:  # client gone; nobody reads this
        return Response(status_code=499)
    return result if isinstance(result, JSONResponse) else JSONResponse(result.whole())


def build_openai_app(frontend: Frontend | None, metrics: Any, on_startup: Any = None,
                     on_shutdown: Any = None, api_keys: Sequence[str] = (),
                     max_body_bytes: int = edge.DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The router's FastAPI app (`api_keys`: required on /v1 and /debug when given)."""
    app = FastAPI(title="DistServe", version="1", on_startup=[on_startup] if on_startup else None,
                  on_shutdown=[on_shutdown] if on_shutdown else None)
    edge.install(app, api_keys, max_body_bytes)
    app.state.frontend = frontend
    app.openapi = lambda: openapi_document(app)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await serve(frontend, metrics, raw, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await serve(frontend, metrics, raw, ChatCompletionRequest)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": frontend.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "distserve", "max_model_len": frontend.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        try:
            frontend.router.check_phases()
        except Overloaded as exc:
            return error_response(str(exc), exc.status)
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
    async def timelines(limit: int = Query(100, ge=1, le=TIMELINE_HISTORY)) -> Response:
        recent = list(frontend.router.timelines)[-limit:]
        return Response(json.dumps([t.to_dict() for t in recent]), media_type="application/json")

    return app
