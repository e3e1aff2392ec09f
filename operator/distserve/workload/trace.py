"""Requests, and traces of them in JSON Lines: what one request asks of the system.

A trace has one request a line: {"arrival_s": float, "prompt_tokens": int,
"output_tokens": int}. Blank lines are skipped; anything else wrong stops the load
with the line number and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TRACE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")


@dataclass(frozen=True)
class Request:
    """One request: when it arrives and how many tokens it reads and writes."""

    req_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


class TraceError(ValueError):
    """A trace line that is not a valid request; the message names the line and field."""


def load_trace(path: str | Path) -> list[Request]:
    """The requests of a JSON Lines trace, in file order, numbered from 0."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise TraceError(f"{path}: cannot read the trace: {err.strerror or err}") from None
    requests: list[Request] = []
    for line_no, line in enumerate(lines, start=1):
        if line.strip():
            requests.append(_parse_line(path, line_no, line, len(requests)))
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return requests


def _parse_line(path: Path, line_no: int, line: str, req_id: int) -> Request:
    where = f"{path}:{line_no}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected an object with {', '.join(TRACE_FIELDS)}")
    for field in TRACE_FIELDS:
        if field not in record:
            raise TraceError(f"{where}: field {field!r} is missing")
    arrival_s = record["arrival_s"]
    if (
        isinstance(arrival_s, bool)
        or not isinstance(arrival_s, (int, float))
        or not math.isfinite(arrival_s)
        or arrival_s < 0
    ):
        raise TraceError(
            f"{where}: field 'arrival_s' must be a non-negative number of seconds, got {arrival_s!r}"
        )
    prompt_tokens = _count(where, record, "prompt_tokens")
    output_tokens = _count(where, record, "output_tokens")
    return Request(req_id, float(arrival_s), prompt_tokens, output_tokens)


def _count(where: str, record: dict, field: str) -> int:
    value = record[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: field {field!r} must be a positive integer, got {value!r}")
    return value
