"""A dashboard drawn as a PNG from its own queries, where no Grafana runs.

Each panel of the dashboard file becomes one plot of what its targets returned from
Prometheus (range results; an instant result is drawn as a point), with the legend the
panel's `legendFormat` gives and, for a panel with a threshold line, that line. It reads
the generated JSON, not the Python source, so the picture shows what a user imports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLUMNS = 3
Query = Callable[[str], list[dict]]  # expression -> Prometheus result (matrix or vector)


def legend_text(legend_format: str, labels: dict[str, str]) -> str:
    """`{{label}}` replaced by the series' label values, as Grafana does."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), legend_format)


def plot_panel(axes, panel: dict, query: Query, start_s: float) -> None:
    """One panel's targets on one set of axes (seconds since `start_s` on x)."""
    axes.set_title(panel["title"], fontsize=9)
    for target in panel.get("targets", []):
        for series in query(target["expr"]):
            points = series.get("values") or [series["value"]]
            xs = [float(t) - start_s for t, _ in points]
            ys = [float(v) for _, v in points]
            label = legend_text(target.get("legendFormat", ""), series["metric"])
            style = "--" if label == "SLO" or label.startswith(("predicted", "objective")) else "-"
            axes.plot(xs, ys, style, marker="o" if len(xs) == 1 else None, label=label, linewidth=1)
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
    for step in steps:
        if step.get("value") is not None:
            axes.axhline(step["value"], color="red", linewidth=0.8, linestyle=":")
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    axes.set_ylabel(unit, fontsize=7)
    axes.tick_params(labelsize=7)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=6, loc="best")


def render_dashboard(doc: dict, query: Query, start_s: float, path: Path) -> int:
    """Draw every non-row panel of `doc` into `path`; the number of panels drawn."""
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    rows = math.ceil(len(panels) / COLUMNS)
    figure, grid = plt.subplots(rows, COLUMNS, figsize=(5 * COLUMNS, 2.8 * rows), squeeze=False)
    for axes, panel in zip(grid.flat, panels, strict=False):
        plot_panel(axes, panel, query, start_s)
    for axes in list(grid.flat)[len(panels):]:
        axes.set_visible(False)
    figure.suptitle(doc["title"])
    figure.supxlabel("seconds", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return len(panels)
