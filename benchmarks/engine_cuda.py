"""Decode tokens/s of SmolLM2-135M on a GPU with CUDA graphs on and off, and the HBM bound.

One runner; each batch is prefilled, then decoded `--steps` steps with the graphs, then
as many with them switched off (the same runner, its `decode_graphs` set aside), the two
alternated `--repeats` times, best kept. The bound at batch 1 is the rate of a step that
only read the weights once at the measured device copy bandwidth (bytes read + written
per second of a 1 GiB copy). Prints the attention path too (FlashAttention's paged
kernel needs flash-attn and `--block-size` a multiple of 256).

    python benchmarks/engine_cuda.py [--dtype bfloat16] [--batches 1 64 256] [--block-size 16]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from smollm2 import random_prompts, smollm2_folder

from distserve_engine import flash_paged
from distserve_engine.config import EngineConfig
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence


def decode_rate(runner: ModelRunner, prompts: list[list[int]], steps: int, is_graphed: bool) -> float:
    """Decode tokens/s over `steps` steps after one prefill (graphs on or off)."""
    graphs = runner.decode_graphs
    runner.decode_graphs = graphs if is_graphed else None
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, p, params) for i, p in enumerate(prompts)]
    try:
        runner.prefill(seqs)
        runner.decode(seqs)  # a graph of a new shape is captured here, outside the timing
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            runner.decode(seqs)
        torch.cuda.synchronize()
        return len(prompts) * steps / (time.perf_counter() - start)
    finally:
        runner.decode_graphs = graphs
        for seq in seqs:
            runner.free(seq)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device bytes read plus written per second by one large copy (best of 3)."""
    src = torch.ones(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = max(best, 2 * nbytes / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    runner = ModelRunner(EngineConfig(
        model=str(smollm2_folder()), device="cuda", dtype=args.dtype, block_size=args.block_size,
        max_model_len=2048, max_num_seqs=max(args.batches), kv_cache_bytes=8 << 30,
    ))
    weight_bytes = runner.model.weight_bytes_read()
    bound = copy_bandwidth() / weight_bytes
    path = "flash paged" if flash_paged.is_supported("cuda", runner.dtype, args.block_size) \
        else "gather + SDPA"
    print(f"# SmolLM2-135M {args.dtype} on {torch.cuda.get_device_name()}, prompt_len="
          f"{args.prompt_len}, steps={args.steps}, block_size={args.block_size}, attention: "
          f"{path}, weights {weight_bytes / 2**20:.0f} MiB, HBM bound at batch 1 "
          f"{bound:.0f} steps/s, cpu load={os.getloadavg()[0]:.1f}")
    for batch in args.batches:
        prompts = random_prompts(batch, args.prompt_len, seed=batch)
        on, off = [], []
        for _ in range(args.repeats):
            on.append(decode_rate(runner, prompts, args.steps, is_graphed=True))
            off.append(decode_rate(runner, prompts, args.steps, is_graphed=False))
        share = f" ({max(on) / bound:4.0%} of the HBM bound)" if batch == 1 else ""
        print(f"batch={batch:4d} decode tok/s graphs={max(on):9.1f} eager={max(off):9.1f} "
              f"ratio={max(on) / max(off):5.2f}x{share} cpu load={os.getloadavg()[0]:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
