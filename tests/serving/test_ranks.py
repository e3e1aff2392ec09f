"""Instances on several ranks (gloo, one process per rank) answer as one rank does.

The deployment runs as `distserve up` runs it: the launcher starts one server process
per instance, each starts its own other ranks, and the KV goes through the real
transfer path (gathered from every rank of the prefill instance, scattered over the
ranks of the decode instance).
"""

from __future__ import annotations

import httpx
import pytest
from serving_helpers import make_settings
from test_up import free_port_block

from distserve.local.launcher import LocalLauncher, plan_processes
from distserve_engine.config import EngineConfig
from distserve_engine.instance.ranks import RankLayout, layout_for
from distserve_engine.server.settings import Parallelism, ServeSettings

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog and", "a b c"]


def completions(url: str, max_tokens: int = 8) -> list[str]:
    """Greedy completions of PROMPTS, one request each."""
    texts = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens
        texts.append(r.json()["choices"][0]["text"])
    return texts


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [
    {"prefill-0": {"tp": 2, "pp": 1}, "decode-0": {"tp": 1, "pp": 2}},
    {"prefill-0": {"tp": 1, "pp": 2}, "decode-0": {"tp": 2, "pp": 1}},
])
def test_multi_rank_instances_give_one_rank_tokens(tiny_llama, deployment, parallel):
    reference_url, _ = deployment
    expected = completions(reference_url)
    settings = make_settings(tiny_llama, parallel=parallel)
    with LocalLauncher(settings, port=free_port_block(3)) as launcher:
        assert completions(launcher.url) == expected
        load = httpx.get(f"{launcher.procs[0].url}/load", timeout=10).json()
        assert load["kv_usage"] == 0.0  # the pulled KV was freed on every prefill rank


def test_launcher_gives_each_rank_a_core(tmp_path):
    settings = ServeSettings(EngineConfig("/models/x"), instances={"prefill": 2, "decode": 1},
                             parallel={"prefill-0": Parallelism(), "prefill-1": Parallelism(tp=2, pp=1),
                                       "decode-0": Parallelism()})
    procs = plan_processes(settings, tmp_path / "serve.json", "127.0.0.1", 9000, num_cores=4)
    assert [(p.name, p.cores) for p in procs] == [
        ("prefill-0", [0]), ("prefill-1", [1, 2]), ("decode-0", [3]), ("router-0", None)]


def test_layout_from_the_instance_s_entry_and_the_pod_s_stage(tmp_path):
    config = tmp_path / "serve.json"
    config.write_text('{"engine": {"model": "/models/x"}, "parallel": {'
                      '"prefill-0": {"tp": 2, "pp": 2}, "prefill-1": {"tp": 1, "pp": 1}}}')
    local = layout_for(config, "prefill", "prefill-0", env={})
    assert (local.world_size, local.local_ranks) == (4, [0, 1, 2, 3])
    assert local.init_method.startswith("tcp://127.0.0.1:")
    assert layout_for(config, "prefill", "prefill-1", env={}) == RankLayout()
    with pytest.raises(ValueError, match=r"no entry for instance 'decode-0' .* it has \['prefill-0', 'prefill-1'\]"):
        layout_for(config, "decode", "decode-0", env={})
    pod_env = {"MASTER_ADDR": "s0.p0", "MASTER_PORT": "29500"}
    pod = layout_for(config, "prefill", "prefill-0", stage=1, env=pod_env)
    assert (pod.tp, pod.pp) == (2, 2)
    assert (pod.local_ranks, pod.is_driver, pod.init_method) == ([2, 3], False, "tcp://s0.p0:29500")
    assert local.split_cores([0, 1, 2, 3, 4, 5, 6, 7]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert local.split_cores([0]) == [[0]] * 4


def test_a_pod_whose_instance_the_settings_do_not_name_is_an_error_naming_it(tmp_path):
    config = tmp_path / "serve.json"
    config.write_text('{"engine": {"model": "/models/x"}, "parallel": {"prefill-0": {"pp": 2}}}')
    pod_env = {"MASTER_ADDR": "s0.p0"}
    with pytest.raises(ValueError, match="parallel has no entry for instance 'prefill-9'"):
        layout_for(config, "prefill", "prefill-9", stage=1, env=pod_env)
    with pytest.raises(ValueError, match=r"--stage 2: parallel\.prefill-0\.pp is 2"):
        layout_for(config, "prefill", "prefill-0", stage=2, env=pod_env)
