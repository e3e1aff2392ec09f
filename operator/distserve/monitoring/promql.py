"""The series the dashboards and rules read, and the PromQL both build from them.

Names are those `distserve_engine.metrics` exports (a counter gains `_total` in the
exposition) and the operator's replan and phase series. Every engine series carries
`deployment`, `role`, `instance` and `model_name`; a Prometheus Operator scrape adds
`namespace`. The engine's `instance` label names the serving instance (`prefill-0`), so
the scrape must keep it (`honor_labels: true`; the chart's PodMonitor does).

NOTE: one SLO is one deployment: the rules aggregate by `namespace, deployment,
model_name` (GROUP). The SLI is "requests meeting both TTFT and TPOT / requests that
arrived", so a refused or failed request spends the error budget as a slow one does.
"""

from __future__ import annotations

GROUP = ("namespace", "deployment", "model_name")
GROUP_BY = ", ".join(GROUP)

# Engine series (router-side unless said otherwise).
ARRIVED = "distserve_requests_arrived_total"  # admitted or refused
FINISHED = "distserve_requests_total"  # finished without error
SLO_MET = "distserve_slo_met_requests_total"  # {slo: ttft, tpot, both}
REJECTED = "distserve_requests_rejected_total"  # {status: 429, 503}
SUCCESS = "vllm:request_success_total"  # {finished_reason: stop, length, error...}
TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:time_per_output_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
QUEUE_TIME = "distserve_queue_time_seconds"  # {phase: prefill, decode}
KV_BYTES = "distserve_kv_transfer_bytes_total"  # {transport: inprocess, shm, tcp}
KV_SECONDS = "distserve_kv_transfer_seconds"  # {transport}
SLO_TARGET = "distserve_slo_target_seconds"  # {slo: ttft, tpot}
SLO_ATTAINMENT = "distserve_slo_attainment_objective"  # spec.slo.attainment
DEFAULT_ATTAINMENT_OBJECTIVE = 0.9  # the spec's default, for a router that exports none
# Per-instance gauges (the router copies them from the loads it polls; the instance
# exports its own too, so they are read through max/min by instance, never summed raw).
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_HELD = "distserve_kv_held_requests"
HEALTHY = "distserve_instance_healthy"
# The plan served under: every process exports the one it started under, the router the
# one it serves now (a reshuffle rewrites its settings, kept instances keep theirs), so
# the queries read the router's (plan_series).
PLAN_INFO = "distserve_plan_info"  # {plan_id, prefill, decode}
PLAN_ATTAINMENT = "distserve_plan_predicted_attainment"
PLAN_GOODPUT = "distserve_plan_predicted_goodput_rps"
PLAN_GPUS = "distserve_plan_gpus"  # {plan_id, phase}
# Operator series ({namespace, deployment}): a replan decision taken or not, the phase.
REPLAN_DECISIONS = "distserve_replan_decisions_total"  # {action, reason}
DEPLOYMENT_PHASE = "distserve_deployment_phase"  # {phase} 1 for the current phase
OPERATOR_SERIES = (REPLAN_DECISIONS, DEPLOYMENT_PHASE)

# Dashboard selectors: the template variables.
DASHBOARD = 'namespace=~"$namespace", deployment=~"$deployment", model_name=~"$model"'
DASHBOARD_OPERATOR = 'namespace=~"$namespace", deployment=~"$deployment"'
RATE_WINDOW = "$__rate_interval"


def series(name: str, matchers: str = "", **labels: str) -> str:
    """`name{matchers, label="value"...}`."""
    parts = [m for m in (matchers, *(f'{k}="{v}"' for k, v in labels.items())) if m]
    return f"{name}{{{', '.join(parts)}}}" if parts else name


def plan_series(name: str, matchers: str = "") -> str:
    """A plan series as the router exports it (the plan served now)."""
    return series(name, matchers, role="router")


def rate(name: str, matchers: str, window: str, by: str = "", **labels: str) -> str:
    """`sum [by (by)] (rate(name{...}[window]))`."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({series(name, matchers, **labels)}[{window}]))"


def quantile(q: float, histogram: str, matchers: str, window: str, by: str = "") -> str:
    """The q-quantile of a histogram over `window`, per `by`."""
    keep = ", ".join(["le", *([by] if by else [])])
    return (f"histogram_quantile({q}, sum by ({keep}) "
            f"(rate({series(histogram + '_bucket', matchers)}[{window}])))")


def attainment(matchers: str, window: str, by: str = GROUP_BY) -> str:
    """Share of arrived requests that met both SLOs (refused and failed ones did not)."""
    met = rate(SLO_MET, matchers, window, by, slo="both")
    return f"clamp_max({met} / {rate(ARRIVED, matchers, window, by)}, 1)"


def attainment_objective(matchers: str, by: str = GROUP_BY) -> str:
    """Each deployment's attainment objective: the one its processes export, else the
    spec's default (for every deployment that has requests series)."""
    exported = f"max by ({by}) ({series(SLO_ATTAINMENT, matchers)})"
    default = f"{DEFAULT_ATTAINMENT_OBJECTIVE} * group by ({by}) ({series(ARRIVED, matchers)})"
    return f"{exported}\nor on ({by})\n{default}"


def goodput_rps(matchers: str, window: str, by: str = GROUP_BY) -> str:
    """Requests per second that met both SLOs."""
    return rate(SLO_MET, matchers, window, by, slo="both")


def plan_gpus(matchers: str, by: str = GROUP_BY) -> str:
    """GPUs of the plan served under (each phase counted once, not once per process)."""
    return f"sum by ({by}) (max by ({by}, phase) ({plan_series(PLAN_GPUS, matchers)}))"


def per_instance(gauge: str, matchers: str, how: str = "max", **labels: str) -> str:
    """One value per (role, instance) of a gauge both router and instance export."""
    return f"{how} by (role, instance) ({series(gauge, matchers, **labels)})"
