"""Whether the router takes a request now, decided at once and atomically.

A request is admitted by `AdmissionControl.admit`, which checks and counts in one step
(no await in between), so a burst cannot slip past a limit that is counted later. Three
bounds, each a 429:
- waiting: admitted requests whose first token is not out yet (`max_waiting_requests`);
- in flight: admitted and not finished (`max_inflight_requests`), which bounds what the
  decode queues and the prefill instances' held KV can grow to;
- optionally the predicted TTFT (`admit_by_ttft`): when the queue ahead of the request
  cannot be cleared within the TTFT SLO, the request is refused now rather than served
  late (DistServe's goodput counts only requests that meet their SLO, so a request that
  would miss it only slows the ones behind it). `Retry-After` says when the queue ahead
  will have drained enough.

The TTFT model is fitted online from what the router observes: for each request, the
prompt tokens ahead of it (those of every admitted request still waiting for its first
token, shared over the prefill instances, plus its own: requests admitted and not yet
dispatched count too, so a burst sees itself) and the TTFT it got; a least-squares line `ttft = a + b * tokens` over the
last `TTFT_WINDOW` requests. Until `MIN_TTFT_SAMPLES` requests have been seen nothing
is refused on this ground.

The simulator admits by this very class (`distserve.simulator.results.Recorder`), so it
stays pure Python, importing nothing beyond the standard library.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

MIN_TTFT_SAMPLES = 16  # requests observed before predictions are trusted
TTFT_WINDOW = 512  # most recent (tokens ahead, TTFT) pairs the line is fitted to
MAX_RETRY_AFTER_S = 60


class Overloaded(Exception):
    """The request is refused now: 429 with Retry-After, or 503 (no instance of a phase,
    and no honest time to tell: the instance may come back in a second or never)."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass
class Ticket:
    """One admitted request's place in the counts; released once, whatever happens."""

    control: AdmissionControl
    num_tokens: int  # its prompt tokens
    tokens_ahead: int  # prompt tokens ahead of it at admission, its own included
    is_waiting: bool = True  # counted in num_waiting until its first token
    is_released: bool = False

    def first_token(self, ttft_s: float | None) -> None:
        """The first token is out (or the request ended before it): stop counting it as
        waiting; a TTFT feeds the model."""
        if not self.is_waiting:
            return
        self.is_waiting = False
        self.control.num_waiting -= 1
        self.control.waiting_tokens -= self.num_tokens
        if ttft_s is not None:
            self.control.ttft_model.observe(self.tokens_ahead, ttft_s)

    def release(self) -> None:
        """The request is finished (or never started): give its places back."""
        if self.is_released:
            return
        self.first_token(None)
        self.is_released = True
        self.control.num_inflight -= 1


@dataclass
class TTFTModel:
    """TTFT as a line in the prompt tokens queued ahead, fitted online.

    The window's sums are kept as samples come and go, so a prediction (one per request
    the router sees, and per arrival the simulator replays) costs the same whatever the
    window holds: the tokens' exactly (integers), the seconds' refreshed from the window
    itself every TTFT_WINDOW samples, so rounding cannot pile up."""

    samples: deque = field(default_factory=lambda: deque(maxlen=TTFT_WINDOW))
    _sum_x: int = 0
    _sum_xx: int = 0
    _sum_y: float = 0.0
    _sum_xy: float = 0.0
    _until_refresh: int = TTFT_WINDOW

    def observe(self, tokens_ahead: int, ttft_s: float) -> None:
        """Add one request's (tokens ahead, TTFT)."""
        if len(self.samples) == self.samples.maxlen:
            x, y = self.samples[0]
            self._sum_x -= x
            self._sum_xx -= x * x
            self._sum_y -= y
            self._sum_xy -= x * y
        x = int(tokens_ahead)
        self.samples.append((x, ttft_s))
        self._sum_x += x
        self._sum_xx += x * x
        self._sum_y += ttft_s
        self._sum_xy += x * ttft_s
        self._until_refresh -= 1
        if self._until_refresh <= 0:
            self._sum_y = math.fsum(y for _, y in self.samples)
            self._sum_xy = math.fsum(x * y for x, y in self.samples)
            self._until_refresh = TTFT_WINDOW

    def line(self) -> tuple[float, float] | None:
        """(seconds at no queue, seconds per queued token), or None before enough samples:
        the least-squares line over the window."""
        n = len(self.samples)
        if n < MIN_TTFT_SAMPLES:
            return None
        mean_x = self._sum_x / n
        mean_y = self._sum_y / n
        spread_x = n * self._sum_xx - self._sum_x * self._sum_x  # n^2 var(x), exact
        slope_s = (max((n * self._sum_xy - self._sum_x * self._sum_y) / spread_x, 0.0)
                   if spread_x > 0 else 0.0)
        if slope_s == 0.0:  # no spread in the queue yet: time per token from the means
            slope_s = mean_y / mean_x if mean_x > 0 else 0.0
            return 0.0, slope_s
        return max(mean_y - slope_s * mean_x, 0.0), slope_s

    def predict_s(self, tokens_ahead: int) -> float | None:
        """Predicted TTFT of a request with `tokens_ahead` tokens queued before its first
        token, or None while the model knows too little."""
        line = self.line()
        return None if line is None else line[0] + line[1] * tokens_ahead


class AdmissionControl:
    """The router's counts and limits; `admit` is the only way in."""

    def __init__(self, max_waiting_requests: int, max_inflight_requests: int | None = None,
                 ttft_slo_s: float | None = None, admit_by_ttft: bool = False) -> None:
        if admit_by_ttft and ttft_slo_s is None:
            raise ValueError("admit_by_ttft: needs a TTFT SLO (slo.ttft_s)")
        self.max_waiting_requests = max_waiting_requests
        self.max_inflight_requests = max_inflight_requests
        self.ttft_slo_s = ttft_slo_s
        self.admit_by_ttft = admit_by_ttft
        self.num_waiting = 0
        self.waiting_tokens = 0  # prompt tokens of the waiting requests
        self.num_inflight = 0
        self.ttft_model = TTFTModel()

    def admit(self, num_tokens: int, num_prefill_instances: int = 1) -> Ticket:
        """Count in a request of `num_tokens` prompt tokens, or raise Overloaded (429);
        never awaits."""
        tokens_ahead = -(-self.waiting_tokens // max(num_prefill_instances, 1)) + num_tokens
        if self.num_waiting >= self.max_waiting_requests:
            raise Overloaded(429, f"{self.num_waiting} requests already wait for their first "
                               f"token (limit {self.max_waiting_requests}); retry later",
                          self._retry_after_s(tokens_ahead))
        limit = self.max_inflight_requests
        if limit is not None and self.num_inflight >= limit:
            raise Overloaded(429, f"{self.num_inflight} requests in flight (limit {limit}); "
                               "retry later", self._retry_after_s(tokens_ahead))
        if self.admit_by_ttft:
            predicted_s = self.ttft_model.predict_s(tokens_ahead)
            if predicted_s is not None and predicted_s > self.ttft_slo_s:
                raise Overloaded(429, f"the queue ahead would delay the first token to about "
                                   f"{predicted_s:.1f} s, past the TTFT SLO of "
                                   f"{self.ttft_slo_s:g} s; retry later",
                              self._retry_after_s(tokens_ahead))
        self.num_waiting += 1
        self.waiting_tokens += num_tokens
        self.num_inflight += 1
        return Ticket(self, num_tokens, tokens_ahead)

    def _retry_after_s(self, tokens_ahead: int) -> int:
        """Seconds until the queue ahead has drained enough to meet the TTFT SLO (1 when
        the model cannot tell yet)."""
        line = self.ttft_model.line()
        if line is None:
            return 1
        budget_s = self.ttft_slo_s if self.ttft_slo_s is not None else line[0]
        excess_s = line[0] + line[1] * tokens_ahead - budget_s
        return int(min(max(math.ceil(excess_s), 1), MAX_RETRY_AFTER_S))
