"""The parts every dashboard shares: the datasource, the variables, panel builders.

Every panel and annotation reads the `$datasource` variable's Prometheus; every query is
a `prometheus.Dataquery` with a refId; panel ids are given in order by `Layout`, so they
are unique within a dashboard and stable across generations (the files do not drift).
"""

from __future__ import annotations

import json

from grafana_foundation_sdk.builders import common, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from distserve.monitoring import promql as q

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
# The series every engine process exports from its start: the variables list from it.
VARIABLE_SERIES = q.ARRIVED
TAGS = ["distserve"]
FULL_WIDTH = 24
REF_IDS = "ABCDEFGH"
# A plan id that was not there a minute ago: a reshuffle began.
PLAN_BY = "namespace, deployment, plan_id"
NEW_PLAN = (f"max by ({PLAN_BY}) ({q.plan_series(q.PLAN_INFO, q.DASHBOARD)}) unless "
            f"max by ({PLAN_BY}) ({q.plan_series(q.PLAN_INFO, q.DASHBOARD)} offset 1m)")
REPLANNED = (f"sum by (namespace, deployment, action, reason) (increase("
             f"{q.series(q.REPLAN_DECISIONS, q.DASHBOARD_OPERATOR, action='replan')}[1m])) > 0")


def variables() -> list[db.DatasourceVariable | db.QueryVariable]:
    """datasource, namespace, deployment and model (each narrowing the next)."""
    chain = [("namespace", "namespace", ""),
             ("deployment", "deployment", 'namespace=~"$namespace"'),
             ("model", "model_name", 'namespace=~"$namespace", deployment=~"$deployment"')]
    out: list = [db.DatasourceVariable("datasource").label("Prometheus").type("prometheus")]
    for name, label, matchers in chain:
        out.append(db.QueryVariable(name).label(name.capitalize()).datasource(DATASOURCE)
                   .query(f"label_values({q.series(VARIABLE_SERIES, matchers)}, {label})")
                   .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                   .multi(True).include_all(True).all_value(".*"))
    return out


def target(expr: str, legend: str = "", is_instant: bool = False) -> prometheus.Dataquery:
    """One Prometheus query of a panel (its refId set by `Layout`)."""
    query = prometheus.Dataquery().expr(expr).datasource(DATASOURCE)
    if legend:
        query = query.legend_format(legend)
    if is_instant:
        query = query.instant().format(PromQueryFormat.TABLE)
    return query


def graph(title: str, description: str, unit: str, *targets: prometheus.Dataquery,
          minimum: float | None = 0) -> timeseries.Panel:
    """A time series panel."""
    legend = (common.VizLegendOptions().display_mode(common_models.LegendDisplayMode.LIST)
              .placement(common_models.LegendPlacement.BOTTOM).show_legend(True))
    tooltip = common.VizTooltipOptions().mode(common_models.TooltipDisplayMode.MULTI)
    panel = (timeseries.Panel().title(title).description(description).datasource(DATASOURCE)
             .unit(unit).line_width(1).fill_opacity(10).span_nulls(False)
             .legend(legend).tooltip(tooltip))
    if minimum is not None:
        panel = panel.min(minimum)
    return with_targets(panel, targets)


def dashed(panel: timeseries.Panel, name_regex: str, color: str = "red") -> timeseries.Panel:
    """Draw the series whose names match `name_regex` (an objective, a prediction) dashed."""
    return panel.override_by_regexp(name_regex, [
        dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
        dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color}),
    ])


def single(title: str, description: str, unit: str, *targets: prometheus.Dataquery) -> stat.Panel:
    """A stat panel of the last value."""
    last = common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)
    panel = (stat.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
             .graph_mode(common_models.BigValueGraphMode.AREA).reduce_options(last))
    return with_targets(panel, targets)


def listing(title: str, description: str, *targets: prometheus.Dataquery) -> table.Panel:
    """A table of instant query results (labels as columns)."""
    return with_targets(table.Panel().title(title).description(description)
                        .datasource(DATASOURCE).show_header(True), targets)


def with_targets(panel, targets):
    for ref_id, query in zip(REF_IDS, targets, strict=False):
        panel = panel.with_target(query.ref_id(ref_id))
    return panel


class Layout:
    """Rows of panels on the 24-column grid, panel ids 1, 2, 3... in order."""

    def __init__(self, builder: db.Dashboard) -> None:
        self.builder = builder
        self.next_id = 1
        self.y = 0

    def row(self, title: str, *panels, height: int = 8) -> Layout:
        """A row header, then its panels side by side (equal widths)."""
        self.builder = self.builder.with_row(db.Row(title).id(self._id()).grid_pos(
            dm.GridPos(h=1, w=FULL_WIDTH, x=0, y=self.y)))
        self.y += 1
        width = FULL_WIDTH // len(panels)
        for i, panel in enumerate(panels):
            self.builder = self.builder.with_panel(panel.id(self._id()).grid_pos(
                dm.GridPos(h=height, w=width, x=i * width, y=self.y)))
        self.y += height
        return self

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def plan_annotations() -> list[db.AnnotationQuery]:
    """A new plan id (a reshuffle began) and a replan decision, on every time panel."""
    return [db.AnnotationQuery().name("Reshuffles").datasource(DATASOURCE).expr(NEW_PLAN)
            .enable(True).icon_color("purple"),
            db.AnnotationQuery().name("Replan decisions").datasource(DATASOURCE)
            .expr(REPLANNED).enable(True).icon_color("orange")]


def new_dashboard(uid: str, title: str, description: str) -> db.Dashboard:
    """A dashboard with the shared variables, tags, refresh and time range."""
    builder = (db.Dashboard(title).uid(uid).description(description).tags(TAGS)
               .refresh("30s").time("now-1h", "now").timezone("browser").editable())
    for variable in variables():
        builder = builder.with_variable(variable)
    for annotation in plan_annotations():
        builder = builder.annotation(annotation)
    return builder


def to_json(builder: db.Dashboard) -> str:
    """The dashboard's JSON text (sorted keys: a change shows as a small diff)."""
    return json.dumps(builder.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
