"""Where `distserve plan` gets the cluster shape when the spec leaves it to the Nodes.

In a cluster the operator reads nodes, GPUs per node and the GPU type from the Node
objects. On a laptop there are none, so, in order:
1. `--nodes`, `--gpus-per-node`, `--accelerator`: always win (over the spec too);
2. the spec's own `cluster` fields;
3. what is still unset, from the Nodes of the current kubeconfig context's cluster, read
   the way the operator reads them (`distserve.k8s.nodes`), when there is a kubeconfig
   and its cluster answers within a few seconds.
When none of them gives nodes and GPUs per node, `ShapeUnknown` says which flags to pass.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from distserve import spec as specs
from distserve.k8s import nodes as k8s_nodes

CLUSTER_TIMEOUT_S = 5.0
FLAGS_HINT = "give --nodes and --gpus-per-node (and --accelerator)"


class ClusterUnavailable(RuntimeError):
    """No cluster to read Nodes from: no kubeconfig, no client library, or no answer."""


class ShapeUnknown(ValueError):
    """Neither flags, nor the spec, nor a cluster give the nodes and GPUs per node."""


def with_flags(spec: specs.DistServeDeploymentSpec, *, nodes: int | None = None,
               gpus_per_node: int | None = None,
               accelerator: str | None = None) -> specs.DistServeDeploymentSpec:
    """The spec with the command-line cluster flags applied over `spec.cluster`."""
    update: dict[str, Any] = {}
    if nodes is not None:
        update["nodes"] = nodes
        names = spec.cluster.node_names
        if names is not None and len(names) < nodes:
            update["node_names"] = None  # fewer names than nodes asked: name them node-i
    if gpus_per_node is not None:
        update["gpus_per_node"] = gpus_per_node
    if accelerator is not None:
        update["accelerator"] = accelerator
    if not update:
        return spec
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update=update)})


def read_kubeconfig_nodes(timeout_s: float = CLUSTER_TIMEOUT_S) -> tuple[str, list[dict[str, Any]]]:
    """(API server URL, Node objects) of the current kubeconfig context's cluster."""
    try:
        import kubernetes
        import urllib3
    except ImportError:
        raise ClusterUnavailable(
            "the kubernetes package is not installed (pip install 'distserve[k8s]')") from None
    config = kubernetes.client.Configuration()
    try:
        # NOTE: KUBECONFIG read now; the library's default was fixed when it was imported.
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                           client_configuration=config)
    except (kubernetes.config.ConfigException, OSError) as exc:
        raise ClusterUnavailable(f"no usable kubeconfig context ({exc})") from None
    config.retries = 1
    api_client = kubernetes.client.ApiClient(config)
    try:
        response = kubernetes.client.CoreV1Api(api_client).list_node(
            _preload_content=False, _request_timeout=timeout_s)
        found = json.loads(response.data)
    except kubernetes.client.ApiException as exc:
        raise ClusterUnavailable(
            f"the cluster at {config.host} refused to list Nodes ({exc.status} {exc.reason})") from None
    except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
        raise ClusterUnavailable(f"the cluster at {config.host} did not answer ({exc})") from None
    finally:
        api_client.close()
    return config.host, list(found.get("items") or [])


def complete_cluster(
    spec: specs.DistServeDeploymentSpec, *, nodes: int | None = None,
    gpus_per_node: int | None = None, accelerator: str | None = None,
    read_nodes: Callable[[], tuple[str, list[dict[str, Any]]]] = read_kubeconfig_nodes,
) -> tuple[specs.DistServeDeploymentSpec, str]:
    """The spec with a complete cluster shape, and where the shape came from (for people)."""
    spec = with_flags(spec, nodes=nodes, gpus_per_node=gpus_per_node, accelerator=accelerator)
    if not k8s_nodes.needs_nodes(spec):
        return spec, "the spec and flags"
    unset = [name for name, value in (("spec.cluster.nodes", spec.cluster.nodes),
                                      ("spec.cluster.gpusPerNode", spec.cluster.gpus_per_node))
             if value is None]
    try:
        server, found = read_nodes()
    except ClusterUnavailable as exc:
        raise ShapeUnknown(f"{' and '.join(unset)} unset and {exc}: {FLAGS_HINT}") from None
    shape = k8s_nodes.cluster_shape(found, is_cpu=k8s_nodes.is_cpu_spec(spec))
    if not shape.node_names or shape.gpus_per_node < 1:
        what = "Ready node" if k8s_nodes.is_cpu_spec(spec) else \
            f"Ready node offering {k8s_nodes.GPU_RESOURCE}"
        raise ShapeUnknown(f"{' and '.join(unset)} unset and the cluster at {server} has no "
                           f"{what}: {FLAGS_HINT}")
    return k8s_nodes.fill_cluster(spec, shape), f"the Nodes of the cluster at {server}"
