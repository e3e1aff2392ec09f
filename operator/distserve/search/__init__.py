"""The placement search: goodput by bisection on rate, Algorithms 1 and 2, replica
counts and GPU assignment, and the colocated baselines on the same GPUs.

`plan_deployment(spec)` is the entry point; it returns a `distserve.plan.Plan` or
raises `NoFeasiblePlan`.
"""

from distserve.search.goodput import Goodput, find_goodput
from distserve.search.planner import (
    NoFeasiblePlan,
    SearchOverrides,
    build_context,
    plan_deployment,
    resolve_cluster,
)

__all__ = [
    "Goodput",
    "NoFeasiblePlan",
    "SearchOverrides",
    "build_context",
    "find_goodput",
    "plan_deployment",
    "resolve_cluster",
]
