"""The life of one request as the router saw it, and the latencies derived from it.

Timestamps are wall-clock seconds (`request.now_s`), set by whichever process saw the
moment: the router (arrival, tokens, finish), the prefill instance (queued, started,
finished), the decode instance (queued, transfer, started).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distserve_engine.request import TransferStats


@dataclass
class Timeline:
    """Arrival, prefill, transfer, decode and every token of one request."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    prefill_instance: str | None = None
    decode_instance: str | None = None
    prefill_queued_s: float | None = None
    prefill_started_s: float | None = None
    prefill_finished_s: float | None = None
    decode_queued_s: float | None = None
    decode_started_s: float | None = None
    transfer: TransferStats | None = None
    token_times_s: list[float] = field(default_factory=list)  # when each token reached the router
    finished_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_recoveries: int = 0  # times the request was resumed after an instance failed it

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated."""
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token."""
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        if len(self.token_times_s) < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (len(self.token_times_s) - 1)

    @property
    def token_gaps_s(self) -> list[float]:
        """Time between consecutive tokens."""
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def e2e_s(self) -> float | None:
        """Arrival to finish."""
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    def queue_times_s(self) -> dict[str, float]:
        """Seconds waited before each phase: prefill queue, decode (pull) queue."""
        out = {}
        if self.prefill_queued_s is not None and self.prefill_started_s is not None:
            out["prefill"] = max(0.0, self.prefill_started_s - self.prefill_queued_s)
        if self.decode_queued_s is not None:
            start_s = self.transfer.started_s if self.transfer else self.decode_started_s
            if start_s is not None:
                out["decode"] = max(0.0, start_s - self.decode_queued_s)
        return out

    def to_dict(self) -> dict:
        """A JSON-able document with the derived latencies."""
        from dataclasses import asdict

        return {**asdict(self), "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s}
