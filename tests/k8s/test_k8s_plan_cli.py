"""`distserve plan` on a spec that leaves the cluster shape to the Nodes: the shape from
the flags, or from the current kubeconfig's cluster (kmock), or a clear error."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from k8s_factories import make_node
from kmock_cluster import VersionedEmulator, prepare

from distserve.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "distserve.yaml"


def small_spec(tmp_path: Path, **cluster) -> str:
    """The example's OPT-13B with a quick search; the cluster shape left unset."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["planner"] = {"numRequests": 100, "workers": 1}
    doc["spec"]["cluster"] = {"nodeAffinity": "low", **cluster}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def write_kubeconfig(tmp_path: Path, server: str) -> str:
    """A kubeconfig whose current context is an unauthenticated cluster at `server`."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": server}}],
        "users": [{"name": "me", "user": {}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "me"}}],
    }))
    return str(path)


def plan_json(capsys, *argv: str) -> tuple[dict, str]:
    """The plan document and what went to stderr."""
    assert main(["plan", *argv, "--json"]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


@pytest.fixture
def no_kubeconfig(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))


def test_the_example_without_cluster_or_flags_names_the_flags(no_kubeconfig, capsys):
    assert main(["plan", "-f", str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert "spec.cluster.nodes and spec.cluster.gpusPerNode unset" in err
    assert "--nodes" in err and "--gpus-per-node" in err and "--accelerator" in err
    assert "Traceback" not in err


def test_flags_give_the_shape_without_a_cluster(no_kubeconfig, tmp_path, capsys):
    doc, err = plan_json(capsys, "-f", small_spec(tmp_path), "--nodes", "2", "--gpus-per-node", "4",
                    "--accelerator", "H100-80GB")
    assert doc["accelerator"] == "H100-80GB"
    assert {s["node"] for s in doc["segments"]} <= {"node-0", "node-1"}
    assert max(g for s in doc["segments"] for g in s["gpu_ids"]) < 4
    assert "cluster: 2 x 4 H100-80GB from the spec and flags" in err


def test_a_flag_below_one_is_refused_naming_it(no_kubeconfig, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "-f", small_spec(tmp_path), "--gpus-per-node", "0"])
    assert "--gpus-per-node" in capsys.readouterr().err


@pytest.mark.kmock(cls=VersionedEmulator)
async def test_the_kubeconfig_cluster_gives_nodes_gpus_and_type(kmock, tmp_path, monkeypatch, capsys):
    prepare(kmock, nodes=2)
    kmock.objects["v1/nodes", None, "gpu-node-b"] = make_node("gpu-node-b", 8, "NVIDIA-H100-80GB-HBM3")
    kmock.objects["v1/nodes", None, "gpu-node-a"] = make_node("gpu-node-a", 8, "NVIDIA-H100-80GB-HBM3")
    kmock.objects["v1/nodes", None, "down"] = make_node("down", 8, ready=False)
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path, str(kmock.servers[0].url)))
    spec = small_spec(tmp_path)  # the cluster section gives no accelerator: the Nodes' is used
    code = await asyncio.to_thread(main, ["plan", "-f", spec, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["accelerator"] == "H100-80GB"
    assert {s["node"] for s in doc["segments"]} <= {"gpu-node-a", "gpu-node-b"}
    assert "cluster: 2 x 8 H100-80GB from the Nodes of the cluster at" in err

    # a flag wins over the cluster; what it leaves unset still comes from the Nodes
    code = await asyncio.to_thread(main, ["plan", "-f", spec, "--json", "--gpus-per-node", "2",
                                          "--accelerator", "A100-80GB"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["accelerator"] == "A100-80GB"
    assert {s["node"] for s in doc["segments"]} <= {"gpu-node-a", "gpu-node-b"}
    assert max(g for s in doc["segments"] for g in s["gpu_ids"]) < 2
    assert "cluster: 2 x 2 A100-80GB from the Nodes of the cluster at" in err


@pytest.mark.kmock(cls=VersionedEmulator)
async def test_a_cluster_with_no_gpu_node_names_the_flags(kmock, tmp_path, monkeypatch, capsys):
    prepare(kmock, nodes=0)
    kmock.objects["v1/nodes", None, "cpu-only"] = make_node("cpu-only", 0)
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path, str(kmock.servers[0].url)))
    code = await asyncio.to_thread(main, ["plan", "-f", small_spec(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "has no Ready node offering nvidia.com/gpu" in err and "--gpus-per-node" in err


def test_an_unreachable_cluster_names_the_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path, "http://127.0.0.1:9"))
    assert main(["plan", "-f", small_spec(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "the cluster at http://127.0.0.1:9 did not answer" in err
    assert "--nodes" in err
