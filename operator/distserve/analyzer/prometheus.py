"""A client of the Prometheus HTTP API (`/api/v1/query`, `/api/v1/query_range`).

The analyzer reads Prometheus only. Whatever goes wrong there (refused connection, no
answer within the timeout, a 5xx, a body that is not Prometheus' JSON, a query error)
surfaces as one error type, `PrometheusError`, naming the URL and the cause, so the
caller turns it into "no decision" and a condition, never a crash or a hang.

# NOTE: the client speaks HTTP with the standard library (`urllib`), so the control
# plane needs no HTTP package of its own; the async methods run a call in a worker
# thread (`asyncio.to_thread`) under an overall deadline, so the operator's event loop
# never blocks on Prometheus. A call is bounded: each attempt by `timeout_s` (socket
# connect and each read), all attempts together by `deadline_s`. A connection error,
# a timeout or a 5xx is retried `retries` times with a doubling pause; a 4xx (a bad
# query) and a body that does not parse are not, since asking again would not help.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any


class PrometheusError(Exception):
    """Prometheus could not answer: down, slow, erroring or returning garbage."""


@dataclass(frozen=True)
class Sample:
    """One series of an instant query: its labels and value (NaN kept as NaN)."""

    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Series:
    """One series of a range query: its labels and (unix time s, value) points."""

    labels: dict[str, str]
    points: tuple[tuple[float, float], ...]


class _Retryable(Exception):
    """A failure worth another attempt (connection, timeout, 5xx)."""


class PrometheusClient:
    """Instant and range queries against one Prometheus server."""

    def __init__(self, url: str, timeout_s: float = 5.0, retries: int = 2,
                 backoff_s: float = 0.5, deadline_s: float | None = None) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"prometheus url: expected http(s)://host[:port][/prefix], got {url!r}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"prometheus client: timeout_s > 0, retries >= 0 and backoff_s >= 0 "
                             f"needed, got {timeout_s}, {retries}, {backoff_s}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        pauses_s = sum(backoff_s * 2**i for i in range(retries))
        self.deadline_s = deadline_s or (retries + 1) * timeout_s + pauses_s + 1.0

    def query(self, promql: str, time_s: float | None = None) -> list[Sample]:
        """An instant query at `time_s` (now when None): one Sample per series (a scalar is
        one Sample without labels)."""
        params = {"query": promql}
        if time_s is not None:
            params["time"] = f"{time_s:.3f}"
        data = self._get("/api/v1/query", params)
        kind, result = data.get("resultType"), data.get("result")
        try:
            if kind == "vector":
                return [Sample(dict(r["metric"]), float(r["value"][1])) for r in result]
            if kind == "scalar":
                return [Sample({}, float(result[1]))]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PrometheusError(f"{self.url}: malformed {kind} result for {promql!r}: {exc}") from None
        raise PrometheusError(f"{self.url}: expected a vector or scalar for {promql!r}, got {kind!r}")

    def query_range(self, promql: str, start_s: float, end_s: float, step_s: float) -> list[Series]:
        """A range query: one Series per series, points every `step_s` from `start_s` to `end_s`."""
        if not (step_s > 0 and end_s >= start_s):
            raise ValueError(f"query_range: need step_s > 0 and end_s >= start_s, got "
                             f"step_s={step_s}, start_s={start_s}, end_s={end_s}")
        params = {"query": promql, "start": f"{start_s:.3f}", "end": f"{end_s:.3f}",
                  "step": f"{step_s:g}"}
        data = self._get("/api/v1/query_range", params)
        if data.get("resultType") != "matrix":
            raise PrometheusError(f"{self.url}: expected a matrix for {promql!r}, "
                                  f"got {data.get('resultType')!r}")
        try:
            return [Series(dict(r["metric"]), tuple((float(t), float(v)) for t, v in r["values"]))
                    for r in data["result"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise PrometheusError(f"{self.url}: malformed matrix for {promql!r}: {exc}") from None

    async def aquery(self, promql: str, time_s: float | None = None) -> list[Sample]:
        """`query` off the event loop, within the deadline."""
        return await self._off_loop(self.query, promql, time_s)

    async def aquery_range(self, promql: str, start_s: float, end_s: float,
                           step_s: float) -> list[Series]:
        """`query_range` off the event loop, within the deadline."""
        return await self._off_loop(self.query_range, promql, start_s, end_s, step_s)

    async def _off_loop(self, call, *args) -> Any:
        try:
            return await asyncio.wait_for(asyncio.to_thread(call, *args), self.deadline_s)
        except asyncio.TimeoutError:
            raise PrometheusError(f"{self.url}: no answer within {self.deadline_s:.1f} s") from None

    def _get(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        """The `data` of a successful answer, after bounded retries."""
        started_s = time.monotonic()
        last = ""
        for attempt in range(self.retries + 1):
            try:
                return self._get_once(path, params)
            except _Retryable as exc:
                last = str(exc)
            pause_s = self.backoff_s * 2**attempt
            if attempt == self.retries or time.monotonic() - started_s + pause_s > self.deadline_s:
                break
            time.sleep(pause_s)
        raise PrometheusError(f"{self.url}: {last} (after {attempt + 1} attempts)")

    def _get_once(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code >= 500:
                raise _Retryable(f"HTTP {exc.code}") from None
            body = exc.read()  # Prometheus explains a bad query (400, 422) in its JSON body
            raise PrometheusError(f"{self.url}: HTTP {exc.code}: {_error_of(body)}") from None
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            reason = getattr(exc, "reason", exc)
            raise _Retryable(f"unreachable ({reason or type(exc).__name__})") from None
        except http.client.HTTPException as exc:  # not HTTP, or cut short
            raise _Retryable(f"broken HTTP answer ({type(exc).__name__}: {exc})") from None
        return _data_of(self.url, body)


def _error_of(body: bytes) -> str:
    try:
        doc = json.loads(body)
        return f"{doc.get('errorType')}: {doc.get('error')}"
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


def _data_of(url: str, body: bytes) -> dict[str, Any]:
    """The `data` of Prometheus' `{"status": "success", "data": ...}` envelope."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise PrometheusError(f"{url}: the answer is not JSON: {body[:80]!r}") from None
    if not isinstance(doc, dict) or doc.get("status") != "success" or not isinstance(doc.get("data"), dict):
        raise PrometheusError(f"{url}: not a successful Prometheus answer: {str(doc)[:200]}")
    return doc["data"]


def finite_or_none(value: float | None) -> float | None:
    """A value, or None when missing or NaN/inf (Prometheus' answer to 0/0)."""
    return value if value is not None and math.isfinite(value) else None
