"""A load generator against the OpenAI API: requests of given lengths at given times.

Each request sends `prompt_tokens` random token ids to `/v1/completions` with
`max_tokens = output_tokens` and `ignore_eos`, streams the reply, and records the time
to the first token and the mean time per output token as the client sees them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from distserve.workload import Request

TOKEN_ID_RANGE = (1000, 10000)  # ordinary tokens of any ~50k vocabulary: no special ids


@dataclass
class Outcome:
    """What the client saw of one request."""

    req_id: int
    prompt_tokens: int
    output_tokens: int  # asked for
    ttft_s: float | None = None
    tpot_s: float | None = None
    num_output_tokens: int = 0  # received
    status: int = 200
    error: str | None = None

    def meets(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        """Both SLOs met (a failed request meets none)."""
        if self.error is not None or self.ttft_s is None:
            return False
        return self.ttft_s <= ttft_slo_s and (self.tpot_s or 0.0) <= tpot_slo_s


def progress_bar(total: int, started_s: float) -> Callable[[int], None]:
    """A one-line progress bar on stderr; where stderr is no terminal (a log), a line at
    each quarter of the requests instead of a redrawn bar."""
    quarters = {total * k // 4 for k in range(1, 5)}
    is_terminal = sys.stderr.isatty()

    def show(done: int) -> None:
        if not is_terminal:
            if done in quarters:
                elapsed = time.monotonic() - started_s
                sys.stderr.write(f"  {done}/{total} requests  {elapsed:5.1f} s\n")
                sys.stderr.flush()
            return
        width = 30
        filled = width * done // max(1, total)
        elapsed = time.monotonic() - started_s
        sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests  {elapsed:5.1f} s")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


async def _one(client: httpx.AsyncClient, url: str, model: str, req: Request,
               token_ids: list[int]) -> Outcome:
    out = Outcome(req.req_id, req.prompt_tokens, req.output_tokens)
    body = {"model": model, "prompt": token_ids, "max_tokens": req.output_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent_s = time.perf_counter()
    first_s = last_s = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                out.status = response.status_code
                out.error = (await response.aread()).decode(errors="replace")[:200]
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    out.error = doc["error"]["message"]
                elif doc.get("usage"):
                    out.num_output_tokens = doc["usage"]["completion_tokens"]
                elif doc.get("choices"):
                    last_s = time.perf_counter()
                    first_s = first_s or last_s
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    if first_s is not None:
        out.ttft_s = first_s - sent_s
        if out.num_output_tokens > 1:
            out.tpot_s = (last_s - first_s) / (out.num_output_tokens - 1)
    return out


async def drive(url: str, model: str, requests: list[Request], seed: int = 0,
                show_progress: bool = True) -> list[Outcome]:
    """Send every request at its arrival time; return the outcomes in request order."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(*TOKEN_ID_RANGE, r.prompt_tokens).tolist() for r in requests]
    started_s = time.monotonic()
    show = progress_bar(len(requests), started_s) if show_progress else (lambda _: None)
    done = 0
    timeout = httpx.Timeout(600.0, connect=10.0)
    key = os.environ.get("DISTSERVE_API_KEY", "").split(",")[0].strip()  # the router's, if set
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None),
                                 headers=headers) as client:
        async def timed(req: Request, prompt: list[int]) -> Outcome:
            nonlocal done
            await asyncio.sleep(max(0.0, started_s + req.arrival_s - time.monotonic()))
            outcome = await _one(client, url, model, req, prompt)
            done += 1
            show(done)
            return outcome

        show(0)
        return list(await asyncio.gather(*(timed(r, p) for r, p in zip(requests, prompts, strict=True))))
