"""How steady this host keeps the engine's speed, with nothing else of the deployment
running: the baseline to set a `distserve fidelity` run's speed moves against.

Two processes, each pinned to a core of its own with one thread (as `distserve up` pins
1 prefill + 1 decode): one runs SmolLM2's runner on the same prefill batch over and over,
the other the same decode step. Both run for `--seconds` at once, so each sees the
other's cache and memory traffic as in serving, but no router, HTTP, KV transfer or
clients. Per phase it prints the calls, their spread, and for windows of 10 s to a
half-run, how far the windows' mean times spread (sd of log, range), and how far
consecutive windows moved: what a prediction made from one window would miss the next
by. The engine thread's CPU time is printed beside the wall time (a window slower in
CPU time too computed slower; one slower in wall time only waited for its core). It
asserts nothing.

    .venv/bin/python benchmarks/runner_steadiness.py [--seconds 600] [--prefill 512] [--decode 16x300]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import time

import numpy as np

WINDOWS_S = (10, 30, 60, 150)


def _phase_args(text: str) -> tuple[int, int]:
    """"BxC" -> (batch, context)."""
    batch, _, context = text.partition("x")
    try:
        return int(batch), int(context)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT like 16x300, got {text!r}") from None


def _run(phase: str, core: int, seconds: float, prefill_tokens: int,
         decode: tuple[int, int], go, answers, parent: int) -> None:
    """One phase's calls, timed, for `seconds`, on `core` alone, put on `answers` as
    (start, wall, cpu) each once `go` says so; it stops early, without a word, once
    `parent` is gone (killed: nobody to tell)."""
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    from smollm2 import engine_runner

    from distserve_engine.profile import time_decode, time_prefill

    runner = engine_runner("auto")
    call = ((lambda: time_prefill(runner, (prefill_tokens,))) if phase == "prefill"
            else (lambda: time_decode(runner, *decode)))
    for _ in range(3):
        call()
    answers.put("ready")
    while True:  # both loaded: start together
        try:
            go.get(timeout=1.0)
            break
        except queue.Empty:
            if os.getppid() != parent:
                return
    started, rows = time.time(), []
    while time.time() - started < seconds:
        if os.getppid() != parent:
            return
        cpu = time.thread_time()
        wall_ms = call()
        rows.append((time.time() - started, wall_ms / 1e3, time.thread_time() - cpu))
    answers.put(rows)


def window_spread(rows: np.ndarray, window_s: float) -> tuple[int, float, float, float, float, float]:
    """(windows, sd of log mean wall time, of CPU time, min and max over the mean, rms
    of the log change between consecutive windows) over whole windows."""
    t, wall, cpu = rows[:, 0], rows[:, 1], rows[:, 2]
    n = int(t.max() // window_s)
    if n < 2:
        return n, 0.0, 0.0, 1.0, 1.0, 0.0
    index = (t // window_s).astype(int)
    walls = np.array([wall[index == k].mean() for k in range(n)])
    cpus = np.array([cpu[index == k].mean() for k in range(n)])
    logs = np.log(walls / walls.mean())
    change = float(np.sqrt(np.mean(np.diff(logs) ** 2)))
    return (n, float(np.std(logs)), float(np.std(np.log(cpus))), float(np.exp(logs.min())),
            float(np.exp(logs.max())), change)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long both run")
    parser.add_argument("--prefill", type=int, default=512, metavar="TOKENS",
                        help="the prefill batch: one prompt of this many tokens")
    parser.add_argument("--decode", type=_phase_args, default=(16, 300), metavar="BxC",
                        help="the decode step: B sequences of C tokens of context")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores to pin the phases apart")
    context = multiprocessing.get_context("spawn")
    phases = ("prefill", "decode")
    queues = {phase: (context.Queue(), context.Queue()) for phase in phases}  # (go, answers)
    processes = [context.Process(target=_run, args=(phase, core, args.seconds, args.prefill,
                                                    args.decode, *queues[phase],
                                                    os.getpid()), daemon=True)
                 for phase, core in zip(phases, cores, strict=False)]
    for process in processes:
        process.start()
    for phase in phases:
        queues[phase][1].get()  # ready
    for phase in phases:
        queues[phase][0].put("go")
    results = {phase: np.array(queues[phase][1].get()) for phase in phases}
    for process in processes:
        process.join()
    batch, context_len = args.decode
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
          f"{args.seconds:g} s, prefill of {args.prefill} tokens on core {cores[0]}, decode of "
          f"{batch}x{context_len} on core {cores[1]}, both at once")
    for phase, rows in results.items():
        wall, cpu = rows[:, 1], rows[:, 2]
        print(f"{phase}: {len(rows)} calls, mean {wall.mean() * 1e3:.1f} ms, on its core "
              f"{cpu.sum() / wall.sum():.1%} of the time, per call sd {np.std(np.log(wall)):.1%}")
        for window_s in (*WINDOWS_S, args.seconds / 2):
            n, sd, cpu_sd, low, high, change = window_spread(rows, window_s)
            if n < 2:
                continue
            print(f"  {window_s:5.0f} s windows: {n:3d}, sd {sd:5.1%} (CPU time {cpu_sd:5.1%}), "
                  f"x{low:.3f}-{high:.3f} the mean; next window moved by {change:.1%} (rms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
