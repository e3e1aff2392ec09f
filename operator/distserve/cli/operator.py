"""`distserve operator`: run the kopf operator that reconciles DistServeDeployments.

The Helm chart's operator Deployment runs this command. It watches every namespace
(or the ones given), needs no peering objects (`--standalone` is the default: the
chart runs one replica), serves a liveness endpoint for the kubelet, and its own
Prometheus metrics (`distserve_replan_decisions_total{action, reason}`) on
`--metrics-port`.

With `--namespace`, kopf's runtime observation of Namespaces and CRDs is off: the
namespaces are exact names, and the chart's namespaced Roles grant nothing
cluster-wide (charts/distserve/templates/rbac.yaml).
"""

from __future__ import annotations

import logging

NAME = "operator"
HELP = "Run the Kubernetes operator (kopf) that plans and applies DistServeDeployments."


def add_arguments(parser) -> None:
    """Options of `distserve operator`."""
    parser.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                        help="watch only this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--peering", action="store_true",
                        help="coordinate with other operator replicas through kopf peering")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                        help="liveness endpoint for the kubelet ('' to disable)")
    parser.add_argument("--metrics-port", type=int, default=8081, metavar="PORT",
                        help="serve the operator's Prometheus metrics (replanning decisions) "
                        "on this port (0 to disable)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def operator_settings(namespaces: list[str]):
    """kopf's settings: no cluster-wide scanning when given namespaces to watch."""
    import kopf

    settings = kopf.OperatorSettings()
    settings.scanning.disabled = bool(namespaces)
    return settings


def run(args) -> int:
    """Run until stopped (SIGTERM or SIGINT)."""
    import kopf

    import distserve.k8s.handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)  # distserve_replan_decisions_total and the like
    kopf.run(
        settings=operator_settings(args.namespace),
        standalone=not args.peering,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0
