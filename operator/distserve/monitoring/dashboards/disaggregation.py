"""Disaggregation: where a request waits between the two phases, and why.

Per phase and instance: queue time, running and waiting requests, the decode batch, KV
usage, KV a prefill holds until a decode pulls it; the KV transfer's bytes per second,
pulls per second and p99 seconds per transport; prefill and decode tokens per second;
each instance's health as the router sees it.
"""

from __future__ import annotations

from distserve.monitoring import promql as q
from distserve.monitoring.dashboards import panels as p

UID = "distserve-disaggregation"
D, W = q.DASHBOARD, q.RATE_WINDOW
INSTANCE = "{{role}} {{instance}}"
SERVING = 'role!="router"'


def gauge_panel(title: str, description: str, unit: str, gauge: str, **labels: str):
    matchers = D if labels else f"{D}, {SERVING}"
    return p.graph(title, description, unit,
                   p.target(q.per_instance(gauge, matchers, **labels), INSTANCE))


def build():
    """The disaggregation dashboard's builder."""
    layout = p.Layout(p.new_dashboard(UID, "DistServe / Disaggregation", __doc__.split("\n")[0]))
    layout.row(
        "Queues",
        p.graph("Queue time per phase", "Seconds a request waits before its prefill, and "
                "between its prefill and the decode's pull.", "s",
                *(p.target(q.quantile(x, q.QUEUE_TIME, D, W, "phase"), f"{{{{phase}}}} p{int(x * 100)}")
                  for x in (0.5, 0.9, 0.99))),
        gauge_panel("Waiting requests", "Queued on each instance.", "none", q.WAITING),
        gauge_panel("Running requests", "In each instance's running batch.", "none", q.RUNNING))
    layout.row(
        "Batches and KV cache",
        p.graph("Decode batch", "Sequences per decode step, averaged over the interval.", "none",
                p.target(f"avg by (instance) (avg_over_time("
                         f"{q.series(q.RUNNING, D, role='decode')}[{W}]))", "{{instance}}")),
        gauge_panel("KV cache usage", "Share of each instance's KV blocks in use.", "percentunit",
                    q.KV_USAGE).max(1),
        gauge_panel("KV held for a pull", "Prefilled requests whose KV waits in the prefill "
                    "instance until a decode instance has room (the paper's back-pressure).",
                    "none", q.KV_HELD, role="prefill"))
    layout.row(
        "KV transfer",
        p.graph("KV transfer bytes/s", "KV pulled from prefill to decode, per transport.", "Bps",
                p.target(q.rate(q.KV_BYTES, D, W, "transport"), "{{transport}}")),
        p.graph("KV pulls/s", "Finished pulls per transport.", "reqps",
                p.target(q.rate(f"{q.KV_SECONDS}_count", D, W, "transport"), "{{transport}}")),
        p.graph("KV transfer p99", "Seconds of one pull, per transport.", "s",
                p.target(q.quantile(0.99, q.KV_SECONDS, D, W, "transport"), "{{transport}}")))
    layout.row(
        "Tokens and health",
        p.graph("Prefill tokens/s", "Prompt tokens prefilled (finished requests).", "none",
                p.target(q.rate(q.PROMPT_TOKENS, D, W, "deployment"), "{{deployment}}")),
        p.graph("Decode tokens/s", "Tokens generated (finished requests).", "none",
                p.target(q.rate(q.GENERATION_TOKENS, D, W, "deployment"), "{{deployment}}")),
        p.graph("Instance health", "1: serving; 0: the instance reports itself unhealthy.",
                "none", p.target(q.per_instance(q.HEALTHY, f"{D}, {SERVING}", "min"), INSTANCE)).max(1))
    return layout.builder
