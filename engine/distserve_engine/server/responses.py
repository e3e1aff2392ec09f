"""OpenAI response bodies: whole responses, stream chunks, usage and errors."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

ERROR_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "invalid_request_error",
                        404: "invalid_request_error", 405: "invalid_request_error",
                        413: "invalid_request_error", 429: "rate_limit_exceeded",
                        503: "service_unavailable"}


def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """{"error": {...}} as OpenAI returns it (`type` from the status; 5xx: server_error)."""
    return {"error": {"message": message, "type": ERROR_TYPE_BY_STATUS.get(status, "server_error"),
                      "param": param, "code": code}}


def sse(doc: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {doc if isinstance(doc, str) else json.dumps(doc)}\n\n"


@dataclass
class Reply:
    """What the stream of one request adds up to, and how to render it."""

    request_id: str
    model: str
    is_chat: bool
    num_prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    num_output_tokens: int = 0
    finish_reason: str | None = None

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.is_chat else "text_completion"

    def usage(self) -> dict[str, int]:
        """Token counts."""
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_output_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_output_tokens}

    def _envelope(self, object_name: str, choices: list[dict], usage: Any = None) -> dict:
        doc = {"id": self.request_id, "object": object_name, "created": self.created,
               "model": self.model, "choices": choices}
        if usage is not None:
            doc["usage"] = usage
        return doc

    def chunk(self, text: str, finish_reason: str | None, is_first: bool = False) -> dict:
        """A stream chunk carrying new text."""
        if self.is_chat:
            delta = {"role": "assistant", "content": text} if is_first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, usage."""
        name = "chat.completion.chunk" if self.is_chat else "text_completion"
        return self._envelope(name, [], usage=self.usage())

    def whole(self) -> dict:
        """The non-streaming response."""
        if self.is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "logprobs": None, "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": self.text, "logprobs": None,
                      "finish_reason": self.finish_reason}
        return self._envelope(self.object_name, [choice], usage=self.usage())
