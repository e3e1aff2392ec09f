"""Decode step time against the memory-bandwidth bound, and KV export/import speed.

SmolLM2-135M on the CPU. The bound is the bytes a decode step must read (all weights
once, plus every sequence's KV) divided by the measured copy bandwidth, counted the
STREAM way (bytes read + bytes written per second). KV export+import moves one
2,048-token sequence's blocks out to contiguous tensors and back into other blocks,
beside a plain tensor copy of the same bytes.

    python benchmarks/engine_memory.py [--dtype float32|bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from smollm2 import engine_runner, random_prompts

from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence

GB = 1e9


def best_seconds(fn, repeats: int = 5) -> float:
    """Fastest of several timed calls (the machine is shared)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth_bytes_per_s(num_bytes: int = 256 << 20) -> float:
    """STREAM-style copy bandwidth: (read + written bytes) / s of a large tensor copy."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_seconds(lambda: dst.copy_(src))


def decode_step_s(runner, batch: int, context_len: int) -> float:
    """Fastest decode step for `batch` sequences at about `context_len` tokens of context."""
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, p, params) for i, p in enumerate(random_prompts(batch, context_len))]
    runner.prefill(seqs)
    seconds = best_seconds(lambda: runner.decode(seqs))
    for seq in seqs:
        runner.free(seq)
    return seconds


def kv_transfer(runner, num_tokens: int) -> tuple[int, float, float, float, float]:
    """(bytes, export s, import s, copy s, copy-into-new s) for a num_tokens sequence.

    Export allocates its blob, so the fair baseline is a copy into a new tensor (clone);
    a copy into an already-touched tensor is printed too.

    The blocks are allocated but not prefilled: copy cost does not depend on the values.
    """
    src = Sequence("src", [1] * num_tokens)
    runner.block_manager.reserve([src], [num_tokens])
    src.num_cached_tokens = num_tokens
    blob = runner.export_kv(src)

    def move_in() -> None:
        dst = Sequence("dst", [1] * num_tokens)
        runner.import_kv(dst, blob)
        runner.free(dst)

    export_s = best_seconds(lambda: runner.export_kv(src))
    import_s = best_seconds(move_in)
    flat = torch.cat([blob.k.flatten(), blob.v.flatten()])
    copy_dst = torch.empty_like(flat)
    copy_s = best_seconds(lambda: copy_dst.copy_(flat))
    clone_s = best_seconds(flat.clone)
    runner.free(src)
    return blob.nbytes, export_s, import_s, copy_s, clone_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = engine_runner(args.dtype)
    bandwidth = copy_bandwidth_bytes_per_s()
    w_bytes = runner.model.weight_bytes_read()
    print(f"# SmolLM2-135M {args.dtype} CPU, torch threads={args.threads}, "
          f"loadavg={os.getloadavg()[0]:.1f}, copy bandwidth={bandwidth / GB:.1f} GB/s "
          f"(read+write), weights={w_bytes / 1e6:.0f} MB, KV={runner.kv_bytes_per_token} B/token")
    for batch in (1, 8, 32):
        step_s = decode_step_s(runner, batch, args.context)
        read_bytes = w_bytes + batch * (args.context + 1) * runner.kv_bytes_per_token
        bound_s = read_bytes / bandwidth
        print(f"decode batch={batch:3d} context={args.context}: step={step_s * 1e3:7.1f} ms "
              f"bound={bound_s * 1e3:6.1f} ms ({read_bytes / 1e6:.0f} MB) "
              f"ratio={step_s / bound_s:5.2f}x")
    nbytes, export_s, import_s, copy_s, clone_s = kv_transfer(runner, 2048)
    print(f"KV 2048 tokens: {nbytes / 1e6:.1f} MB  export={export_s * 1e3:.2f} ms "
          f"({nbytes / export_s / GB:.2f} GB/s)  import={import_s * 1e3:.2f} ms "
          f"({nbytes / import_s / GB:.2f} GB/s)  export+import="
          f"{nbytes / (export_s + import_s) / GB:.2f} GB/s | plain copy into new tensor="
          f"{clone_s * 1e3:.2f} ms ({nbytes / clone_s / GB:.2f} GB/s), into existing="
          f"{copy_s * 1e3:.2f} ms ({nbytes / copy_s / GB:.2f} GB/s)")


if __name__ == "__main__":
    main()
