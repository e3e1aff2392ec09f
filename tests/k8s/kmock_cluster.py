"""A fake cluster for the operator tests: the kmock API emulator with the resources the
operator touches, GPU Nodes, and helpers that play the kubelet and wait for the status."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import jsonpatch
import kmock
import kopf
import yaml
from k8s_factories import make_node
from kmock._internal import dsl, rendering

from distserve.k8s import client, naming
from distserve.k8s.client import ApiClient, ApiError

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "distservedeployments.distserve.io.yaml"
NAMESPACE = "serving"
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
# Every resource the operator or kopf touches must be declared (kmock 0.8).
RESOURCES = {
    "v1/namespaces": ("Namespace", False, set()),
    "v1/nodes": ("Node", False, set()),
    "v1/pods": ("Pod", True, {"status"}),
    "v1/services": ("Service", True, set()),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/events": ("Event", True, set()),
    "apps/v1/deployments": ("Deployment", True, {"status"}),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, set()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, set()),
    "distserve.io/v1alpha1/distservedeployments": ("DistServeDeployment", True, {"status"}),
}
OPERATOR_ARGS = ["run", "-m", "distserve.k8s.handlers", "--all-namespaces", "--standalone"]


def _contains_request(view: dsl.View, item: Any, _contains=dsl.View.__contains__) -> bool:
    """kmock 0.8 answers "is this request in that filter" by running the filter over every
    request served so far, for every reaction and every request: quadratic in a lifecycle's
    thousands of requests (most of a kopf test's CPU time). A plain filter holds a request
    exactly when its source holds it and its criteria accept it; ask that directly."""
    if isinstance(item, rendering.Request) and type(view) is dsl.Filter:
        return bool(view.criteria(item)) and item in view._source
    return _contains(view, item)


dsl.View.__contains__ = _contains_request


class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock with resource versions, as an API server keeps them (kmock 0.8 keeps none).

    Every write bumps `metadata.resourceVersion`; a list answers with the current
    version and a watch from that version replays only newer objects. kopf relies on
    both: it waits for the version its own patch produced, and a stale replay would make
    it handle a creation twice. A failed JSON-patch test is a 422 (kmock: 500), which
    kopf retries on the next event.
    """

    _clock = [1]  # the last version handed out (class-level: attrs slots forbid new fields)

    def _tick(self) -> str:
        self._clock[0] += 1
        return str(self._clock[0])

    async def _handle(self, request):
        if request.resource is not None and request.action in (kmock.action.CREATE,
                                                               kmock.action.UPDATE):
            version = self._tick()
            if isinstance(request.data, dict):
                request.data.setdefault("metadata", {})["resourceVersion"] = version
            elif isinstance(request.data, list):  # a JSON patch
                request.data.append({"op": "add", "path": "/metadata/resourceVersion",
                                     "value": version})
        elif request.resource is not None and request.action == kmock.action.DELETE:
            key = (request.resource, request.namespace, request.name)
            if request.name and key in self.objects and not self.objects[key].deleted:
                self.objects[key].patch({"metadata": {"resourceVersion": self._tick()}})
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None

    async def _serve_list(self, request):
        found = await super()._serve_list(request)
        found["metadata"]["resourceVersion"] = str(self._clock[0])
        return found

    async def _serve_watch(self, request):
        since = request.params.get("resourceVersion", "")
        since_version = int(since) if since.isdigit() else 0
        async for event in super()._serve_watch(request):
            if isinstance(event, dict):
                version = event.get("object", {}).get("metadata", {}).get("resourceVersion", "0")
                if int(version) <= since_version:
                    continue
            yield event


def prepare(emulator: kmock.KubernetesEmulator, nodes: int = 1) -> ApiClient:
    """Declare resources, add the CRD, a namespace and GPU nodes; point the client at it."""
    for key, (kind, namespaced, subresources) in RESOURCES.items():
        emulator.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subresources)
    crd = yaml.safe_load(CRD_PATH.read_text())
    emulator.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None,
                     crd["metadata"]["name"]] = crd
    emulator.objects["v1/namespaces", None, NAMESPACE] = {"metadata": {"name": NAMESPACE}}
    for i in range(nodes):
        name = f"gpu-node-{'abcd'[i]}"
        emulator.objects["v1/nodes", None, name] = make_node(name)
    client.set_connection(kopf.ConnectionInfo(server=str(emulator.servers[0].url)))
    return ApiClient()


def make_resource(name: str, spec: dict[str, Any], **annotations: str) -> dict[str, Any]:
    """A DistServeDeployment as `kubectl apply` would send it (kmock assigns no uid)."""
    return {
        "apiVersion": "distserve.io/v1alpha1",
        "kind": "DistServeDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}",
                     "generation": 1, "resourceVersion": "1", "annotations": annotations},
        "spec": spec,
    }


async def wait_for(check, timeout_s: float = 180.0, what: str = "condition"):
    """Poll an async check until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def status_of(api: ApiClient, name: str) -> dict[str, Any]:
    """The resource's status (empty when absent)."""
    found = await api.get("DistServeDeployment", NAMESPACE, name)
    return (found or {}).get("status") or {}


async def owned(api: ApiClient, kind: str, name: str, **labels: str) -> list[dict[str, Any]]:
    """Objects of a kind that belong to the resource."""
    return await api.list(kind, NAMESPACE, {naming.DEPLOYMENT_LABEL: name, **labels})


async def play_kubelet(api: ApiClient, name: str) -> None:
    """Mark the resource's pods and router Ready, as kubelet and controllers would."""
    ready = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    for pod in await owned(api, "Pod", name):
        try:
            await api.patch("Pod", NAMESPACE, pod["metadata"]["name"], ready, subresource="status")
        except ApiError as exc:  # deleted meanwhile (a reshuffle's delete step)
            if exc.status != 404:
                raise
    for deployment in await owned(api, "Deployment", name):
        await api.patch("Deployment", NAMESPACE, deployment["metadata"]["name"],
                        {"status": {"readyReplicas": 1, "replicas": 1}}, subresource="status")


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    """One condition (empty when absent)."""
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})
