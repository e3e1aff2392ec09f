"""The LM head's product as the engine runs it, beside a plain `F.linear` on the same
weight, SmolLM2-135M on the CPU, one torch thread: ms per call at 1, 8, 32 and 64 rows.

The engine multiplies 2 or more rows by a oneDNN-blocked copy of the head
(`layers.block_head_for_cpu`); a plain `F.linear` on the (vocab, hidden) weight makes
MKL re-pack it on every call. Each figure is the median of 15 calls after 2 warm-ups.

    python benchmarks/engine_head.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F
from smollm2 import engine_runner


def median_ms(call, calls: int = 15) -> float:
    call()
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    head = engine_runner("float32").model.lm_head
    print(f"# SmolLM2-135M LM head {tuple(head.weight.shape)}, blocked copy: "
          f"{hasattr(head, 'weight_blocked')}, load={os.getloadavg()[0]:.1f}")
    for rows in (1, 8, 32, 64):
        x = torch.randn(rows, head.weight.shape[1])
        plain = median_ms(lambda x=x: F.linear(x, head.weight))
        engine = median_ms(lambda x=x: head(x))
        print(f"M={rows}: plain {plain:.1f} ms, engine head {engine:.1f} ms, {plain / engine:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
