"""A mixed plan (a phase with instances of two shapes) runs under `distserve up`: each
instance process gets its own tp and pp from the settings, and on CUDA only its GPUs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from serving_helpers import make_settings, wait_until
from test_ranks import completions
from test_up import free_port_block

from distserve.cli.up import build_launcher
from distserve.local.launcher import plan_processes, process_env
from distserve.local.reshuffle import router_instances
from distserve.local.settings import (
    instance_counts,
    instance_gpu_ids,
    instance_parallel,
    plan_settings,
)
from distserve.plan import PhaseConfig, Plan, SegmentPlacement
from distserve.spec import SpecError, load_manifest
from distserve_engine.server.settings import Parallelism


def make_mixed_plan(node_of_decode: str = "node-0") -> Plan:
    """prefill: one tp2 instance, then one tp1 pp2; decode: one tp1, on GPUs 0..4."""
    segments = (
        SegmentPlacement("prefill", 0, 0, "node-0", (0, 1)),
        SegmentPlacement("prefill", 1, 1, "node-0", (3,)),  # stage order, not list order
        SegmentPlacement("prefill", 1, 0, "node-0", (2,)),
        SegmentPlacement("decode", 0, 0, node_of_decode, (4,)),
    )
    return Plan(algorithm="fixed", model="tiny", accelerator="CPU",
                prefill=PhaseConfig(2, 1, 1), decode=PhaseConfig(1, 1, 1), segments=segments,
                goodput_rps=1.0, attainment=0.9, latency=None, ttft_slo_s=5.0, tpot_slo_s=1.0,
                attainment_target=0.9, extra_prefill=(PhaseConfig(1, 2, 1),))


def local_spec():
    return load_manifest("examples/local.yaml").spec


def test_the_local_settings_give_each_instance_its_group_s_shape():
    plan = make_mixed_plan()
    assert instance_counts(local_spec(), plan) == {"prefill": 2, "decode": 1}
    assert instance_parallel(local_spec(), plan) == {
        "prefill-0": Parallelism(2, 1), "prefill-1": Parallelism(1, 2), "decode-0": Parallelism()}
    assert plan_settings(plan).prefill == "tp2pp1x1+tp1pp2x1"


def test_each_instance_process_sees_only_its_plan_s_gpus(tmp_path):
    plan = make_mixed_plan()
    settings = make_settings("/models/x", instances=instance_counts(local_spec(), plan),
                             parallel=instance_parallel(local_spec(), plan))
    procs = plan_processes(settings, tmp_path / "serve.json", "127.0.0.1", 9000, num_cores=0,
                           name_to_gpu_ids=instance_gpu_ids(plan))
    name_to_env = {p.name: process_env(p, {"PATH": "/bin"}) for p in procs}
    assert {name: env.get("CUDA_VISIBLE_DEVICES") for name, env in name_to_env.items()} == {
        "prefill-0": "0,1", "prefill-1": "2,3", "decode-0": "4", "router-0": None}
    assert name_to_env["decode-0"]["PATH"] == "/bin"
    cpu_procs = plan_processes(settings, tmp_path / "serve.json", "127.0.0.1", 9000, num_cores=0)
    assert all("CUDA_VISIBLE_DEVICES" not in process_env(p, {}) for p in cpu_procs)


def test_a_plan_over_two_nodes_cannot_pin_one_machine_s_gpus():
    with pytest.raises(SpecError, match=r"spec\.cluster\.nodes: the plan places instances on 2 nodes"):
        instance_gpu_ids(make_mixed_plan(node_of_decode="node-1"))


def up_args(port: int = 8000) -> argparse.Namespace:
    """The options of `distserve up` that choose what it launches."""
    return argparse.Namespace(colocated=0, backend="process", ray_address=None,
                              host="127.0.0.1", port=port)


def test_up_on_cuda_gives_each_instance_process_its_gpus_and_on_the_cpu_none():
    spec = local_spec()
    cpu = build_launcher(up_args(), spec, "mixed", "/models/x", make_mixed_plan())
    cpu.stop()  # never started: removes its work folder
    assert [p.gpu_ids for p in cpu.procs] == [None] * 4
    spec.engine.device = "cuda"
    cuda = build_launcher(up_args(), spec, "mixed", "/models/x", make_mixed_plan())
    cuda.stop()
    assert [p.gpu_ids for p in cuda.procs] == [(0, 1), (2, 3), (4,), None]


@pytest.mark.slow
def test_a_mixed_plan_launched_by_up_answers_as_one_engine(tiny_llama, deployment):
    reference_url, _ = deployment
    expected = completions(reference_url)
    launcher = build_launcher(up_args(free_port_block(4)), local_spec(), "mixed", tiny_llama,
                              make_mixed_plan())
    with launcher:
        assert [(p.name, dataclasses.astuple(p.parallel)) for p in launcher.procs[:-1]] == [
            ("prefill-0", (2, 1)), ("prefill-1", (1, 2)), ("decode-0", (1, 1))]
        assert completions(launcher.url) == expected  # ties go to prefill-0, the tp2 one
        launcher.stop_process(launcher.procs[0])  # then prefill-1, the two-stage one, serves
        launcher.write_router_settings(launcher.settings)
        assert wait_until(lambda: "prefill-0" not in router_instances(launcher.url), 60)
        assert completions(launcher.url) == expected
