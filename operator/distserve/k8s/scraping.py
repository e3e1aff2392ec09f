"""How Prometheus finds the metrics of the pods the operator creates.

Every engine (prefill, decode) and router pod serves Prometheus text at `/metrics` on
its `http` port, next to the API. Two ways to find them, both needing nothing from
the user: the `prometheus.io/*` pod annotations that annotation-based scrape configs
(the Prometheus Helm chart's `kubernetes-pods` job) read, and the chart's PodMonitor
(`metrics.podMonitor.enabled`) for the Prometheus Operator, which selects the pods by
their `app.kubernetes.io/managed-by` label and the `http` port name.
"""

from __future__ import annotations

METRICS_PATH = "/metrics"
SCRAPE_ANNOTATION = "prometheus.io/scrape"
PORT_ANNOTATION = "prometheus.io/port"
PATH_ANNOTATION = "prometheus.io/path"


def scrape_annotations(port: int) -> dict[str, str]:
    """The pod annotations that ask Prometheus to scrape `port` at /metrics."""
    return {SCRAPE_ANNOTATION: "true", PORT_ANNOTATION: str(port), PATH_ANNOTATION: METRICS_PATH}
