"""The OpenAI request schemas (pydantic, the HTTP edge) and their engine parameters.

Fields OpenAI defines are typed so a wrong type is a 400 naming the field; fields this
server does not implement (`UNSUPPORTED`: `best_of`, `response_format`, `tools`, ...) are
accepted only at their no-op values (`n=1`, no logprobs, no tools) and refused with a
400 naming the field otherwise, never silently ignored; unknown fields are ignored, as
OpenAI's clients send extras. `parse_body` turns raw bytes into a request (run off the
event loop: a large body takes a while to decode and validate); `to_sampling_params`
checks what needs the prompt length (`max_tokens` against the context).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from distserve_engine.sampling import SamplingParams


class BadRequest(ValueError):
    """A client error: HTTP 400 in OpenAI's format, naming the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, strict=True)]  # strict: true and false are no token ids
# Numbers and flags are strict too: "5", 5.0 or true is no max_tokens (the document says integer).
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _only(*no_op_schemas: dict[str, Any]) -> Any:
    """A field this server does not implement: any value validates (so `check_supported`
    can refuse it by name); the document lists only its no-op values."""
    return Annotated[Any, WithJsonSchema({"anyOf": [*no_op_schemas, {"type": "null"}]})]


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` is meaningful."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = Field(default=False, strict=True)


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    temperature: float = Field(default=1.0, ge=0, le=2, strict=True)
    top_p: float = Field(default=1.0, gt=0, le=1, strict=True)
    top_k: int = Field(default=-1, ge=-1, strict=True)  # vLLM extension
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, strict=True)
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=4)] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM extension
    ignore_eos: bool = Field(default=False, strict=True)  # vLLM extension (benchmarks)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, strict=True)  # one choice per request
    # Not implemented (see UNSUPPORTED): accepted at their no-op values only.
    logprobs: _only({"const": False}, {"const": 0}) = None
    top_logprobs: _only({"const": 0}) = None
    best_of: _only({"const": 1}) = None
    logit_bias: _only({"type": "object", "maxProperties": 0}) = None
    response_format: _only({"type": "object", "required": ["type"],
                            "properties": {"type": {"const": "text"}}}) = None
    tools: _only({"type": "array", "maxItems": 0}) = None
    tool_choice: _only({"const": "none"}) = None
    functions: _only({"type": "array", "maxItems": 0}) = None
    function_call: _only({"const": "none"}) = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, strict=True)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, strict=True)
    user: str | None = None

    def check_supported(self) -> None:
        """BadRequest naming the first field set to something this server does not do."""
        for name, is_no_op in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is not None and not is_no_op(value):
                raise BadRequest(f"{name}: not supported by this server (leave it unset)", name)

    @property
    def include_usage(self) -> bool:
        """True when the stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        """The client's output limit (chat also reads max_completion_tokens)."""
        return self.max_tokens


def _is(*values: Any) -> Any:
    """A no-op test: equal to one of `values` and of the same type (True is not 1)."""
    return lambda v: any(type(v) is type(x) and v == x for x in values)


# Fields accepted only at their no-op values; anything else is a 400 naming the field.
UNSUPPORTED: dict[str, Any] = {
    "logprobs": _is(False, 0), "top_logprobs": _is(0), "best_of": _is(1),
    "logit_bias": _is({}), "tools": _is([]), "functions": _is([]),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    "tool_choice": _is("none"), "function_call": _is("none"),
    "echo": _is(False), "suffix": _is(""),
}


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    # One prompt: text, token ids, or a batch of exactly one of either.
    prompt: (NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])
    echo: _only({"const": False}) = None
    suffix: _only({"const": ""}) = None

    def prompt_of(self) -> str | list[int]:
        """The single prompt, as text or token ids."""
        p = self.prompt
        return p[0] if isinstance(p, list) and isinstance(p[0], (str, list)) else p


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are served."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        """{role, content} with content parts joined."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (the newer name) wins over max_tokens."""
        return self.max_completion_tokens or self.max_tokens


def to_sampling_params(req: _SamplingFields, num_prompt_tokens: int, max_model_len: int,
                       default_max_tokens: int | None, prompt_field: str) -> SamplingParams:
    """Engine parameters; BadRequest naming the field when the lengths do not fit."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise BadRequest(f"{prompt_field}: {num_prompt_tokens} tokens leave no room for output "
                         f"in the model's context of {max_model_len} tokens", prompt_field)
    max_tokens = req.requested_max_tokens()
    field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
    if max_tokens is None:
        max_tokens = min(room, default_max_tokens or room)
    elif max_tokens > room:
        raise BadRequest(f"{field}: {max_tokens} output tokens plus the {num_prompt_tokens}-token "
                         f"prompt exceed the model's context of {max_model_len} tokens", field)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=req.seed, stop=stop,
                          stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                          presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty)


def parse_body(model: type[_SamplingFields], body: bytes) -> _SamplingFields:
    """The request in `body` (UTF-8 JSON), checked; BadRequest naming the field."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"body: not valid UTF-8 (byte {exc.start})", "body") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"body: not valid JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno})", "body") from None
    if not isinstance(doc, dict):
        raise BadRequest("body: must be a JSON object", "body")
    try:
        request = model.model_validate(doc)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    request.check_supported()
    return request


def validation_error(errors: list[Any]) -> BadRequest:
    """The BadRequest of pydantic's first error, naming the field as OpenAI does
    (`messages.0.role`, not pydantic's union member tags such as `prompt.str`)."""
    err = errors[0]
    param = param_of(err.get("loc", ()))
    message = str(err.get("msg", "invalid"))
    return BadRequest(f"{param}: {message}" if param else message, param or "body")


def param_of(loc: tuple[Any, ...]) -> str | None:
    """The field a pydantic error location points at: request field names and list
    indices, up to the first union member tag."""
    if loc and loc[0] in ("body", "query", "path"):
        loc = loc[1:]
    parts: list[str] = []
    for part in loc:
        if not (isinstance(part, int) or part in FIELD_NAMES):
            break
        parts.append(str(part))
    return ".".join(parts) or None


FIELD_NAMES = {name for m in (CompletionRequest, ChatCompletionRequest, ChatMessage,
                              ContentPart, StreamOptions) for name in m.model_fields} | {"limit"}
