"""scripts/gpu_model.py: SmolLM2's shape travels to the GPU machine without its weights,
and the random model made from it is SmolLM2 to the engine in every dimension."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from distserve_engine.loader import load_model_config, resolve_checkpoint
from distserve_engine.tokenizer import Tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_model.py"
MAX_SHAPE_BYTES = 8 << 20  # what may travel beside the wheels (the device takes 64 MiB in all)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def random_smollm2(smollm2_dir: Path, tmp_path_factory) -> tuple[Path, Path]:
    shape = tmp_path_factory.mktemp("shape")
    made = run("shape", str(shape))
    assert made.returncode == 0, made.stderr
    model = tmp_path_factory.mktemp("model")
    made = run("weights", str(model), "--shape", str(shape))
    assert made.returncode == 0, made.stderr
    assert "135M random weights" in made.stdout
    return shape, model


@pytest.mark.slow
def test_the_shape_is_small_enough_to_travel(random_smollm2):
    shape, _ = random_smollm2
    assert not list(shape.glob("*.safetensors")) and not list(shape.glob("*.gguf"))
    assert sum(f.stat().st_size for f in shape.iterdir()) < MAX_SHAPE_BYTES


@pytest.mark.slow
def test_the_random_model_has_smollm2s_dimensions_and_tokenizer(random_smollm2, smollm2_dir):
    _, model = random_smollm2
    gguf = resolve_checkpoint(str(smollm2_dir))
    made = resolve_checkpoint(str(model))
    made_config, gguf_config = load_model_config(made), load_model_config(gguf)
    assert (made_config.weights_dtype, gguf_config.weights_dtype) == ("bfloat16", "quantized")
    assert dataclasses.replace(made_config, weights_dtype=None) == \
        dataclasses.replace(gguf_config, weights_dtype=None)
    text = "Summarise the following report in three sentences:"
    assert Tokenizer.load(made, []).encode(text) == Tokenizer.load(gguf, []).encode(text)


def test_weights_without_a_shape_names_the_flag(tmp_path):
    made = run("weights", str(tmp_path / "model"), "--shape", str(tmp_path / "nothing"))
    assert made.returncode == 2
    assert "--shape" in made.stderr and "no config.json" in made.stderr
