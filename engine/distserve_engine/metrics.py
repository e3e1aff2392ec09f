"""Prometheus metrics: vLLM's names where the meaning is the same, `distserve_` for the rest.

Every series carries `deployment`, `role` (`router`, `prefill`, `decode`, `colocated`)
and `instance` labels (and `model_name`, as vLLM does). The router observes per-request
latencies from each request's timeline and copies every instance's queue and KV gauges
from the loads it polls, so one scrape of the router shows the whole deployment; each
instance server also exposes its own gauges. The analyzer, dashboards and alerts read
only these names.

What the workload analyzer (`distserve.analyzer`) reads from the router:
- `distserve_requests_arrived_total`: every request admitted to or refused by the
  router (counted before admission), so the arrival rate includes overload;
- `vllm:request_prompt_tokens` and `vllm:request_generation_tokens`: lengths of the
  requests that finished without error, in `length_buckets_tokens(max_model_len)`: ten
  buckets per decade (the rounded R10 series 1, 1.25, 1.6, 2, 2.5, 3.15, 4, 5, 6.3, 8
  times a power of ten) up to the model's context length. vLLM uses 1-2-5 (three per
  decade); a bucket here spans at most 25% of its bound, which keeps the lengths
  resampled from a fit to the binned counts within a few percent in mean and p90;
- `distserve_request_generation_tokens_by_prompt{prompt_le}`: the generated length
  again, labelled by the prompt's class (`joint_buckets_tokens`: 1-2-5 bounds from 20
  tokens to the context length, both for the class and for the buckets). The two
  histograms above say how long prompts and outputs are, not which prompt had which
  output; in a mix of workloads that matters: summaries (long prompts) also generate
  3-4 times longer than code completions, and a decode instance's KV cache holds
  both for as long as the output runs. With the outputs paired at random, five minutes
  of the replanning benchmark's code -> summarization ramp meet the SLOs for 91.6% of
  requests on the morning's plan; as they came, for 46.8%;
- `distserve_plan_info{plan_id, prefill, decode} 1` and the plan's predicted attainment
  and goodput (`distserve_plan_predicted_*`), from the settings' `plan`, so a dashboard
  puts prediction beside observation; `distserve_plan_gpus{phase}` (tp x pp x instances
  of the phase's shape), the denominator of goodput per GPU;
- `distserve_slo_target_seconds{slo}`: the TTFT and TPOT objectives the router counts
  `distserve_slo_met_requests_total` against, drawn as the SLO line beside the percentiles.
- `distserve_slo_attainment_objective`: the share of requests that must meet both
  (the spec's `slo.attainment`), when the settings give it; the burn-rate alerts measure
  each deployment's error budget against it.
"""

from __future__ import annotations

import re
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from distserve_engine.request import InstanceLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("deployment", "role", "instance", "model_name")
# Buckets of vLLM's own histograms (seconds).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
R10_MANTISSAS = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)
DEFAULT_MAX_LENGTH_TOKENS = 131072  # bucket range when the context length is not set
JOINT_MIN_TOKENS = 20  # the joint histogram's first bound
FINISHED_REASONS = ("stop", "length", "abort", "error")  # vLLM's, less `repetition`
TRANSFER_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1.0, 2.5, 5.0)
SHAPE_PATTERN = re.compile(r"tp(\d+)pp(\d+)x(\d+)")  # a phase's shape in the plan settings


def shape_num_gpus(shape: str) -> int | None:
    """GPUs of a phase shape `tp<TP>pp<PP>x<instances>`, or of a mixed plan's groups joined
    by `+` (`tp2pp1x1+tp1pp2x1`); None when it is not one."""
    total = 0
    for group in shape.split("+"):
        match = SHAPE_PATTERN.fullmatch(group)
        if match is None:
            return None
        tp, pp, num_instances = (int(g) for g in match.groups())
        total += tp * pp * num_instances
    return total


def joint_buckets_tokens(max_model_len: int | None = None) -> tuple[int, ...]:
    """Prompt classes and generated-length buckets of the joint histogram: the 1-2-5 bounds
    of `length_buckets_tokens` from `JOINT_MIN_TOKENS` on, and its last (the context
    length). They are bounds of the fine buckets too, so a fit to the fine histogram
    holds whole buckets inside each class."""
    fine = length_buckets_tokens(max_model_len)
    return tuple(b for b in fine if b == fine[-1] or (
        b >= JOINT_MIN_TOKENS and b / 10 ** (len(str(b)) - 1) in (1, 2, 5)))


def prompt_class(num_tokens: int, bounds: tuple[int, ...]) -> str:
    """The `prompt_le` label of a prompt length: its class's upper bound, `+Inf` past the last."""
    for bound in bounds:
        if num_tokens <= bound:
            return str(bound)
    return "+Inf"


def length_buckets_tokens(max_model_len: int | None = None) -> tuple[int, ...]:
    """Token-count bucket bounds: the R10 series rounded to integers, up to `max_model_len`."""
    top = max_model_len or DEFAULT_MAX_LENGTH_TOKENS
    if top < 1:
        raise ValueError(f"max_model_len: must be >= 1, got {top}")
    bounds = {top}
    scale = 1
    while scale <= top:
        bounds.update(int(m * scale + 0.5) for m in R10_MANTISSAS if m * scale <= top)
        scale *= 10
    return tuple(sorted(bounds))


class ServingMetrics:
    """The series of one process (router or instance), in its own registry."""

    def __init__(self, deployment: str, role: str, instance: str, model_name: str,
                 max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"deployment": deployment, "role": role, "instance": instance,
                       "model_name": model_name}
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              LABELS, buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two tokens.",
                             LABELS, buckets=TPOT_BUCKETS_S, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              LABELS, buckets=TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             LABELS, buckets=E2E_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", LABELS, registry=r)
        # NOTE: as in vLLM, every ended request is counted here, by why it ended: failed
        # (`error`) and aborted (`abort`: the client left) ones too; a success rate is
        # the stop and length series over all of them.
        self.success = Counter("vllm:request_success", "Ended requests by finished_reason "
                               "(stop, length, abort, error).",
                               (*LABELS, "finished_reason"), registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in a running batch.", LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued on an instance.", LABELS, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", LABELS, registry=r)
        # NOTE: instances count preemptions in their load; the counter grows by the
        # difference between two polls (a restarted instance counts from 0 again).
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted for lack of "
                                   "KV blocks (recomputed later).", LABELS, registry=r)
        self._instance_to_preemptions: dict[str, int] = {}
        self.held = Gauge("distserve_kv_held_requests",
                          "Prefilled requests whose KV waits for a decode pull.", LABELS, registry=r)
        self.healthy = Gauge("distserve_instance_healthy", "1 when the instance serves.", LABELS, registry=r)
        self.queue_time = Histogram("distserve_queue_time_seconds", "Time queued before a phase.",
                                    (*LABELS, "phase"), buckets=TTFT_BUCKETS_S, registry=r)
        self.transfer_bytes = Counter("distserve_kv_transfer_bytes", "KV bytes pulled.",
                                      (*LABELS, "transport"), registry=r)
        self.transfer_s = Histogram("distserve_kv_transfer_seconds", "Duration of one KV pull.",
                                    (*LABELS, "transport"), buckets=TRANSFER_BUCKETS_S, registry=r)
        self.requests = Counter("distserve_requests", "Finished requests (SLO denominator).",
                                LABELS, registry=r)
        self.slo_met = Counter("distserve_slo_met_requests", "Finished requests meeting an SLO.",
                               (*LABELS, "slo"), registry=r)
        self.rejected = Counter("distserve_requests_rejected", "Requests refused by overload.",
                                (*LABELS, "status"), registry=r)
        self.arrived = Counter("distserve_requests_arrived", "Requests that reached admission "
                               "(refused ones included).", LABELS, registry=r)
        length_buckets = length_buckets_tokens(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt length of finished requests (tokens).",
            LABELS, buckets=length_buckets, registry=r)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated length of finished requests (tokens).",
            LABELS, buckets=length_buckets, registry=r)
        self.joint_bounds = joint_buckets_tokens(max_model_len)
        self.generation_by_prompt = Histogram(
            "distserve_request_generation_tokens_by_prompt",
            "Generated length of finished requests (tokens), by the prompt's class (prompt_le).",
            (*LABELS, "prompt_le"), buckets=self.joint_bounds, registry=r)
        self.plan_info = Gauge("distserve_plan_info", "The plan served under (always 1).",
                               (*LABELS, "plan_id", "prefill", "decode"), registry=r)
        self.plan_attainment = Gauge("distserve_plan_predicted_attainment",
                                     "SLO attainment the planner predicted at its goodput.",
                                     (*LABELS, "plan_id"), registry=r)
        self.plan_goodput = Gauge("distserve_plan_predicted_goodput_rps",
                                  "Goodput the planner predicted (requests/s).",
                                  (*LABELS, "plan_id"), registry=r)
        self.plan_gpus = Gauge("distserve_plan_gpus", "GPUs of one phase in the plan.",
                               (*LABELS, "plan_id", "phase"), registry=r)
        self.slo_target = Gauge("distserve_slo_target_seconds", "The latency objective.",
                                (*LABELS, "slo"), registry=r)
        self.slo_attainment = Gauge("distserve_slo_attainment_objective",
                                    "Share of requests that must meet both SLOs.", LABELS, registry=r)
        self._start_series()

    def _start_series(self) -> None:
        """Create the counters' series at 0, so that a rate over a window counts the first
        increments too (a series born with a value hides them from `increase()`)."""
        labels = self._l()
        for metric in (self.arrived, self.requests, self.request_prompt_tokens,
                       self.request_generation_tokens):
            metric.labels(**labels)
        for bound in (*self.joint_bounds, "+Inf"):
            self.generation_by_prompt.labels(**labels, prompt_le=str(bound))
        for slo in ("ttft", "tpot", "both"):
            self.slo_met.labels(**labels, slo=slo)
        for status in ("429", "503"):
            self.rejected.labels(**labels, status=status)
        for reason in FINISHED_REASONS:
            self.success.labels(**labels, finished_reason=reason)

    def set_plan(self, plan_id: str | None, prefill: str = "", decode: str = "",
                 predicted_attainment: float | None = None,
                 predicted_goodput_rps: float | None = None) -> None:
        """Export the plan served under (replacing the previous one's series)."""
        for gauge in (self.plan_info, self.plan_attainment, self.plan_goodput, self.plan_gpus):
            gauge.clear()
        if plan_id is None:
            return
        labels = self._l()
        self.plan_info.labels(**labels, plan_id=plan_id, prefill=prefill, decode=decode).set(1)
        if predicted_attainment is not None:
            self.plan_attainment.labels(**labels, plan_id=plan_id).set(predicted_attainment)
        if predicted_goodput_rps is not None:
            self.plan_goodput.labels(**labels, plan_id=plan_id).set(predicted_goodput_rps)
        for phase, shape in (("prefill", prefill), ("decode", decode)):
            num_gpus = shape_num_gpus(shape)
            if num_gpus is not None:
                self.plan_gpus.labels(**labels, plan_id=plan_id, phase=phase).set(num_gpus)

    def set_slo(self, ttft_slo_s: float | None, tpot_slo_s: float | None,
                attainment: float | None = None) -> None:
        """Export the latency objectives and the attainment objective (one not set has no
        series)."""
        self.slo_target.clear()
        for slo, seconds in (("ttft", ttft_slo_s), ("tpot", tpot_slo_s)):
            if seconds is not None:
                self.slo_target.labels(**self._l(), slo=slo).set(seconds)
        self.slo_attainment.clear()
        if attainment is not None:
            self.slo_attainment.labels(**self._l()).set(attainment)

    def observe_arrival(self) -> None:
        """Count one request reaching admission (before it may be refused)."""
        self.arrived.labels(**self._l()).inc()

    def _l(self, **extra: str) -> dict[str, str]:
        return {**self.labels, **extra}

    def observe_request(self, timeline: Any, ttft_slo_s: float | None, tpot_slo_s: float | None) -> None:
        """Record one finished request from its timeline (router side)."""
        labels = self._l()
        self.prompt_tokens.labels(**labels).inc(timeline.num_prompt_tokens)
        self.generation_tokens.labels(**labels).inc(timeline.num_output_tokens)
        self.success.labels(**labels, finished_reason=timeline.finish_reason or "error").inc()
        if timeline.error is not None:
            return
        self.request_prompt_tokens.labels(**labels).observe(timeline.num_prompt_tokens)
        self.request_generation_tokens.labels(**labels).observe(timeline.num_output_tokens)
        self.generation_by_prompt.labels(
            **labels, prompt_le=prompt_class(timeline.num_prompt_tokens, self.joint_bounds)
        ).observe(timeline.num_output_tokens)
        if timeline.ttft_s is None:
            return
        self.ttft.labels(**labels).observe(timeline.ttft_s)
        self.e2e.labels(**labels).observe(timeline.e2e_s)
        for gap_s in timeline.token_gaps_s:
            self.itl.labels(**labels).observe(gap_s)
        if timeline.tpot_s is not None:
            self.tpot.labels(**labels).observe(timeline.tpot_s)
        for phase, seconds in timeline.queue_times_s().items():
            self.queue_time.labels(**labels, phase=phase).observe(seconds)
        if timeline.transfer is not None:
            t = timeline.transfer
            self.transfer_bytes.labels(**labels, transport=t.transport).inc(t.nbytes)
            self.transfer_s.labels(**labels, transport=t.transport).observe(t.seconds)
        self._observe_slo(timeline, ttft_slo_s, tpot_slo_s)

    def _observe_slo(self, timeline: Any, ttft_slo_s: float | None, tpot_slo_s: float | None) -> None:
        labels = self._l()
        self.requests.labels(**labels).inc()
        is_ttft_met = ttft_slo_s is None or timeline.ttft_s <= ttft_slo_s
        is_tpot_met = tpot_slo_s is None or (timeline.tpot_s or 0.0) <= tpot_slo_s
        if is_ttft_met:
            self.slo_met.labels(**labels, slo="ttft").inc()
        if is_tpot_met:
            self.slo_met.labels(**labels, slo="tpot").inc()
        if is_ttft_met and is_tpot_met:
            self.slo_met.labels(**labels, slo="both").inc()

    def set_load(self, load: InstanceLoad) -> None:
        """Copy one instance's queue and KV gauges (labelled with that instance)."""
        labels = {**self.labels, "role": load.role, "instance": load.instance}
        self.running.labels(**labels).set(load.num_running)
        self.waiting.labels(**labels).set(load.num_waiting)
        self.kv_usage.labels(**labels).set(load.kv_usage)
        self.held.labels(**labels).set(load.num_held)
        self.healthy.labels(**labels).set(1.0 if load.is_healthy else 0.0)
        if load.role in ("decode", "colocated"):
            last = self._instance_to_preemptions.get(load.instance, 0)
            increase = load.num_preemptions - last if load.num_preemptions >= last else load.num_preemptions
            self.preemptions.labels(**labels).inc(increase)
            self._instance_to_preemptions[load.instance] = load.num_preemptions

    def set_unreachable(self, role: str, instance: str) -> None:
        """An instance that does not answer: unhealthy, running and holding nothing."""
        labels = {**self.labels, "role": role, "instance": instance}
        for gauge in (self.running, self.waiting, self.kv_usage, self.held, self.healthy):
            gauge.labels(**labels).set(0.0)

    def forget_instance(self, role: str, instance: str) -> None:
        """Drop the gauges of an instance the router no longer has (drained and removed)."""
        labels = {**self.labels, "role": role, "instance": instance}
        for gauge in (self.running, self.waiting, self.kv_usage, self.held, self.healthy):
            try:
                gauge.remove(*(labels[name] for name in LABELS))
            except KeyError:  # never polled
                pass

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
