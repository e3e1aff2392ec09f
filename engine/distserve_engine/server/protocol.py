"""The OpenAI request schemas (pydantic, the HTTP edge) and their engine parameters.

Fields OpenAI defines are typed so a wrong type is a 400 naming the field; fields this
server does not implement are accepted only at their no-op values (`n=1`, no logprobs);
unknown fields are ignored, as OpenAI's clients send extras. `to_sampling_params`
checks what needs the prompt length (`max_tokens` against the context).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from distserve_engine.sampling import SamplingParams


class BadRequest(ValueError):
    """A client error: HTTP 400 in OpenAI's format, naming the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` is meaningful."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)  # vLLM extension
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension (benchmarks)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    logprobs: Any = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None

    @model_validator(mode="after")
    def _check_unsupported(self) -> _SamplingFields:
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 sequences")
        return self

    @property
    def include_usage(self) -> bool:
        """True when the stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        """The client's output limit (chat also reads max_completion_tokens)."""
        return self.max_tokens


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def prompt_of(self) -> str | list[int]:
        """The single prompt, as text or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise BadRequest("prompt: one prompt per request (batches are not supported)", "prompt")
            p = p[0]
        if not p:
            raise BadRequest("prompt: must not be empty", "prompt")
        if self.echo or self.suffix:
            raise BadRequest("echo and suffix are not supported", "echo" if self.echo else "suffix")
        return p


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
    max_completion_tokens: int | None = Field(default=None, ge=1)

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
    if any(not s for s in stop):
        raise BadRequest("stop: must not contain empty strings", "stop")
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=req.seed, stop=stop,
                          stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos)
