"""Where a decode step and a prefill batch of SmolLM2-135M spend their time, per operator.

torch.profiler records every aten operator of a few steps; each operator's self time is
put in one bucket: GEMMs (mm, addmm, linear), SDPA (everything under
scaled_dot_product_attention), or the engine function it ran under (rotary, norms, the
KV cache write, the paged-context gather, the prefill attention, metadata, sampling,
embedding, the rest of attention), found by wrapping those functions in
`record_function` labels for this run.
Each labelled function's own time outside its operators (its Python, and the C kernels it
calls through ctypes, which make no operator events: the packed linears, decode
attention, RMSNorm; a Llama decode step's layers, all in one call) goes to its label;
"python + alloc" is the step's wall time under the profiler less all of that.

    python benchmarks/engine_profile.py [--threads 1] [--steps 4] [--top 12] [--dtype auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import time

import torch
from smollm2 import engine_runner, random_prompts
from torch.profiler import ProfilerActivity, profile, record_function

from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
            "mkldnn::_linear_pointwise"}
# (module, attribute, label): engine functions whose operators are bucketed by label.
LABELLED = [
    ("distserve_engine.attention", "build_metadata", "metadata"),
    ("distserve_engine.attention", "gather_context", "context gather"),
    ("distserve_engine.attention", "write_kv", "kv write"),
    ("distserve_engine.attention", "paged_attention", "attention other"),
    ("distserve_engine.attention", "_decode_native", "attention kernel"),
    ("distserve_engine.attention", "_attend_new", "prefill attention"),
    ("distserve_engine.models.llama", "LlamaForCausalLM._decode_in_c", "decode layers (one C call)"),
    ("distserve_engine.models.layers", "_packed_linear", "GEMM (C, packed)"),
    ("distserve_engine.models.layers", "RotaryEmbedding.forward", "rotary"),
    ("distserve_engine.models.layers", "RotaryEmbedding.table", "rotary"),
    ("distserve_engine.models.layers", "RotaryEmbedding.rotate_", "rotary"),
    ("distserve_engine.models.layers", "RMSNorm.forward", "norms"),
    ("distserve_engine.models.base", "CausalLM.compute_logits", "lm head"),
    ("distserve_engine.sampling", "Sampler.__call__", "sampling"),
    ("torch.nn.modules.sparse", "Embedding.forward", "embedding"),
    ("distserve_engine.models.llama", "LlamaMLP.forward", "mlp other"),
]
LABELS = {label for *_, label in LABELLED}


def _wrap(module_name: str, attribute: str, label: str) -> None:
    module = importlib.import_module(module_name)
    owner, name = module, attribute
    if "." in attribute:
        class_name, name = attribute.split(".")
        owner = getattr(module, class_name, None)
    original = getattr(owner, name, None) if owner is not None else None
    if original is None:
        return  # absent in this version of the engine

    @functools.wraps(original)
    def labelled(*args, **kwargs):
        with record_function(label):
            return original(*args, **kwargs)

    setattr(owner, name, labelled)


def bucket(event) -> str:
    """The bucket of one profiler event's self time."""
    if event.name in GEMM_OPS:
        return "GEMM"
    parent = event.cpu_parent
    while parent is not None:
        if "scaled_dot_product" in parent.name:
            return "SDPA"
        parent = parent.cpu_parent
    if "scaled_dot_product" in event.name:
        return "SDPA"
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in LABELS:
            return parent.name
        parent = parent.cpu_parent
    return "other ops"


def profile_steps(run, steps: int) -> tuple[dict[str, float], collections.Counter, float]:
    """Per-bucket ms per step, top operators by self ms per step, and the wall ms per step."""
    run()  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            run()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    buckets: dict[str, float] = collections.defaultdict(float)
    ops: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.name.startswith("ProfilerStep"):
            continue
        self_ms = event.self_cpu_time_total / 1e3 / steps
        if event.name in LABELS:  # its Python and C kernels (ctypes: no operator events)
            buckets[event.name] += self_ms
            continue
        buckets[bucket(event)] += self_ms
        ops[event.name] += self_ms
    buckets["python + alloc"] = wall_ms - sum(buckets.values())
    return buckets, ops, wall_ms


def plain_ms(run, steps: int) -> float:
    """Wall ms per step without the profiler (best of two rounds)."""
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(steps):
            run()
        best = min(best, (time.perf_counter() - start) * 1e3 / steps)
    return best


def decode_case(runner, batch: int, prompt_len: int, steps: int):
    """A run() that does one decode step at `batch`, contexts growing from prompt_len."""
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, p, params) for i, p in enumerate(random_prompts(batch, prompt_len, batch))]
    runner.prefill(seqs)
    return (lambda: runner.decode(seqs)), (lambda: [runner.free(s) for s in seqs])


def prefill_case(runner, batch: int, prompt_len: int):
    """A run() that prefills `batch` prompts of prompt_len tokens and frees them."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = random_prompts(batch, prompt_len, seed=batch)

    def run():
        seqs = [Sequence(i, p, params) for i, p in enumerate(prompts)]
        runner.prefill(seqs)
        for seq in seqs:
            runner.free(seq)

    return run, lambda: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--only", choices=["decode", "prefill"], help="profile one kind of step")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: the engine's choice on this CPU (as it serves)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for entry in LABELLED:
        _wrap(*entry)
    runner = engine_runner(args.dtype)
    cases = []
    if args.only != "prefill":
        cases += [(f"decode batch={b} ctx~64", *decode_case(runner, b, 64, args.steps)) for b in (1, 8, 32)]
    if args.only != "decode":
        cases += [(f"prefill {n}x{b}", *prefill_case(runner, b, n)) for n, b in ((64, 32), (512, 4))]
    for name, run, cleanup in cases:
        ms = plain_ms(run, args.steps)
        buckets, ops, wall_ms = profile_steps(run, args.steps)
        cleanup()
        print(f"## {name}: {ms:.1f} ms/step plain, {wall_ms:.1f} under the profiler, "
              f"loadavg={os.getloadavg()[0]:.1f}")
        for label, value in sorted(buckets.items(), key=lambda kv: -kv[1]):
            print(f"   {label:16s} {value:8.2f} ms  {100 * value / wall_ms:5.1f}%")
        top = ", ".join(f"{op.removeprefix('aten::')} {v:.2f}" for op, v in ops.most_common(args.top))
        print(f"   top ops (ms): {top}")


if __name__ == "__main__":
    main()
