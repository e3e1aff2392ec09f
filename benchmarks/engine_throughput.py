"""Prefill and decode tokens/s of the engine vs `transformers` generate, SmolLM2-135M, CPU.

Both run the same weights on the same prompts in this process, with the same torch
thread count. The machine is shared, so each measurement alternates engine and
transformers `--repeats` times and keeps the best rate of each. Decode tokens/s = batch * steps / decode time; for transformers the decode
time is generate(steps + 1 new tokens) minus generate(1 new token).

    python benchmarks/engine_throughput.py [--dtype float32|bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from smollm2 import engine_runner, hf_model, random_prompts

from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence


def engine_rates(runner, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) for one batch."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, p, params) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    runner.prefill(seqs)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        runner.decode(seqs)
    decode_s = time.perf_counter() - start
    for seq in seqs:
        runner.free(seq)
    return sum(map(len, prompts)) / prefill_s, len(prompts) * steps / decode_s


@torch.inference_mode()
def hf_rates(model, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of transformers generate (greedy, no early stop)."""
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
        return time.perf_counter() - start

    prefill_s = run(1)
    total_s = run(steps + 1)
    return ids.numel() / prefill_s, len(prompts) * steps / max(total_s - prefill_s, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = engine_runner(args.dtype)
    model = hf_model(runner, runner.dtype)
    print(f"# SmolLM2-135M {args.dtype} CPU, torch threads={args.threads}, prompt_len="
          f"{args.prompt_len}, decode steps={args.steps}, loadavg={os.getloadavg()[0]:.1f}")
    engine_rates(runner, random_prompts(2, 16, seed=99), 2)  # warm-up
    hf_rates(model, random_prompts(2, 16, seed=99), 2)
    for batch in args.batches:
        prompts = random_prompts(batch, args.prompt_len, seed=batch)
        engine_runs, hf_runs = [], []
        for _ in range(args.repeats):
            engine_runs.append(engine_rates(runner, prompts, args.steps))
            hf_runs.append(hf_rates(model, prompts, args.steps))
        e_prefill, e_decode = map(max, zip(*engine_runs, strict=True))
        h_prefill, h_decode = map(max, zip(*hf_runs, strict=True))
        print(f"batch={batch:3d}  decode tok/s engine={e_decode:8.1f} transformers={h_decode:8.1f}"
              f" ratio={e_decode / h_decode:5.2f}x | prefill tok/s engine={e_prefill:8.1f} "
              f"transformers={h_prefill:8.1f} ratio={e_prefill / h_prefill:5.2f}x")


if __name__ == "__main__":
    main()
