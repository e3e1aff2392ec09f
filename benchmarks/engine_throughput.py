"""Prefill and decode tokens/s of the engine vs `transformers` generate, SmolLM2-135M, CPU.

Both run the same weights on the same prompts in this process, with the same torch
thread count. The machine is shared, so each measurement alternates engine,
transformers and the rooflines `--repeats` times; rates are medians over the rounds and
each ratio the median of the rounds' own ratios (with their range).
Decode tokens/s = batch * steps / decode time; for transformers the times come from one
generate call, a stopping criterion noting when each token arrives.

With `--torch-paths`, each line also prints the engine as it runs with torch's operators
alone (its C kernels off, each linear's weight as (in, out) only, no packed or
oneDNN-blocked copies), a second runner timed in the same rounds. With `--every-row`,
the engine with a prefill's last layer run past its attention for every prompt token,
not only for the sampled last ones (`CausalLM.forward`'s `rows`), timed in the same
rounds (decode does not change: its ratio reads the rounds' noise).

Each line also prints what it is measured against, timed in the same rounds:
- gemm: the rate if a step did nothing but its matrix multiplies (the engine's own
  weights, its layout, the step's row count: batch for decode, batch * prompt for
  prefill, batch for the linears a prefill runs for its sampled rows alone), and the
  engine's share of it;
- mem (batch 1 decode): the rate if a step only read the weights once at the measured
  copy bandwidth (bytes read + written per second of a 256 MiB tensor copy).

    python benchmarks/engine_throughput.py [--dtype auto|float32|bfloat16] [--threads N]
        [--torch-paths] [--every-row]

`--dtype auto` (the default) is the engine's own choice on this CPU (`EngineConfig.torch_dtype`:
bfloat16 where the CPU multiplies it, SmolLM2's weights being quantized); the header names it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from smollm2 import engine_runner, hf_model, random_prompts

from distserve.local.machine import cpu_model
from distserve_engine import native
from distserve_engine.models.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    linear,
)
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


class _Clock:
    """A stopping criterion that never stops generation and notes when each token came."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@torch.inference_mode()
def hf_rates(model, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of transformers generate (greedy, no early stop), both
    from one call: prefill until the first token, decode from there to the last."""
    from transformers import StoppingCriteriaList

    ids = torch.tensor(prompts)
    clock = _Clock()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1,
                   min_new_tokens=steps + 1, do_sample=False, pad_token_id=2,
                   stopping_criteria=StoppingCriteriaList([clock]))
    decode_s = clock.times[-1] - clock.times[0]
    return ids.numel() / (clock.times[0] - start), len(prompts) * (len(clock.times) - 1) / decode_s


def layer_linears(runner) -> list[torch.nn.Module]:
    """Every linear a step multiplies by (the LM head aside), holding its weight in the
    layout the engine multiplies it in."""
    head = runner.model.lm_head
    return [m for m in runner.model.modules()
            if m is not head and isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def sampled_rows_only(runner) -> list[torch.nn.Module]:
    """The linears a prefill runs for its sampled rows alone (`CausalLM.forward`'s `rows`):
    the last layer's past its attention (all but the fused qkv projection)."""
    last = runner.model.layers[-1]
    return [m for m in last.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))][1:]


def gemm_rate(linears: list[torch.nn.Module], head: torch.nn.Module, rows: int,
              head_rows: int, dtype: torch.dtype, at_head_rows: list[torch.nn.Module] = ()
              ) -> float:
    """Tokens/s of a step that only ran its GEMMs: `rows` through every layer's weights
    (`head_rows` through those of `at_head_rows`) and `head_rows` through the LM head, as
    the engine runs them."""
    inputs = {(m.in_features, n): torch.randn(n, m.in_features, dtype=dtype)
              for m in linears for n in {rows, head_rows}}
    head_input = torch.randn(head_rows, head.in_features, dtype=dtype)
    start = time.perf_counter()
    for module in linears:
        linear(inputs[module.in_features, head_rows if module in at_head_rows else rows], module)
    head(head_input)
    return rows / (time.perf_counter() - start)


def torch_paths_runner(dtype: str):
    """A second runner whose linears keep only their (in, out) copies (a tied LM head its
    plain weight, the embedding's), loaded with the C kernels off (so no packed copies);
    run it within native.torch_paths_only()."""
    with native.torch_paths_only():
        runner = engine_runner(dtype)
    head = runner.model.lm_head
    for module in [*layer_linears(runner), head]:
        if hasattr(module, "weight_blocked"):
            if getattr(module, "weight_t", None) is None and getattr(module, "weight", None) is None:
                module.weight_t = module.weight_blocked.to_dense().t().contiguous()  # bfloat16's
            del module.weight_blocked
    if hasattr(head, "weight") and hasattr(head, "weight_t"):
        del head.weight_t
    return runner


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes read plus written per second by one large tensor copy."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    start = time.perf_counter()
    dst.copy_(src)
    return 2 * nbytes / (time.perf_counter() - start)


def load() -> str:
    """The 1-minute load average, as printed beside each figure."""
    return f"load={os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-paths", action="store_true",
                        help="also time the engine with torch's operators alone")
    parser.add_argument("--every-row", action="store_true",
                        help="also time the engine with a prefill's last layer run for every row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = engine_runner(args.dtype)
    dtype = str(runner.dtype).removeprefix("torch.")
    model = hf_model(runner, runner.dtype)
    plain = torch_paths_runner(dtype) if args.torch_paths else None
    linears, at_batch_rows = layer_linears(runner), sampled_rows_only(runner)
    weight_bytes = runner.model.weight_bytes_read()
    kernels = (" ".join(native.cpu_flags()) or "generic") if native.packed_linear() else "none"
    if dtype == "bfloat16":  # the bfloat16 figures hang on AMX: say whether it ran
        kernels += ", AMX " + ("on" if native.packed_linear_bf16() else "off")
    print(f"# SmolLM2-135M {dtype} ({args.dtype}) CPU ({cpu_model()}, C kernels: {kernels}), torch "
          f"threads={args.threads}, prompt_len={args.prompt_len}, decode steps={args.steps}, "
          f"weights {weight_bytes / 2**20:.0f} MiB, {load()}")
    engine_rates(runner, random_prompts(2, 16, seed=99), 2)  # warm-up
    hf_rates(model, random_prompts(2, 16, seed=99), 2)
    for batch in args.batches:
        prompts = random_prompts(batch, args.prompt_len, seed=batch)
        # per round: engine, transformers, gemm-only, memory bound, torch paths, every row
        rounds = []
        for repeat in range(args.repeats):
            timed = {}
            runs = {"engine": (engine_rates, runner), "transformers": (hf_rates, model)}
            if plain is not None:
                runs["torch paths"] = (plain_rates, plain)
            if args.every_row:
                runs["every row"] = (every_row_rates, runner)
            order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
            for name in order:  # alternate who goes first, so none always meets the same load
                rates, model_or_runner = runs[name]
                timed[name] = rates(model_or_runner, prompts, args.steps)
            head = runner.model.lm_head
            g_prefill, g_decode = (
                gemm_rate(linears, head, batch * args.prompt_len, batch, runner.dtype,
                          at_batch_rows),
                gemm_rate(linears, head, batch, batch, runner.dtype))
            mem = copy_bandwidth() / weight_bytes
            (e_prefill, e_decode), (h_prefill, h_decode) = timed["engine"], timed["transformers"]
            p_prefill, p_decode = timed.get("torch paths", (None, None))
            a_prefill, a_decode = timed.get("every row", (None, None))
            rounds.append(((e_decode, h_decode, g_decode, mem, p_decode, a_decode),
                           (e_prefill, h_prefill, g_prefill, None, p_prefill, a_prefill)))
        for kind, index in (("decode", 0), ("prefill", 1)):
            is_memory_bound = batch == 1 and kind == "decode"
            print(f"batch={batch:3d} {kind:7s} {summary([r[index] for r in rounds], is_memory_bound)}"
                  f" {load()}", flush=True)


def plain_rates(runner, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """engine_rates with the C kernels off."""
    with native.torch_paths_only():
        return engine_rates(runner, prompts, steps)


class _EveryRow:
    """A runner's model whose prefill runs its last layer for every row, the sampled rows
    picked from its output (as the engine ran before `CausalLM.forward` took `rows`)."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, x, meta, kv_cache, rows=None):
        hidden = self.model(x, meta, kv_cache)
        return hidden if rows is None else hidden[rows]

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def every_row_rates(runner, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """engine_rates with a prefill's last layer run for every row."""
    model, runner.model = runner.model, _EveryRow(runner.model)
    try:
        return engine_rates(runner, prompts, steps)
    finally:
        runner.model = model


def summary(rounds: list[tuple[float | None, ...]], with_memory_bound: bool) -> str:
    """Rates as medians over the rounds; each ratio the median of the rounds' own ratios
    (each round timed its figures back to back, so the load it saw is shared), its range."""
    def ratio(i: int, j: int) -> str:
        values = sorted(r[i] / r[j] for r in rounds)
        return f"{statistics.median(values):4.2f}x [{values[0]:4.2f}-{values[-1]:4.2f}]"

    engine, hf, gemm = (statistics.median(r[i] for r in rounds) for i in range(3))
    line = (f"tok/s engine={engine:7.1f} transformers={hf:7.1f} ratio={ratio(0, 1)} "
            f"| gemm-only={gemm:7.1f} share={ratio(0, 2)}")
    if with_memory_bound:
        line += f" | memory bound={statistics.median(r[3] for r in rounds):6.1f} share={ratio(0, 3)}"
    if rounds[0][4] is not None:
        line += (f" | torch paths={statistics.median(r[4] for r in rounds):7.1f} "
                 f"engine/torch paths={ratio(0, 4)}")
    if rounds[0][5] is not None:
        line += (f" | every row={statistics.median(r[5] for r in rounds):7.1f} "
                 f"engine/every row={ratio(0, 5)}")
    return line


if __name__ == "__main__":
    main()
