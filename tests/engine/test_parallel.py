"""Tensor and pipeline parallelism on the CPU (gloo, 2 processes) give tp=1, pp=1 tokens."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_correctness import make_prompts, tiny_runner

from distserve_engine.config import EngineConfig
from distserve_engine.generate import generate
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams

PARAMS = [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.9, top_k=40, seed=3, ignore_eos=True),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, folder: str, tp: int, pp: int, port: int, out_dir: str) -> None:
    """One rank: build the runner, generate the same batches as every rank, save tokens."""
    torch.set_num_threads(1)
    config = EngineConfig(model=folder, num_blocks=64, tp=tp, pp=pp,
                          dist_init_method=f"tcp://127.0.0.1:{port}")
    runner = ModelRunner(config, rank=rank)
    prompts = make_prompts(runner.model_config.vocab_size, [7, 19, 4], seed=6)
    tokens = [[s.output_token_ids for s in generate(runner, prompts, p)] for p in PARAMS]
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"tokens": tokens, "layers": list(runner.model.layer_range),
                   "kv_heads": runner.kv_cache.shape.num_kv_heads}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("fixture, tp, pp", [
    ("tiny_llama_dir", 2, 1), ("tiny_llama_dir", 1, 2),
    pytest.param("tiny_opt_dir", 2, 1, marks=pytest.mark.slow),
])
def test_two_ranks_match_one(fixture, tp, pp, request, tmp_path):
    folder = request.getfixturevalue(fixture)
    single = tiny_runner(folder)
    prompts = make_prompts(single.model_config.vocab_size, [7, 19, 4], seed=6)
    expected = [[s.output_token_ids for s in generate(single, prompts, p)] for p in PARAMS]
    mp.spawn(rank_main, args=(str(folder), tp, pp, free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["tokens"] == expected
    assert ranks[1]["tokens"] == expected
    if pp == 2:  # each stage holds half the layers
        assert (ranks[0]["layers"], ranks[1]["layers"]) == ([0], [1])
    else:  # each tp rank holds half the KV heads
        assert ranks[0]["kv_heads"] == single.kv_cache.shape.num_kv_heads // 2


def test_tp_must_divide_heads(tiny_llama_dir):
    with pytest.raises(ValueError, match="tp: 3 does not divide the model's num_heads"):
        ModelRunner(EngineConfig(model=str(tiny_llama_dir), tp=3, dist_init_method="tcp://127.0.0.1:1"))
