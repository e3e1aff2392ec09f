"""What a request meets before an endpoint: the API key, the body size limit, and
OpenAI-format errors for everything the framework itself would answer.

- API keys (optional): with keys set, `/v1/*` and `/debug/*` need `Authorization:
  Bearer KEY` (401 in OpenAI's format otherwise, the key never echoed); `/health`,
  `/livez` and `/metrics` stay open for probes and Prometheus.
- Body limit: a body over `max_body_bytes` is refused with 413 before it is read (by its
  Content-Length) or as soon as it passes the limit (chunked), so a huge prompt costs
  neither memory nor the event loop's time.
- Errors: an unknown path (404), a wrong method (405, with `Allow`), a bad query
  parameter (400 naming it) and any unexpected exception (500, logged with its
  traceback; the client gets no internal detail) all answer `{"error": {...}}`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from distserve_engine.server.protocol import validation_error
from distserve_engine.server.responses import error_body

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # a 128k-token prompt is about half of it
PROTECTED_PREFIXES = ("/v1/", "/debug/")


def error_response(message: str, status: int, param: str | None = None,
                   retry_after_s: int | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-format error, with Retry-After when given."""
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return JSONResponse(error_body(message, status, param, code), status_code=status,
                        headers=headers or None)


class BodyTooLarge(Exception):
    """The request body passed the limit while it was being read."""


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_body_bytes`."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._refuse(scope, receive, send)
            return
        num_bytes = 0

        async def limited() -> Message:
            nonlocal num_bytes
            message = await receive()
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_body_bytes:
                raise BodyTooLarge
            return message

        await self.app(scope, limited, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = too_large_response(self.max_body_bytes)
        await response(scope, receive, send)


def too_large_response(max_body_bytes: int) -> JSONResponse:
    """413 naming the limit."""
    return error_response(f"body: larger than this server's limit of {max_body_bytes} bytes",
                          413, "body", code="request_too_large", headers={"Connection": "close"})


class ApiKeyGuard:
    """ASGI middleware: 401 on the protected paths without one of `api_keys`."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = auth.partition(b" ")
            is_known = scheme.lower() == b"bearer" and any(
                hmac.compare_digest(key.strip(), k) for k in self.api_keys)
            if not is_known:
                message = ("Incorrect API key provided." if auth else
                           "You didn't provide an API key: send `Authorization: Bearer KEY`.")
                response = error_response(message, 401, code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install(app: FastAPI, api_keys: Sequence[str] = (),
            max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Add the guards and the OpenAI-format error handlers to `app`."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be >= 1, got {max_body_bytes}")
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    keys = [k for k in api_keys if k]
    if keys:
        app.add_middleware(ApiKeyGuard, api_keys=keys)  # added last: runs first

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        bad = validation_error(list(exc.errors()))
        return error_response(str(bad), 400, bad.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(message, exc.status_code, headers=exc.headers)

    @app.exception_handler(BodyTooLarge)
    async def too_large(_request: Request, _exc: BodyTooLarge) -> JSONResponse:
        return too_large_response(max_body_bytes)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response("The server had an error while processing the request.", 500)


def api_keys_from(value: str | None) -> list[str]:
    """Keys from a comma-separated value (`--api-key`, DISTSERVE_API_KEY): several allow
    a rotation without downtime."""
    return [k.strip() for k in (value or "").split(",") if k.strip()]

