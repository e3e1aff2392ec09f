"""The SLO overview: is the deployment serving within its SLOs, as the plan predicted?

TTFT and TPOT percentiles beside the objective each router counts against (drawn as a
dashed SLO line); attainment observed beside the plan's prediction and the objective;
goodput per GPU observed beside predicted; the request rate, errors and refusals.
"""

from __future__ import annotations

from distserve.monitoring import promql as q
from distserve.monitoring.dashboards import panels as p

UID = "distserve-slo"
D, W = q.DASHBOARD, q.RATE_WINDOW
BY = "namespace, deployment"


def latency_panel(title: str, histogram: str, slo: str) -> object:
    targets = [p.target(q.quantile(quantile, histogram, D, W), f"p{int(quantile * 100)}")
               for quantile in (0.5, 0.9, 0.99)]
    objective = p.target(f"max({q.series(q.SLO_TARGET, D, slo=slo)})", "SLO")
    panel = p.graph(title, f"Percentiles over finished requests; the dashed line is the "
                    f"{slo.upper()} objective the router counts against.", "s", *targets, objective)
    return p.dashed(panel, "^SLO$")


def attainment_panel() -> object:
    observed = p.target(q.attainment(D, W, BY), "observed {{deployment}}")
    predicted = p.target(f"max by ({BY}) ({q.plan_series(q.PLAN_ATTAINMENT, D)})",
                         "predicted {{deployment}}")
    objective = p.target(q.attainment_objective(D, BY), "objective {{deployment}}")
    panel = p.graph("SLO attainment: observed vs predicted",
                    "Share of arrived requests meeting both TTFT and TPOT (refused and failed "
                    "ones count as misses), beside the planner's prediction at its goodput and "
                    "the deployment's objective (spec.slo.attainment, 90% where the router "
                    "exports none), which the alerts burn the error budget against.",
                    "percentunit", observed, predicted, objective).max(1)
    return p.dashed(p.dashed(panel, "^predicted", "blue"), "^objective", "red")


def goodput_panel() -> object:
    observed = p.target(f"{q.goodput_rps(D, W, BY)} / {q.plan_gpus(D, BY)}", "observed {{deployment}}")
    predicted = p.target(f"max by ({BY}) ({q.plan_series(q.PLAN_GOODPUT, D)}) / {q.plan_gpus(D, BY)}",
                         "predicted {{deployment}}")
    return p.graph("Goodput per GPU", "Requests per second meeting both SLOs, divided by the "
                   "plan's GPUs; predicted: the plan's goodput at the attainment target.",
                   "reqps", observed, predicted)


def build():
    """The SLO overview dashboard's builder."""
    layout = p.Layout(p.new_dashboard(UID, "DistServe / SLO overview", __doc__.split("\n")[0]))
    layout.row(
        "Now",
        p.single("Attainment, 5m", "Observed over the last 5 minutes.", "percentunit",
                 p.target(q.attainment(D, "5m", BY), "{{deployment}}")),
        p.single("Attainment, predicted", "The plan's prediction.", "percentunit",
                 p.target(f"max by ({BY}) ({q.plan_series(q.PLAN_ATTAINMENT, D)})", "{{deployment}}")),
        p.single("Goodput per GPU, 5m", "Observed over the last 5 minutes.", "reqps",
                 p.target(f"{q.goodput_rps(D, '5m', BY)} / {q.plan_gpus(D, BY)}", "{{deployment}}")),
        p.single("GPUs in the plan", "Of both phases, in the plan served under.", "none",
                 p.target(q.plan_gpus(D, BY), "{{deployment}}")),
        height=4)
    layout.row("SLO attainment and goodput", attainment_panel(), goodput_panel())
    layout.row("Latency", latency_panel("Time to first token", q.TTFT, "ttft"),
               latency_panel("Time per output token", q.TPOT, "tpot"))
    layout.row(
        "Traffic",
        p.graph("Requests", "Arrivals (refused included), finished and meeting both SLOs.", "reqps",
                p.target(q.rate(q.ARRIVED, D, W, BY), "arrived {{deployment}}"),
                p.target(q.rate(q.FINISHED, D, W, BY), "finished {{deployment}}"),
                p.target(q.goodput_rps(D, W, BY), "within SLO {{deployment}}")),
        p.graph("Errors and refusals", "Requests failed on the way, and refused by overload "
                "(429: queue full, 503: no instance).", "reqps",
                p.target(q.rate(q.SUCCESS, D, W, f"{BY}, finished_reason", finished_reason="error"),
                         "error {{deployment}}"),
                p.target(q.rate(q.REJECTED, D, W, f"{BY}, status"), "refused {{status}} {{deployment}}")),
        p.graph("End-to-end latency", "Percentiles over finished requests.", "s",
                *(p.target(q.quantile(x, q.E2E, D, W), f"p{int(x * 100)}") for x in (0.5, 0.9, 0.99))))
    return layout.builder
