"""The builders as pure functions: plan + spec + owner -> Kubernetes objects."""

from __future__ import annotations

import dataclasses
import json

import kubernetes_validate
from k8s_factories import NODES, make_mixed_plan, make_owner, make_plan, make_revision, make_spec

from distserve.k8s import naming, router, workers
from distserve.search.placement import place_units
from distserve.search.trials import Config, Unit
from distserve_engine.instance.ranks import layout_for
from distserve_engine.server.settings import ServeSettings

KNOWN = set(NODES)


def _pods(revision, known=KNOWN):
    objects = workers.build_revision_objects(revision, known)
    return [o for o in objects if o["kind"] == "Pod"]


def _node_of(pod):
    return pod["metadata"]["annotations"][naming.PLANNED_NODE_ANNOTATION]


def _key(pod):
    labels = pod["metadata"]["labels"]
    return labels[naming.ROLE_LABEL], int(labels[naming.INSTANCE_LABEL]), int(labels[naming.STAGE_LABEL])


def test_low_affinity_pins_each_stage_of_prefill_and_decode_to_one_node():
    plan = make_plan("low-affinity", prefill=(2, 2, 1), decode=(1, 2, 1))
    pods = _pods(make_revision(plan))
    assert len(pods) == 4
    for pod in pods:
        required = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        term = required["nodeSelectorTerms"][0]["matchExpressions"][0]
        assert term == {"key": "kubernetes.io/hostname", "operator": "In", "values": [_node_of(pod)]}
    by_key = {_key(p): _node_of(p) for p in pods}
    for stage in (0, 1):
        assert by_key[("prefill", 0, stage)] == by_key[("decode", 0, stage)]
    assert by_key[("prefill", 0, 0)] != by_key[("prefill", 0, 1)]


def test_high_affinity_only_prefers_the_planned_node():
    plan = make_plan("high-affinity", prefill=(2, 1, 2), decode=(2, 1, 2))
    pods = _pods(make_revision(plan))
    for pod in pods:
        node_affinity = pod["spec"]["affinity"]["nodeAffinity"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in node_affinity
        preferred = node_affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert preferred["preference"]["matchExpressions"][0]["values"] == [_node_of(pod)]
    assert {_node_of(p) for p in pods if _key(p)[0] == "prefill"} == {NODES[0]}
    assert {_node_of(p) for p in pods if _key(p)[0] == "decode"} == {NODES[1]}


def test_synthetic_node_names_become_pod_affinity_only_under_low_affinity():
    synthetic = ("node-0", "node-1")
    low = _pods(make_revision(make_plan("low-affinity", nodes=synthetic)), known=set())
    for pod in low:
        term = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"][workers.PLANNED_NODE_LABEL] == _node_of(pod)
        assert pod["metadata"]["labels"][workers.PLANNED_NODE_LABEL] == _node_of(pod)
    high = _pods(make_revision(make_plan("high-affinity", nodes=synthetic)), known=set())
    assert all("affinity" not in pod["spec"] for pod in high)


def test_gpu_requests_equal_tp_and_limits():
    plan = make_plan(prefill=(4, 1, 1), decode=(2, 1, 1))
    for pod in _pods(make_revision(plan)):
        resources = pod["spec"]["containers"][0]["resources"]
        tp = 4 if _key(pod)[0] == "prefill" else 2
        assert resources["requests"]["nvidia.com/gpu"] == tp
        assert resources["limits"]["nvidia.com/gpu"] == tp
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]


def test_cpu_accelerator_requests_no_gpu():
    spec = make_spec(cluster={"nodes": 1, "gpusPerNode": 2, "accelerator": "CPU"},
                     engine={"resources": {"requests": {"cpu": "2", "memory": "4Gi"}}})
    pods = _pods(make_revision(make_plan(nodes=("node-0",)), spec), known=set())
    for pod in pods:
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources == {"requests": {"cpu": "2", "memory": "4Gi"}}
        assert "tolerations" not in pod["spec"]


def test_every_object_is_owned_and_labelled():
    revision = make_revision()
    owner = revision.owner
    config = router.build_router_config(owner, revision.spec, [])
    objects = workers.build_revision_objects(revision, KNOWN) + [
        router.build_router_deployment_spec(owner, revision.spec, config),
        router.build_router_service_spec(owner, revision.spec),
        router.build_router_config_map_spec(owner, revision.spec, config),
    ]
    assert len(objects) == 1 + 3 + 3 + 3  # config, 3 instance Services, 3 pods, router x3
    for obj in objects:
        meta = obj["metadata"]
        assert meta["ownerReferences"] == [{
            "apiVersion": "distserve.io/v1alpha1", "kind": "DistServeDeployment", "name": "opt",
            "uid": "uid-1234", "controller": True, "blockOwnerDeletion": True}]
        assert meta["namespace"] == "serving"
        assert meta["labels"][naming.DEPLOYMENT_LABEL] == "opt"
        assert len(meta["name"]) <= 63
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))


def test_pod_labels_and_instance_service_selector_match():
    revision = make_revision()
    objects = workers.build_revision_objects(revision, KNOWN)
    services = [o for o in objects if o["kind"] == "Service"]
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert sorted(_key(p) for p in pods) == [("decode", 0, 0), ("decode", 1, 0), ("prefill", 0, 0)]
    for service in services:
        assert service["spec"]["clusterIP"] == "None"
        members = [p for p in pods if all(p["metadata"]["labels"].get(k) == v
                                          for k, v in service["spec"]["selector"].items())]
        assert len(members) == 1
        assert members[0]["spec"]["subdomain"] == service["metadata"]["name"]
        assert members[0]["spec"]["hostname"] == "s0"


def test_worker_container_args_and_config():
    revision = make_revision()
    pod = _pods(revision)[0]
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "distserve_engine.server"]
    args = dict(zip(container["args"][::2], container["args"][1::2], strict=True))
    assert args["--config"] == "/etc/distserve/serve.json"
    assert args["--role"] == "prefill"
    assert args["--instance"] == f"prefill-0-{revision.id}"
    assert args["--advertise-url"] == f"http://s0.opt-{revision.id}-p0.serving.svc:8000"
    config_map = workers.build_engine_config_map_spec(revision)
    settings = json.loads(config_map["data"]["serve.json"])
    assert settings["instances"] == {"prefill": 1, "decode": 2}
    assert settings["engine"]["model"] == "/models/opt-13b"
    assert settings["slo"] == {"ttft_s": 0.25, "tpot_s": 0.1, "attainment": 0.9}
    plan_doc = json.loads(config_map["data"]["plan.json"])
    assert plan_doc["plan"]["id"] == revision.plan.plan_id
    assert [e["role"] for e in plan_doc["instances"]] == ["prefill", "decode", "decode"]
    volume = pod["spec"]["volumes"][0]["configMap"]["name"]
    assert volume == config_map["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MASTER_ADDR"] == f"s0.opt-{revision.id}-p0.serving.svc"
    assert settings["parallel"][args["--instance"]] == {"tp": 2, "pp": 1}


def test_a_mixed_plan_s_pods_each_find_their_own_tp_and_pp_in_the_config_and_no_env(tmp_path):
    plan = make_mixed_plan()
    revision = make_revision(plan)
    config_map = workers.build_engine_config_map_spec(revision)
    settings = ServeSettings.from_dict(json.loads(config_map["data"]["serve.json"]))
    config_path = tmp_path / "serve.json"
    config_path.write_text(config_map["data"]["serve.json"])
    pods = _pods(revision)
    assert len(pods) == len(plan.segments) == 5
    for pod in pods:
        container = pod["spec"]["containers"][0]
        args = dict(zip(container["args"][::2], container["args"][1::2], strict=True))
        labels = pod["metadata"]["labels"]
        phase = plan.phase_of(labels[naming.ROLE_LABEL], int(labels[naming.INSTANCE_LABEL]))
        parallel = settings.parallel_of(args["--role"], args["--instance"])
        assert (parallel.tp, parallel.pp) == (phase.tp, phase.pp)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == phase.tp
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert not set(env) & {"DISTSERVE_TENSOR_PARALLEL", "DISTSERVE_PIPELINE_STAGES", "TP", "PP",
                               "DISTSERVE_STAGE"}
        # the stage is an argument; the engine places the pod's ranks from it and serve.json
        stage = int(labels[naming.STAGE_LABEL])
        assert args["--stage"] == str(stage)
        layout = layout_for(config_path, args["--role"], args["--instance"], int(args["--stage"]),
                            env=env)
        assert (layout.local_ranks, layout.is_driver) == (
            list(range(stage * phase.tp, (stage + 1) * phase.tp)), stage == 0)
        assert layout.init_method == f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    shapes = {args_of(p)["--instance"]: settings.parallel[args_of(p)["--instance"]] for p in pods}
    assert sorted((s.tp, s.pp) for s in shapes.values()) == [(1, 1), (1, 1), (1, 2), (2, 1)]


def args_of(pod: dict) -> dict[str, str]:
    """The engine container's `--flag value` arguments."""
    args = pod["spec"]["containers"][0]["args"]
    return dict(zip(args[::2], args[1::2], strict=True))


def test_router_peers_leave_out_draining_instances_carry_nodes_and_do_not_roll_the_router():
    owner, revision = make_owner(), make_revision()
    live = workers.instance_endpoints(revision)
    config = router.build_router_config(owner, revision.spec, [{**e, "draining": False} for e in live])
    drained = router.build_router_config(owner, revision.spec, [
        {**e, "draining": e["role"] == "decode" and e["instance"] == 1} for e in live])
    settings = json.loads(router.build_router_config_map_spec(owner, revision.spec, config)["data"]["serve.json"])
    assert settings["peers"]["prefill"][0] == {
        "name": f"prefill-0-{revision.id}", "url": live[0]["url"], "node": "gpu-node-a",
        "draining": False}
    # Algorithm 2's placement: decode instance i shares prefill instance i's node.
    assert [p["node"] for p in settings["peers"]["decode"]] == ["gpu-node-a", "gpu-node-b"]
    assert len(router.router_peers(drained)["decode"]) == 1
    deployments = [router.build_router_deployment_spec(owner, revision.spec, c) for c in (config, drained)]
    assert deployments[0] == deployments[1]  # peers reach the running router through the ConfigMap


def test_router_keeps_decode_on_node_under_low_affinity_and_across_a_refresh():
    owner, live = make_owner(), workers.instance_endpoints(make_revision())
    high_spec = make_spec(cluster={"nodes": 2, "gpusPerNode": 8, "accelerator": "A100-80GB",
                                   "nodeAffinity": "high"})

    def served(spec, plan):
        config = router.build_router_config(owner, spec, live, plan)
        doc = json.loads(router.build_router_config_map_spec(owner, spec, config)["data"]["serve.json"])
        return doc["can_decode_across_nodes"], config

    low, config = served(make_spec(), make_plan("low-affinity"))
    assert low is False
    # an update or refresh hands the earlier config's plan back: the rule stays
    assert served(make_spec(), config["plan"])[0] is False
    assert served(high_spec, make_plan("high-affinity"))[0] is True
    # a fixed placement follows the spec's nodeAffinity (default low)
    assert served(make_spec(), make_plan("fixed"))[0] is False
    assert served(high_spec, make_plan("fixed"))[0] is True


def test_algorithm_2_pairs_of_unequal_stages_are_on_the_same_node_for_the_router():
    # one unit over two nodes: prefill's 2 stages one per node, decode's 4 two per node
    unit = Unit(Config(1, 2), Config(1, 4), 1, 1, 0.0)
    plan = dataclasses.replace(make_plan("low-affinity", prefill=(1, 2, 1), decode=(1, 4, 1)),
                               segments=place_units(list(NODES), 8, unit, 2, 1))
    peers = router.router_peers(router.build_router_config(
        make_owner(), make_spec(), workers.instance_endpoints(make_revision(plan))))
    assert peers["prefill"][0]["node"] == peers["decode"][0]["node"] == ",".join(NODES[:2])


def test_pods_finish_in_flight_requests_within_their_grace_period():
    owner, revision = make_owner(), make_revision()
    config = router.build_router_config(owner, revision.spec, workers.instance_endpoints(revision))
    pods = [workers.build_worker_pod_spec(revision, revision.plan.segments[0], set()),
            router.build_router_deployment_spec(owner, revision.spec, config)["spec"]["template"]]
    for pod in pods:
        container = pod["spec"]["containers"][0]
        args = container["args"]
        shutdown_s = float(args[args.index("--shutdown-timeout-s") + 1])
        prestop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["spec"]["terminationGracePeriodSeconds"] > prestop_s + shutdown_s >= 60


def test_revision_id_follows_placement_and_engine_not_slo():
    base = make_revision()
    other_slo = make_revision(spec=make_spec(slo={"ttftSeconds": 1.0, "tpotSeconds": 0.2}))
    other_image = make_revision(spec=make_spec(engine={"image": "example.com/engine:2"}))
    other_plan = make_revision(plan=make_plan(decode=(1, 1, 3)))
    assert base.id == other_slo.id
    assert len({base.id, other_image.id, other_plan.id}) == 3


def test_long_names_are_shortened_to_a_dns_label():
    name = "a-very-long-deployment-name-that-goes-on-and-on-and-on-and-on-xyz"[:63]
    revision = make_revision(name=name)
    for obj in workers.build_revision_objects(revision, KNOWN):
        assert len(obj["metadata"]["name"]) <= 63
    assert naming.pod_name(revision, "prefill", 0, 0) != naming.pod_name(revision, "prefill", 0, 1)


def test_router_service_is_the_openai_endpoint():
    owner, spec = make_owner(), make_spec(engine={"serviceType": "LoadBalancer", "port": 9000})
    service = router.build_router_service_spec(owner, spec)
    deployment = router.build_router_deployment_spec(owner, spec, router.build_router_config(owner, spec, []))
    assert service["metadata"]["name"] == "opt"
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"][0]["port"] == 9000
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(template_labels[k] == v for k, v in service["spec"]["selector"].items())
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[2:4] == ["--role", "router"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_router_reads_its_api_keys_from_the_named_secret_only():
    owner = make_owner()
    spec = make_spec(router={"apiKeySecret": {"name": "llm-api-keys", "key": "keys"}})
    deployment = router.build_router_deployment_spec(owner, spec, router.build_router_config(owner, spec, []))
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "DISTSERVE_API_KEY"] == [{
        "name": "DISTSERVE_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "llm-api-keys", "key": "keys"}}}]
    kubernetes_validate.validate(deployment, "1.30.0", strict=True)
    open_spec = make_spec()
    deployment = router.build_router_deployment_spec(owner, open_spec,
                                                     router.build_router_config(owner, open_spec, []))
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "DISTSERVE_API_KEY" not in {e["name"] for e in env}
