"""The request and the typed objects that cross between router and instances.

These dataclasses are the contract of the serving runtime, in the spirit of vLLM v1's
`SchedulerOutput`: the router sends a `ServeRequest` to a prefill instance, which answers
with a `PrefillOutput` carrying the first token and a `KVHandle` (where the decode
instance pulls the KV from); the decode instance answers with `TokenEvent`s. Every
object turns into a plain dict (`to_dict` / `from_dict`) so the same contract travels
in-process, over HTTP between processes, and between pods.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import DetokenizerState


def now_s() -> float:
    """Wall-clock time in seconds; comparable between processes of one host."""
    return time.time()


@dataclass
class ServeRequest:
    """One generation request as the instances see it: tokens, sampling, arrival."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = field(default_factory=now_s)
    # Tokens already generated and streamed to the client: a request resumed after an
    # instance failed recomputes their KV with the prompt's and continues after them.
    resume_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens a prefill of this request computes: the prompt and the resumed tokens."""
        return len(self.prompt_token_ids) + len(self.resume_token_ids)

    def resumed_after(self, token_ids: list[int]) -> ServeRequest:
        """The same request, to continue after `token_ids` (those already streamed)."""
        return dataclasses.replace(self, resume_token_ids=list(token_ids))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able document."""
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "params": dataclasses.asdict(self.params),
            "arrival_s": self.arrival_s,
            "resume_token_ids": list(self.resume_token_ids),
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ServeRequest:
        """Rebuild from `to_dict`'s document."""
        return cls(
            request_id=doc["request_id"],
            prompt_token_ids=list(doc["prompt_token_ids"]),
            params=SamplingParams(**doc["params"]),
            arrival_s=float(doc["arrival_s"]),
            resume_token_ids=list(doc.get("resume_token_ids") or []),
        )


@dataclass
class KVHandle:
    """Where a prefilled request's KV waits until a decode instance pulls it."""

    request_id: str
    instance: str  # name of the prefill instance holding the KV
    url: str  # HTTP address of that instance ("" when only in-process)
    shm_token: str = ""  # token file in the prefill's /dev/shm arena ("" = no arena)
    num_tokens: int = 0  # tokens whose KV is held (the prompt)
    nbytes: int = 0  # bytes of K plus V

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able document."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> KVHandle:
        """Rebuild from `to_dict`'s document."""
        return cls(**doc)


@dataclass
class PrefillOutput:
    """What a prefill instance returns: the first token and where its KV waits."""

    request_id: str
    first_token_id: int
    first_text: str  # text of the first token that may be streamed (stop strings held back)
    finish_reason: str | None  # set when the request ended at its first token
    kv: KVHandle | None  # None when finished (nothing left to decode)
    detokenizer: DetokenizerState  # the decode instance continues the text from here
    queued_s: float  # when the instance accepted it
    started_s: float  # when its prefill batch started
    finished_s: float  # when the first token was ready
    instance: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able document."""
        doc = dataclasses.asdict(self)
        doc["kv"] = self.kv.to_dict() if self.kv else None
        return doc  # asdict already turned `detokenizer` into a dict

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> PrefillOutput:
        """Rebuild from `to_dict`'s document."""
        kv = doc.get("kv")
        return cls(**{**doc, "kv": KVHandle.from_dict(kv) if kv else None,
                      "detokenizer": DetokenizerState(**doc["detokenizer"])})


@dataclass
class TransferStats:
    """How one request's KV moved from its prefill to its decode instance."""

    transport: str  # "inprocess", "shm" or "tcp"
    nbytes: int
    started_s: float
    finished_s: float

    @property
    def seconds(self) -> float:
        """Duration of the pull."""
        return self.finished_s - self.started_s


@dataclass
class TokenEvent:
    """New tokens of one request, or its end (finish_reason) or its failure (error)."""

    request_id: str
    token_ids: list[int]
    time_s: float
    text: str = ""  # new text that may be streamed
    finish_reason: str | None = None  # "stop", "length", "abort"
    error: str | None = None  # set when the instance failed the request
    queued_s: float | None = None  # first event of a decode: when the instance accepted it
    started_s: float | None = None  # first event: when decoding started (KV imported)
    transfer: TransferStats | None = None  # first event of a disaggregated decode

    @property
    def is_last(self) -> bool:
        """True when no event follows."""
        return self.finish_reason is not None or self.error is not None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able document."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> TokenEvent:
        """Rebuild from `to_dict`'s document."""
        transfer = doc.get("transfer")
        return cls(**{**doc, "transfer": TransferStats(**transfer) if transfer else None})


@dataclass
class InstanceLoad:
    """What the router reads to dispatch: queue, running batch, KV usage, health."""

    instance: str
    role: str  # "prefill", "decode" or "colocated"
    num_waiting: int = 0  # accepted, not yet running (prefill queue / pending pulls)
    num_waiting_tokens: int = 0  # prompt tokens of the waiting requests
    num_running: int = 0  # in a decode batch (decode, colocated) or being prefilled
    num_held: int = 0  # prefilled, KV held until pulled (prefill only)
    kv_usage: float = 0.0  # share of KV blocks in use (or promised to pulls), in [0, 1]
    num_preemptions: int = 0  # requests preempted for lack of KV since the instance started
    is_healthy: bool = True
    error: str | None = None  # why the instance is unhealthy

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able document."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> InstanceLoad:
        """Rebuild from `to_dict`'s document."""
        return cls(**doc)
