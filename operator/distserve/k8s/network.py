"""Who may reach a deployment's instances: the NetworkPolicy among the operator's objects.

An instance pod serves the KV cache (`/kv/...`), prefill and decode (`/prefill`,
`/decode`) on its `http` port, with no authentication: whoever reaches it can read
prompts' KV or run the model. So ingress to the instance pods (prefill, decode and
colocated ones) is allowed only
- from the deployment's own pods, on every port: the router, the other instances (a
  decode pulls KV from a prefill) and the ranks of one instance (the torch.distributed
  rendezvous and its collectives use ports chosen at run time);
- from the operator (draining and health read `/load`) and the metrics scrapers
  (Prometheus reads `/metrics`), on the `http` port only.
The router is not selected: its Service is the deployment's API (with its own keys).
Everything else in the cluster is refused once a policy selects the pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distserve.k8s import naming

INSTANCE_ROLES = ("prefill", "decode", "colocated")
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace


@dataclass(frozen=True)
class Peer:
    """Pods allowed to reach the instances' `http` port: by labels, in a namespace
    (None: the deployment's own namespace)."""

    pod_labels: dict[str, str] = field(default_factory=dict)
    namespace: str | None = None


def instance_policy_name(owner: naming.Owner) -> str:
    """The NetworkPolicy guarding one deployment's instances."""
    return naming.object_name(owner.name, "instances")


def _peer(peer: Peer) -> dict[str, Any]:
    doc: dict[str, Any] = {"podSelector": {"matchLabels": dict(peer.pod_labels)}}
    if peer.namespace is not None:
        doc["namespaceSelector"] = {"matchLabels": {NAMESPACE_NAME_LABEL: peer.namespace}}
    return doc


def build_instance_network_policy(owner: naming.Owner, http_port: int | str,
                                  peers: list[Peer]) -> dict[str, Any]:
    """The NetworkPolicy of one deployment's instance pods (see the module's docstring);
    `peers`: the operator and the scrapers, allowed on `http_port` (a number or a name)."""
    if isinstance(http_port, int) and not 1 <= http_port <= 65535:
        raise ValueError(f"http_port: must be in [1, 65535], got {http_port}")
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
