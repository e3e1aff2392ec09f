"""Weights reach the engine: load progress in the log, a router reading only the tokenizer,
and the init container's Hugging Face download (done once, .bin converted)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from distserve_engine import download
from distserve_engine.errors import CheckpointError
from distserve_engine.loader import iter_weights, load_model_config, resolve_checkpoint


def test_loading_logs_progress_per_file(tiny_llama_dir, caplog):
    ckpt = resolve_checkpoint(str(tiny_llama_dir))
    with caplog.at_level(logging.INFO, logger="distserve_engine.loader"):
        names = [name for name, _ in iter_weights(ckpt, load_model_config(ckpt))]
    lines = [r.getMessage() for r in caplog.records if r.name == "distserve_engine.loader"]
    num_files = len(list(tiny_llama_dir.glob("*.safetensors")))
    assert names and lines[0].startswith(f"loading weights from {tiny_llama_dir}: {num_files} files")
    assert lines[-1].startswith(f"loading weights: {num_files}/{num_files} files")
    assert len(lines) == 1 + num_files


def test_a_router_needs_no_weight_files(tiny_llama_dir, tmp_path):
    for path in tiny_llama_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    assert resolve_checkpoint(str(tmp_path), require_weights=False).folder == tmp_path
    with pytest.raises(CheckpointError, match=r"missing \*\.safetensors weights"):
        resolve_checkpoint(str(tmp_path))


def test_bin_only_repositories_take_their_bin_files():
    allow = ["*.json", "*.safetensors"]
    assert download.patterns_for(["config.json", "model.safetensors", "pytorch_model.bin"], allow) == allow
    assert download.patterns_for(["config.json", "pytorch_model.bin"], allow) == [*allow, "*.bin"]
    assert download.patterns_for(["config.json", "pytorch_model.bin"], ["*.json"]) == ["*.json"]


def test_bin_weights_become_safetensors(tmp_path):
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert download.convert_bins(tmp_path) == 1
    assert not (tmp_path / "pytorch_model.bin").exists()
    assert torch.equal(load_file(str(tmp_path / "pytorch_model.safetensors"))["w"], state["w"])


class FakeHub:
    """Stands in for huggingface_hub: records downloads, writes the files asked for."""

    def __init__(self, files):
        self.files, self.calls = files, []

    def list_repo_files(self, repo, revision=None):
        return list(self.files)

    def snapshot_download(self, repo, revision=None, local_dir=None, allow_patterns=None):
        import fnmatch

        self.calls.append(allow_patterns)
        for name in self.files:
            if allow_patterns is None or any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (local_dir / name).write_text("{}")
        return str(local_dir)


def test_a_download_is_done_once_unless_more_files_are_wanted(tmp_path, monkeypatch):
    import huggingface_hub

    hub = FakeHub(["config.json", "model.safetensors"])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: hub)
    folder = tmp_path / "org--m" / "main"
    download.download("org/m", "main", folder, ["*.json"])  # a router: no weights
    assert not (folder / "model.safetensors").exists()
    download.download("org/m", "main", folder, ["*.json", "*.safetensors"])  # an engine
    download.download("org/m", "main", folder, ["*.json", "*.safetensors"])  # a restart
    download.download("org/m", "main", folder, ["*.json"])
    assert hub.calls == [["*.json"], ["*.json", "*.safetensors"]]
    assert (folder / "model.safetensors").exists()
    marker = json.loads((folder / download.MARKER).read_text())
    assert marker == {"repo": "org/m", "revision": "main", "allow": ["*.json", "*.safetensors"]}
    assert not download.is_done(folder, "org/m", "v2", ["*.json"])


def test_a_failed_download_fails_the_init_container(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def refuse():
        raise PermissionError("401 gated repository")

    monkeypatch.setattr(huggingface_hub, "HfApi", refuse)
    code = download.main(["--repo", "org/gated", "--dir", str(tmp_path / "d"), "--allow", "*.json"])
    assert code == 1
    assert "cannot download org/gated@main: 401 gated repository" in capsys.readouterr().err
