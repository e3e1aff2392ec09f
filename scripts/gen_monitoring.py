"""Write the Grafana dashboards and the Prometheus rules from `distserve.monitoring`.

    dashboards/*.json                     the dashboards (import them into Grafana)
    charts/distserve/files/dashboards/    their copies the chart ships as ConfigMaps
    charts/distserve/files/rules.yaml     the rules file (the chart's PrometheusRule reads it)

Run after changing `operator/distserve/monitoring/`:  python scripts/gen_monitoring.py
(needs the `dev` extra: grafana-foundation-sdk).
"""

from __future__ import annotations

import sys
from pathlib import Path

from distserve.monitoring.dashboards import render_all
from distserve.monitoring.rules import render_rules

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
CHART_FILES = ROOT / "charts" / "distserve" / "files"


def outputs() -> dict[Path, str]:
    """Path -> the text it must hold."""
    files = {}
    for name, text in render_all().items():
        files[DASHBOARDS / name] = text
        files[CHART_FILES / "dashboards" / name] = text
    files[CHART_FILES / "rules.yaml"] = render_rules()
    return files


def main() -> int:
    for path, text in outputs().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
