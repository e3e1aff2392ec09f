"""Who may reach a deployment's pods: the NetworkPolicies among the operator's objects.

An instance pod serves the KV cache (`/kv/...`), prefill and decode (`/prefill`,
`/decode`) on its `http` port, with no authentication: whoever reaches it can read
prompts' KV or run the model. So ingress to the instance pods (prefill, decode and
colocated ones) is allowed only
- from the deployment's own pods, on every port: the router, the other instances (a
  decode pulls KV from a prefill) and the ranks of one instance (the torch.distributed
  rendezvous and its collectives use ports chosen at run time);
- from the operator (draining and health read `/load`) and the metrics scrapers
  (Prometheus reads `/metrics`), on the `http` port only.
Everything else in the cluster is refused once a policy selects the pods.

That policy does not select the router: its Service is the deployment's API (with its
own keys). The router's own policy opens its API port only (the port of `/v1` and
`/metrics`): to any source, or to `apiFrom` and the metrics scrapers when the spec or the
chart names them.

Who the operator and the scrapers are is the operator's environment, set by its chart
(`NetworkSettings.from_env`); a spec's `networkPolicy` overrides the peers per deployment.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from distserve import spec as specs
from distserve.k8s import naming
from distserve.spec_access import PolicyPeer

POLICY_KIND = "NetworkPolicy"  # one pair per deployment (instances, router), not per revision
INSTANCE_ROLES = ("prefill", "decode", "colocated")
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace
# The scrapers when neither the chart nor the spec names them: Prometheus pods as
# kube-prometheus-stack and the prometheus-community chart label them, in any namespace.
DEFAULT_METRICS_FROM: tuple[dict[str, Any], ...] = (
    {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},)
# The operator's environment (charts/distserve/templates/deployment.yaml sets each one).
MANAGED_ENV = "DISTSERVE_NETWORK_POLICY"  # "false": the operator never touches NetworkPolicies
OPERATOR_NAMESPACE_ENV = "DISTSERVE_OPERATOR_NAMESPACE"
OPERATOR_LABELS_ENV = "DISTSERVE_OPERATOR_POD_LABELS"  # a JSON object
API_FROM_ENV = "DISTSERVE_API_FROM"  # a JSON list of NetworkPolicyPeers; empty: any source
METRICS_FROM_ENV = "DISTSERVE_METRICS_FROM"  # a JSON list of NetworkPolicyPeers
_PEERS = TypeAdapter(list[PolicyPeer])


@dataclass(frozen=True)
class Peer:
    """Pods allowed to reach the instances' `http` port: by labels, in a namespace
    (None: the deployment's own namespace)."""

    pod_labels: dict[str, str] = field(default_factory=dict)
    namespace: str | None = None


@dataclass(frozen=True)
class NetworkSettings:
    """What the operator's environment (its chart) says about NetworkPolicies."""

    is_managed: bool = True  # False: the chart grants no NetworkPolicy access
    operator: Peer | None = None  # None: run outside the cluster, nothing to let in
    api_from: tuple[dict[str, Any], ...] = ()  # empty: the router's port is open to all
    metrics_from: tuple[dict[str, Any], ...] = DEFAULT_METRICS_FROM

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> NetworkSettings:
        """Read the settings; ValueError naming the variable when one is malformed."""
        managed = environ.get(MANAGED_ENV, "true").strip().lower()
        if managed not in ("true", "false"):
            raise ValueError(f"{MANAGED_ENV}: expected true or false, got {managed!r}")
        namespace = environ.get(OPERATOR_NAMESPACE_ENV) or None
        labels = _json_env(environ, OPERATOR_LABELS_ENV, {})
        if not isinstance(labels, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise ValueError(f"{OPERATOR_LABELS_ENV}: expected a JSON object of strings")
        operator = Peer(labels, namespace) if namespace and labels else None
        metrics = _json_env(environ, METRICS_FROM_ENV, None)
        return cls(is_managed=managed == "true", operator=operator,
                   api_from=_env_peers(_json_env(environ, API_FROM_ENV, []), API_FROM_ENV),
                   metrics_from=DEFAULT_METRICS_FROM if metrics is None
                   else _env_peers(metrics, METRICS_FROM_ENV))


def _json_env(environ: Mapping[str, str], name: str, default: Any) -> Any:
    """A JSON value from the environment (unset or empty: `default`)."""
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError(f"{name}: not JSON: {text[:80]!r}") from None


def _env_peers(value: Any, name: str) -> tuple[dict[str, Any], ...]:
    """NetworkPolicyPeers from the environment, checked as the spec checks its own."""
    try:
        return tuple(peer_documents(_PEERS.validate_python(value)))
    except ValidationError as exc:
        raise ValueError(f"{name}: {specs.format_validation_error(exc)}") from None


def peer_documents(peers: Sequence[PolicyPeer]) -> list[dict[str, Any]]:
    """The spec's peers as the API takes them (camelCase, unset fields left out)."""
    return [p.model_dump(mode="json", by_alias=True, exclude_none=True) for p in peers]


@functools.cache
def settings() -> NetworkSettings:
    """The operator's settings, read once (the environment does not change while it runs)."""
    return NetworkSettings.from_env()


def instance_policy_name(owner: naming.Owner) -> str:
    """The NetworkPolicy guarding one deployment's instances."""
    return naming.object_name(owner.name, "instances")


def router_policy_name(owner: naming.Owner) -> str:
    """The NetworkPolicy guarding the router (named as its Deployment)."""
    return naming.router_name(owner)


def _peer(peer: Peer | dict[str, Any]) -> dict[str, Any]:
    """A NetworkPolicyPeer document (a dict is one already)."""
    if isinstance(peer, dict):
        return peer
    doc: dict[str, Any] = {"podSelector": {"matchLabels": dict(peer.pod_labels)}}
    if peer.namespace is not None:
        doc["namespaceSelector"] = {"matchLabels": {NAMESPACE_NAME_LABEL: peer.namespace}}
    return doc


def _check_port(http_port: int | str) -> None:
    if isinstance(http_port, int) and not 1 <= http_port <= 65535:
        raise ValueError(f"http_port: must be in [1, 65535], got {http_port}")


def build_instance_network_policy(owner: naming.Owner, http_port: int | str,
                                  peers: Sequence[Peer | dict[str, Any]]) -> dict[str, Any]:
    """The NetworkPolicy of one deployment's instance pods (see the module's docstring);
    `peers`: the operator and the scrapers (Peers or NetworkPolicyPeer documents),
    allowed on `http_port` (a number or a name)."""
    _check_port(http_port)
    own_pods = {"podSelector": {"matchLabels": {naming.DEPLOYMENT_LABEL: owner.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own_pods]}]
    if peers:
        ingress.append({"from": [_peer(p) for p in peers],
                        "ports": [{"protocol": "TCP", "port": http_port}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.object_meta(owner, instance_policy_name(owner),
                                       naming.owner_labels(owner)),
        "spec": {
            "podSelector": {
                "matchLabels": {naming.DEPLOYMENT_LABEL: owner.name},
                "matchExpressions": [{"key": naming.ROLE_LABEL, "operator": "In",
                                      "values": list(INSTANCE_ROLES)}],
            },
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_router_network_policy(owner: naming.Owner, http_port: int | str,
                                api_from: Sequence[dict[str, Any]],
                                metrics_from: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The NetworkPolicy of the router's pods: `http_port` only, from `api_from` and the
    scrapers, or from anywhere when `api_from` is empty."""
    _check_port(http_port)
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": http_port}]}
    if api_from:
        rule = {"from": [*api_from, *metrics_from], **rule}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.object_meta(owner, router_policy_name(owner), naming.owner_labels(owner)),
        "spec": {
            "podSelector": {"matchLabels": {naming.DEPLOYMENT_LABEL: owner.name,
                                            naming.ROLE_LABEL: "router"}},
            "policyTypes": ["Ingress"],
            "ingress": [rule],
        },
    }


def is_enabled(spec: specs.DistServeDeploymentSpec, found: NetworkSettings) -> bool:
    """Whether the deployment gets NetworkPolicies: the spec asks and the operator may."""
    return found.is_managed and spec.network_policy.enabled


def build_network_policies(owner: naming.Owner, spec: specs.DistServeDeploymentSpec,
                           found: NetworkSettings) -> list[dict[str, Any]]:
    """The deployment's NetworkPolicies (instances, router); none when not enabled. The
    spec's apiFrom and metricsFrom, when set, replace the operator's defaults."""
    if not is_enabled(spec, found):
        return []
    wanted = spec.network_policy
    metrics_from = peer_documents(wanted.metrics_from) if wanted.metrics_from else list(found.metrics_from)
    api_from = peer_documents(wanted.api_from) if wanted.api_from else list(found.api_from)
    peers: list[Peer | dict[str, Any]] = [*([found.operator] if found.operator else []), *metrics_from]
    return [build_instance_network_policy(owner, spec.engine.port, peers),
            build_router_network_policy(owner, spec.engine.port, api_from, metrics_from)]
