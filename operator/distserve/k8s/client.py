"""The operator's own access to the Kubernetes API: dicts in, dicts out, asynchronous.

kopf watches the DistServeDeployments and patches their status; this client creates,
patches, lists and deletes the objects they own. Both find the API server the same
way: `login()` (the operator's `@kopf.on.login` handler) resolves one
`kopf.ConnectionInfo`, in-cluster service account first, then the kubeconfig, and
this client uses that same one. Tests point both at an emulator with
`set_connection()`.

Only JSON merge patches are sent (lists are replaced whole), which is what both a
real API server and the kmock emulator do the same way.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import aiohttp
import kopf

MERGE_PATCH = "application/merge-patch+json"
# How the operator's own calls show in the API server's audit log (kopf's say "kopf/...").
USER_AGENT = "distserve-operator"

# kind -> (API prefix, plural, namespaced)
_KINDS: dict[str, tuple[str, str, bool]] = {
    "Pod": ("api/v1", "pods", True),
    "Service": ("api/v1", "services", True),
    "ConfigMap": ("api/v1", "configmaps", True),
    "Node": ("api/v1", "nodes", False),
    "Event": ("api/v1", "events", True),
    "Deployment": ("apis/apps/v1", "deployments", True),
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies", True),
    # scheduler-plugins' coscheduling groups (spec.engine.gangScheduling; see `gang`)
    "PodGroup": ("apis/scheduling.x-k8s.io/v1alpha1", "podgroups", True),
    "DistServeDeployment": ("apis/distserve.io/v1alpha1", "distservedeployments", True),
}

_connection: kopf.ConnectionInfo | None = None
_logger = logging.getLogger(__name__)


class ApiError(Exception):
    """A failed API call: the HTTP status and the server's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def set_connection(info: kopf.ConnectionInfo | None) -> None:
    """Use this API server from now on (tests); None: log in again on next use."""
    global _connection
    _connection = info


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Find the API server (kopf's login handler signature); remember what was found."""
    global _connection
    if _connection is None:
        _connection = kopf.login_via_client(**kwargs)
    return _connection


def resource_path(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    """The URL path of a collection (name None) or of one object."""
    prefix, plural, namespaced = _KINDS[kind]
    path = f"/{prefix}"
    if namespaced and namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    return f"{path}/{name}" if name else path


def label_selector(labels: dict[str, str]) -> str:
    """`a=b,c=d`."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def has_labels(obj: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether an object carries all these labels."""
    own = obj.get("metadata", {}).get("labels") or {}
    return all(own.get(k) == v for k, v in labels.items())


class ApiClient:
    """A session to the API server, opened on first use inside the running event loop."""

    def __init__(self, user_agent: str = USER_AGENT) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._info: kopf.ConnectionInfo | None = None
        self._user_agent = user_agent

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _open(self) -> tuple[aiohttp.ClientSession, kopf.ConnectionInfo]:
        """The session and connection, resolving the login when needed."""
        info = _connection or login(logger=_logger, settings=kopf.OperatorSettings())
        if info is None:
            raise ApiError(0, "no Kubernetes API found (neither in-cluster nor kubeconfig)")
        if self._session is None or info is not self._info:
            await self.close()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=_ssl_context(info)),
                headers={"User-Agent": self._user_agent, **_auth_headers(info)},
                auth=aiohttp.BasicAuth(info.username, info.password or "") if info.username else None,
            )
            self._info = info
        return self._session, info

    async def request(self, method: str, path: str, body: Any = None,
                      params: dict[str, str] | None = None) -> dict[str, Any]:
        """One call; raises ApiError on a status >= 400."""
        session, info = await self._open()
        headers = {"Content-Type": MERGE_PATCH} if method == "PATCH" else {}
        url = info.server.rstrip("/") + path
        async with session.request(method, url, json=body, params=params, headers=headers) as resp:
            payload = await resp.json(content_type=None) if resp.content_length != 0 else {}
            if resp.status == 401:
                set_connection(None)  # the token may have rotated: log in again next time
            if resp.status >= 400:
                message = payload.get("message", "") if isinstance(payload, dict) else str(payload)
                raise ApiError(resp.status, message)
            return payload or {}

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """One object, or None when it does not exist."""
        try:
            return await self.request("GET", resource_path(kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str | None = None,
                   labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Objects of a kind carrying all `labels` (also filtered here, for emulators)."""
        params = {"labelSelector": label_selector(labels)} if labels else None
        found = await self.request("GET", resource_path(kind, namespace), params=params)
        items = found.get("items") or []
        return [o for o in items if has_labels(o, labels or {})]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create an object in its own namespace."""
        namespace = obj["metadata"].get("namespace")
        return await self.request("POST", resource_path(obj["kind"], namespace), obj)

    async def patch(self, kind: str, namespace: str | None, name: str, patch: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch of one object (or of its status subresource)."""
        path = resource_path(kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return await self.request("PATCH", path, patch)

    async def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        """Delete one object (its dependents in the background); False if it was gone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            await self.request("DELETE", resource_path(kind, namespace, name), body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True


def _auth_headers(info: kopf.ConnectionInfo) -> dict[str, str]:
    """The bearer token header, when the login gave one."""
    if not info.token:
        return {}
    return {"Authorization": f"{info.scheme or 'Bearer'} {info.token}"}


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    """TLS as the login found it: the cluster's CA, a client certificate, or none."""
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        cadata = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        context = ssl.create_default_context(cafile=info.ca_path, cadata=cadata)
    if info.certificate_path and info.private_key_path:
        context.load_cert_chain(info.certificate_path, info.private_key_path)
    return context
