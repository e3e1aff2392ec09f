"""The planner: which plan serves, what it promised, and why the planner changed it.

The current plan (its id, the tp x pp x instances shape and GPUs of each phase), its
predicted goodput and attainment beside the observed ones, the load beside the goodput
the plan was made for (the figure a replan answers to), the replanner's decisions by
action and reason over time, and each reshuffle (a new plan id) as an annotation.
"""

from __future__ import annotations

from distserve.monitoring import promql as q
from distserve.monitoring.dashboards import panels as p

UID = "distserve-planner"
D, DO, W = q.DASHBOARD, q.DASHBOARD_OPERATOR, q.RATE_WINDOW
BY = "namespace, deployment"
PLAN_BY = f"{BY}, plan_id"


def build():
    """The planner dashboard's builder."""
    layout = p.Layout(p.new_dashboard(UID, "DistServe / Planner", __doc__.split("\n")[0]))
    layout.row(
        "Current plan",
        p.listing("Plan", "The plan served under: prefill and decode as tp<TP>pp<PP>x<instances>.",
                  p.target(f"max by ({PLAN_BY}, prefill, decode) ({q.plan_series(q.PLAN_INFO, D)})",
                           is_instant=True)),
        p.single("GPUs per phase", "tp x pp x instances of each phase.", "none",
                 p.target(f"max by (phase) ({q.plan_series(q.PLAN_GPUS, D)})", "{{phase}}")),
        p.single("Predicted goodput", "Requests/s the plan serves at the attainment target.",
                 "reqps", p.target(f"max by ({BY}) ({q.plan_series(q.PLAN_GOODPUT, D)})", "{{deployment}}")),
        height=5)
    layout.row(
        "Promise and load",
        p.graph("Load vs the plan's goodput", "Arrivals (refused included) beside the goodput the "
                "plan was made for: a load above it is what a replan answers to.", "reqps",
                p.target(q.rate(q.ARRIVED, D, W, BY), "arrived {{deployment}}"),
                p.target(f"max by ({BY}) ({q.plan_series(q.PLAN_GOODPUT, D)})", "planned {{deployment}}")),
        p.graph("Goodput: observed vs predicted", "Requests/s meeting both SLOs.", "reqps",
                p.target(q.goodput_rps(D, W, BY), "observed {{deployment}}"),
                p.target(f"max by ({BY}) ({q.plan_series(q.PLAN_GOODPUT, D)})", "predicted {{deployment}}")),
        p.graph("Attainment: observed vs predicted", "Share of arrived requests meeting both SLOs.",
                "percentunit", p.target(q.attainment(D, W, BY), "observed {{deployment}}"),
                p.target(f"max by ({BY}) ({q.plan_series(q.PLAN_ATTAINMENT, D)})",
                         "predicted {{deployment}}")).max(1))
    layout.row(
        "Decisions",
        p.graph("Replan decisions", "Each decision of the replanner, taken or not, by action "
                "(keep, replan, recommend, no-decision) and reason.", "none",
                p.target(f"sum by ({BY}, action, reason) (increase({q.series(q.REPLAN_DECISIONS, DO)}[{W}]))",
                         "{{action}}: {{reason}}")),
        p.graph("Plan over time", "GPUs of each phase in the plan served under; a step is a reshuffle.",
                "none", p.target(f"max by ({PLAN_BY}, phase) ({q.plan_series(q.PLAN_GPUS, D)})",
                                 "{{phase}} ({{plan_id}})")))
    return layout.builder
