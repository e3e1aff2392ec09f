"""The three dashboards, by file name (`dashboards/<name>`, the chart's `files/dashboards/`)."""

from __future__ import annotations

from collections.abc import Callable

from distserve.monitoring.dashboards import disaggregation, panels, planner, slo

BUILDERS: dict[str, Callable] = {
    "distserve-slo.json": slo.build,
    "distserve-disaggregation.json": disaggregation.build,
    "distserve-planner.json": planner.build,
}


def render_all() -> dict[str, str]:
    """File name -> the dashboard's JSON text."""
    return {name: panels.to_json(build()) for name, build in BUILDERS.items()}
